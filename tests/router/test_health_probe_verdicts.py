"""Which failed probes count against a worker (regression: healthy workers flapping out under load).

A probe that times out is evidence of a hung worker only when the worker also stopped answering
real requests and the router's own timers fired on time. Refused connections and error statuses
always count.
"""
from __future__ import annotations

import time

from router.breaker import CircuitBreaker
from router.errors import TransportError
from router.health import HealthMonitor
from router.workers import WorkerHandle


class ScriptedTransport:
    """``get`` raises or answers as told; ``delay`` simulates a timer that fires late."""

    def __init__(self, outcome: str, delay: float = 0.0) -> None:
        self.outcome = outcome
        self.delay = delay
        self.calls = 0

    def last_rx(self, endpoint: str) -> float:
        return 0.0   # no stream relayed from this worker (router.transport.Transport.last_rx)

    async def get(self, endpoint: str, path: str, timeout_s: float):
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)  # noqa: ASYNC251 - blocks the loop, as a starved router would be
        if self.outcome == "ok":
            return 200, b"{}"
        if self.outcome == "503":
            return 503, b"{}"
        raise TransportError(self.outcome, endpoint, "scripted")


def _monitor(transport) -> HealthMonitor:
    return HealthMonitor(registry=None, transport=transport, metrics=None, interval_ms=200, timeout_ms=50,
                         max_failures=3)


def _handle() -> WorkerHandle:
    return WorkerHandle(0, "/tmp/none.sock", "m", CircuitBreaker())


async def test_timeouts_take_out_a_worker_that_answers_nothing():
    mon, h = _monitor(ScriptedTransport("timeout")), _handle()
    for _ in range(3):
        assert await mon.probe(h) is False
    assert h.probe_ok is False and h.probe_failures == 3


async def test_timeouts_do_not_take_out_a_worker_that_just_answered_a_request():
    mon, h = _monitor(ScriptedTransport("timeout")), _handle()
    for _ in range(5):
        h.last_head_at = time.monotonic()  # a real request got its response head meanwhile
        await mon.probe(h)
    assert h.probe_ok is True and h.probe_failures == 0


async def test_timeouts_do_not_take_out_a_worker_streaming_an_answer():
    """One long stream, no new response heads: its chunks arriving are the evidence (an engine's
    ``/health`` shares its event loop with the streams it serves)."""
    class Streaming(ScriptedTransport):
        def __init__(self) -> None:
            super().__init__("timeout")
            self.chunk_at = 0.0

        def last_rx(self, endpoint: str) -> float:
            return self.chunk_at

    t = Streaming()
    mon, h = _monitor(t), _handle()
    for _ in range(5):
        t.chunk_at = time.monotonic()   # a chunk of the stream arrived meanwhile
        await mon.probe(h)
    assert h.probe_ok is True and h.probe_failures == 0
    t.chunk_at = time.monotonic() - 10.0   # the stream stalled long ago: timeouts count again
    for _ in range(3):
        await mon.probe(h)
    assert h.probe_ok is False


async def test_timeouts_measured_by_a_starved_router_are_no_verdict():
    mon, h = _monitor(ScriptedTransport("timeout", delay=0.12)), _handle()
    for _ in range(4):
        await mon.probe(h)
    assert h.probe_ok is True and h.probe_failures == 0


async def test_error_status_and_refused_connections_always_count():
    for outcome in ("503", "connect"):
        mon, h = _monitor(ScriptedTransport(outcome)), _handle()
        for _ in range(3):
            h.last_head_at = time.monotonic()
            await mon.probe(h)
        assert h.probe_ok is False, outcome


async def test_one_good_probe_brings_a_worker_back():
    t = ScriptedTransport("timeout")
    mon, h = _monitor(t), _handle()
    for _ in range(3):
        await mon.probe(h)
    assert h.probe_ok is False
    t.outcome = "ok"
    assert await mon.probe(h) is True
    assert h.probe_ok is True and h.probe_failures == 0


async def test_a_404_probe_is_alive_a_server_without_health():
    """Probes go to the engine (one hop); a server without ``/health`` answers 404 and is alive."""
    class Answers404(ScriptedTransport):
        async def get(self, endpoint, path, timeout_s):
            return 404, b"{}"

    m, h = _monitor(Answers404("ok")), _handle()
    h.probe_ok = False
    assert await m.probe(h) is True and h.probe_ok is True


class LineSeg:
    """The router-line atomics a lease touches, in a dict (no segment needed)."""

    def __init__(self) -> None:
        self.v = {"inflight": 0, "dispatched": 0, "prefill": 0, "decode": 0}

    def router_inflight_add(self, wid, d):
        self.v["inflight"] += d
        return self.v["inflight"]

    def dispatched_add(self, wid, n=1):
        self.v["dispatched"] += n
        return self.v["dispatched"]

    def prefill_add(self, wid, d):
        self.v["prefill"] += d
        return self.v["prefill"]

    def decode_add(self, wid, n, ctx):
        self.v["decode"] += n
        return self.v["decode"]

    def outcome_add(self, wid, completed=0, failed=0):
        self.v["completed"] = self.v.get("completed", 0) + completed
        self.v["failed"] = self.v.get("failed", 0) + failed
        return self.v["completed"], self.v["failed"]


def test_lease_reports_outcomes_and_the_monitor_and_breaker_decide():
    """Issue 14: the proxy writes no health state; the lease reports each attempt's outcome."""
    from router.scheduling import Lease

    m = _monitor(ScriptedTransport("ok"))
    seg = LineSeg()
    h = _handle()
    lease = Lease(h, seg, prompt_tokens=10, health=m)
    assert seg.v["inflight"] == 1 and h.local_inflight == 1
    lease.head_seen()
    assert time.monotonic() - h.last_head_at < 1.0          # liveness evidence, kept by the monitor
    lease.refused()
    assert h.probe_ok is False and h.probe_failures == m.max_failures   # out at once
    assert lease.finish(False) is True
    assert h.breaker.failure_rate == 1.0 and seg.v["inflight"] == 0 and h.local_inflight == 0
    assert lease.finish(True) is False                      # exactly once
    assert h.breaker.failure_rate == 1.0

    h2 = _handle()
    h2.breaker = CircuitBreaker(minimum_requests=1, open_time_s=0.0)
    h2.breaker.record(False)                                # open; half-open at once (open_time 0)
    assert h2.breaker.allow()                               # the one half-open probe is out
    Lease(h2, seg, health=m).finish(None)                   # the client left: no verdict, probe freed
    assert h2.breaker.available() and seg.v["inflight"] == 0


async def test_only_ready_or_draining_workers_are_probed_a_starting_one_logs_no_failures(caplog):
    from types import SimpleNamespace

    from dplb_shm import WorkerState

    class Reg:
        def __init__(self, handles) -> None:
            self.handles = handles

        def refresh(self) -> None:
            return None

    handles = {}
    for wid, state in enumerate((WorkerState.STARTING, WorkerState.READY, WorkerState.DRAINING, WorkerState.DEAD)):
        h = WorkerHandle(wid, f"/tmp/none-{wid}.sock", "m", CircuitBreaker())
        h.snap = SimpleNamespace(state=int(state))
        handles[wid] = h
    t = ScriptedTransport("connect")        # nothing listens anywhere
    mon = HealthMonitor(registry=Reg(handles), transport=t, metrics=None, interval_ms=200, timeout_ms=50,
                        max_failures=3)
    with caplog.at_level("WARNING", logger="dplb.router.health"):
        for _ in range(3):
            await mon.tick()
    assert t.calls == 6                                     # workers 1 and 2, three ticks
    assert [h.probe_failures for h in handles.values()] == [0, 3, 3, 0]
    assert handles[0].probe_ok and not handles[1].probe_ok  # the starting engine is not held to probes
    assert [r.getMessage() for r in caplog.records] == ["worker 1 out: 3 failed probes",
                                                        "worker 2 out: 3 failed probes"]
