"""Shared pieces of the fault scenarios: the counted :class:`Result` and :class:`DispatchWatch`."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from bench.faultsuite.cluster import Stack
from bench.faultsuite.load import Outcome, tally
from launcher.stack import wait_for


@dataclass
class Result:
    """Counted outcome of one scenario. Times in seconds; None where not applicable."""

    scenario: str
    injected: str
    sent: int = 0
    ok: int = 0
    honest: int = 0
    lost: int = 0
    detection_s: float | None = None
    recovery_s: float | None = None
    outcomes: list[Outcome] = field(default_factory=list, repr=False)
    extra: dict[str, Any] = field(default_factory=dict)

    def add(self, outs: list[Outcome]) -> None:
        """Count ``outs`` into this result."""
        t = tally(outs)
        self.sent += t["sent"]
        self.ok += t["ok"]
        self.honest += t["honest"]
        self.lost += t["lost"]
        self.outcomes.extend(outs)


class DispatchWatch:
    """Polls slot ``wid``'s router ``dispatched`` counter (every ``interval`` s, in a thread) and
    remembers when it last moved: the moment the router last sent a request to that worker."""

    def __init__(self, seg: Any, wid: int, interval: float = 0.002) -> None:
        self.seg, self.wid, self.interval = seg, wid, interval
        self.last_change = time.monotonic()
        self._last = seg.read_slot(wid).dispatched
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            d = self.seg.read_slot(self.wid).dispatched
            if d != self._last:
                self._last, self.last_change = d, time.monotonic()
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(2)

    def detection_after(self, t_fault: float) -> float:
        """Seconds from ``t_fault`` until the last dispatch to the worker (0 when none followed)."""
        return max(0.0, self.last_change - t_fault)


def circuit_of(st: Stack, base: str, wid: int) -> str | None:
    """Breaker state of worker ``wid`` as the router at ``base`` reports it (None: not listed)."""
    row = st.row(base, wid)
    return None if row is None else row["circuit"]


def eligible(st: Stack, base: str, wid: int) -> bool:
    """True when the router at ``base`` lists worker ``wid`` as eligible."""
    row = st.row(base, wid)
    return bool(row and row["eligible"])


def wait_time(pred: Callable[[], Any], t0: float, timeout: float, what: str) -> float:
    """Wait for ``pred`` (polled every 10 ms) and return the seconds since ``t0`` at which it held."""
    wait_for(pred, timeout, what, interval=0.01)
    return time.monotonic() - t0


def admin_call(base: str, method: str, path: str, **kw: Any) -> int:
    """One admin API call; returns the HTTP status."""
    return httpx.request(method, base + path, timeout=10, **kw).status_code
