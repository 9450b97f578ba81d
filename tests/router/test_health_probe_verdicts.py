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
