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
        self.changes: list[float] = []   # every moment the counter moved
        self.states: list[tuple[float, str]] = []   # (time, state name) at every slot state change
        self._last = seg.read_slot(wid).dispatched
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            snap = self.seg.read_slot(self.wid)
            if not self.states or self.states[-1][1] != snap.state.name:
                self.states.append((time.monotonic(), snap.state.name))
            d = snap.dispatched
            if d != self._last:
                self._last, self.last_change = d, time.monotonic()
                self.changes.append(self.last_change)
            time.sleep(self.interval)

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(2)

    def detection_after(self, t_fault: float, until: float | None = None) -> float:
        """Seconds from ``t_fault`` until the last dispatch to the worker (0 when none followed);
        with ``until``, only dispatches before it count (the worker came back then)."""
        if until is None:
            return max(0.0, self.last_change - t_fault)
        before = [t for t in self.changes if t_fault <= t < until]
        return max(0.0, max(before) - t_fault) if before else 0.0

    def state_at(self, name: str, after: float) -> float | None:
        """When the slot first entered state ``name`` (``READY``, ``STARTING``, ...) after ``after``."""
        return next((t for t, n in self.states if t >= after and n == name), None)


class StatusWatch:
    """Polls ``GET /dplb/status`` and ``GET /metrics`` of the router at ``base`` (every
    ``interval`` s, in a thread) and records worker ``wid``'s timeline: ``(t, state, routing,
    ready_gauge)`` per poll (``None`` where the worker is not listed / has no series)."""

    def __init__(self, base: str, wid: int, interval: float = 0.1) -> None:
        self.base, self.wid, self.interval = base, wid, interval
        self.samples: list[tuple[float, str | None, str | None, float | None]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=5) as c:
            while not self._stop.is_set():
                try:
                    rows = c.get("/dplb/status").json()["workers"]
                    row = next((w for w in rows if w["id"] == self.wid), None)
                    gauge = metric_value(c.get("/metrics").text, "dplb_worker_ready", worker=str(self.wid))
                    self.samples.append((time.monotonic(), row and row["state"], row and row["routing"], gauge))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                self._stop.wait(self.interval)

    def __enter__(self) -> Self:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)

    def states(self) -> list[str | None]:
        """The distinct states seen, in order (consecutive repeats folded)."""
        out: list[str | None] = []
        for _, st, _, _ in self.samples:
            if not out or out[-1] != st:
                out.append(st)
        return out

    def gauges(self) -> list[float | None]:
        """The distinct ready-gauge values seen, in order (consecutive repeats folded)."""
        out: list[float | None] = []
        for *_, g in self.samples:
            if not out or out[-1] != g:
                out.append(g)
        return out

    def first(self, pred: Callable[[tuple[float, str | None, str | None, float | None]], bool],
              after: float = 0.0) -> float | None:
        """Time of the first sample after ``after`` that satisfies ``pred``, else None."""
        for smp in self.samples:
            if smp[0] >= after and pred(smp):
                return smp[0]
        return None


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the series ``name{labels}`` in Prometheus exposition ``text`` (None: absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                return float(smp.value)
    return None


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
