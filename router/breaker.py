"""Per-worker circuit breaker over a sliding window of request outcomes.

States (the numbers are what ``seg.circuit_set`` stores, so every router process and
``dplb-shm-dump`` see them)::

      CLOSED(0) ──failure rate > threshold over ≥ minimum_requests──► OPEN(1)
         ▲                                                              │ open_time_s elapsed
         │ probe succeeds                                               ▼
         └──────────────────────────────── HALF_OPEN(2) ◄───────────────┘
                                             │ probe fails → OPEN(1)

Only connection errors, timeouts and 5xx are failures; 4xx and 429 are the client's or a
rate-limit's doing and count as successes (``record(ok=True)``). In HALF_OPEN exactly one request
(the probe) is let through at a time. Defaults (threshold 0.15, minimum 20) come from docs/DESIGN.md "Router".
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = 0, 1, 2
STATE_NAMES = {CLOSED: "closed", OPEN: "open", HALF_OPEN: "half_open"}


class CircuitBreaker:
    """``failure_rate_threshold`` (0..1), ``minimum_requests`` (window must hold at least this many
    outcomes before it can open), ``window_size`` (last N outcomes kept), ``open_time_s``.
    ``clock`` returns seconds (monotonic); injectable for tests. ``on_change(state)`` is called on
    every transition."""

    __slots__ = (
        "_failures",
        "_opened_at",
        "_probe_out",
        "_window",
        "clock",
        "minimum",
        "on_change",
        "open_time_s",
        "state",
        "threshold",
    )

    def __init__(self, failure_rate_threshold: float = 0.15, minimum_requests: int = 20, window_size: int = 100,
                 open_time_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[int], None] | None = None) -> None:
        self.threshold = failure_rate_threshold
        self.minimum = minimum_requests
        self.open_time_s = open_time_s
        self.clock = clock
        self.on_change = on_change
        self.state = CLOSED
        self._window: deque[bool] = deque(maxlen=max(window_size, minimum_requests))
        self._failures = 0
        self._opened_at = 0.0
        self._probe_out = False

    def _set(self, state: int) -> None:
        if state != self.state:
            self.state = state
            if self.on_change is not None:
                self.on_change(state)

    @property
    def failure_rate(self) -> float:
        """Failures / outcomes in the current window (0.0 when empty)."""
        return self._failures / len(self._window) if self._window else 0.0

    def allow(self) -> bool:
        """May a request be sent now? Moves OPEN → HALF_OPEN after ``open_time_s`` and hands out
        the single probe slot; does not consume anything when CLOSED."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self.clock() - self._opened_at < self.open_time_s:
                return False
            self._set(HALF_OPEN)
            self._probe_out = False
        if self._probe_out:
            return False
        self._probe_out = True
        return True

    def available(self) -> bool:
        """Like :meth:`allow` but without taking the probe slot (eligibility). Moves OPEN →
        HALF_OPEN once ``open_time_s`` has passed."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if self.clock() - self._opened_at < self.open_time_s:
                return False
            self._set(HALF_OPEN)  # publish half-open so the kernel lets the probe through
            self._probe_out = False
            return True
        return not self._probe_out

    def record(self, ok: bool) -> None:
        """Record one outcome: ``ok=False`` only for connect errors, timeouts and 5xx."""
        if self.state == HALF_OPEN:
            self._probe_out = False
            if ok:
                self._window.clear()
                self._failures = 0
                self._set(CLOSED)
            else:
                self._trip()
            return
        if self.state == OPEN:
            return
        w = self._window
        if len(w) == w.maxlen and not w[0]:
            self._failures -= 1
        w.append(ok)
        if not ok:
            self._failures += 1
            if len(w) >= self.minimum and self._failures / len(w) > self.threshold:
                self._trip()

    def abandon(self) -> None:
        """The request admitted by :meth:`allow` ended without an outcome (client left): free the
        half-open probe slot so another request can probe."""
        if self.state == HALF_OPEN:
            self._probe_out = False

    def _trip(self) -> None:
        self._opened_at = self.clock()
        self._probe_out = False
        self._set(OPEN)

    def reset(self) -> None:
        """Back to CLOSED with an empty window (worker re-added or restarted)."""
        self._window.clear()
        self._failures = 0
        self._probe_out = False
        self._set(CLOSED)
