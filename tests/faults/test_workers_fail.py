"""Scenarios 1-4 of issue 8: engines and workers die, hang, fail or all go away under load."""
from __future__ import annotations

import pytest

from bench.faultsuite import scenarios as sc
from bench.faultsuite.load import lost_details
from router.config import Config

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]


def test_kill9_of_an_engine_under_load_it_comes_back_ready_by_itself_and_nothing_is_lost():
    """The issue 15 "Shows": the agent restarts the killed engine within its backoff; the dead
    interval is visible in /dplb/status and dplb_worker_ready; only requests in flight on
    the killed engine fail (honestly); the rest — queued or arriving meanwhile — all succeed."""
    r = sc.run_kill_engine("engine")
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["failed_not_in_flight_on_0"] == []        # nothing that had not started on 0 failed
    assert r.ok + r.honest == r.sent and r.honest <= 10
    assert r.detection_s is not None and r.detection_s <= 0.5, r.detection_s
    assert r.extra["after_kill_dispatched_to_0"] == 0
    # the dead interval, then back: in the status API and the gauge an alert reads
    states = r.extra["states0"]
    assert "dead" in states and states[-1] == "ready", states
    g = r.extra["ready_gauge0"]
    assert 0.0 in g and g[-1] == 1.0 and g.index(0.0) < len(g) - 1, g
    assert r.recovery_s is not None and r.recovery_s < 20, r.recovery_s    # 1 s backoff + a sim engine start
    assert r.extra["served_by_0_after_back"] >= 1                          # it takes traffic again
    slot = r.extra["slot0"]
    assert slot.restarts == 1 and slot.last_exit_code == -9 and slot.state.name == "READY"
    row = r.extra["row0"]
    assert row["restarts"] == 1 and row["last_exit_code"] == -9 and row["state"] == "ready"


def test_kill9_of_a_whole_worker_under_load_loses_nothing_and_stops_dispatch_within_half_a_second():
    r = sc.run_kill_engine("worker")
    assert r.lost == 0, lost_details(r.outcomes)
    # only requests in flight on worker 0 may fail, and then honestly (502 or an SSE error event)
    assert r.extra["failed_not_in_flight_on_0"] == []
    assert r.ok + r.honest == r.sent and r.ok >= r.sent - 10
    assert r.detection_s is not None and r.detection_s <= 0.5, r.detection_s
    assert r.extra["after_kill_dispatched_to_0"] == 0
    row = r.extra["row0"]    # no launcher here restarts the agent: its slot keeps READY with a stale heartbeat
    assert row is not None and row["eligible"] is False and row["routing"] == "stale"


def test_frozen_worker_times_out_once_with_504_and_is_marked_out():
    r = sc.run_hung_worker(first_byte_timeout_s=1.0)
    assert r.lost == 0, lost_details(r.outcomes)
    # the requests caught on the frozen worker: 504 naming it, after one timeout, not re-run elsewhere
    assert r.extra["failed_not_504_on_0"] == [] and r.honest == r.extra["status_504_on_0"] >= 1
    assert r.extra["eligible_while_hung"] is False
    assert r.detection_s is not None and r.detection_s <= 1.5
    assert r.extra["slowest_s"] < 1.0 + 3.0
    assert r.recovery_s is not None


def test_frozen_worker_requests_are_retried_elsewhere_when_the_operator_asks():
    r = sc.run_hung_worker(first_byte_timeout_s=1.0, retry_on_timeout=True)
    assert r.lost == 0 and r.honest == 0 and r.ok == r.sent, lost_details(r.outcomes)
    assert r.extra["eligible_while_hung"] is False
    assert r.extra["slowest_s"] < 1.0 + 3.0


def test_hung_engine_requests_time_out_with_504_and_open_its_breaker():
    r = sc.run_engine_hang(first_byte_timeout_s=0.5)
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["tried_on_hung"] >= 4
    # each request sent to the hung worker: one 504, not run again on worker 1
    assert r.extra["statuses"] == {200: r.sent - r.extra["tried_on_hung"], 504: r.extra["tried_on_hung"]}
    assert r.extra["served"]["0"] == r.extra["tried_on_hung"]
    assert r.extra["circuit0"] == "open"


def test_hung_engine_requests_retry_elsewhere_when_the_operator_asks():
    r = sc.run_engine_hang(first_byte_timeout_s=0.5, retry_on_timeout=True)
    assert r.lost == 0 and r.ok == r.sent, lost_details(r.outcomes)
    assert r.extra["tried_on_hung"] >= 4
    assert r.extra["served"] == {"1": r.sent}
    assert r.extra["circuit0"] == "open"


def test_long_prefill_is_not_cut_by_the_default_timeout():
    assert Config().router.first_byte_timeout_s >= 300    # a 128k-token prefill on a busy engine takes minutes
    r = sc.run_long_prefill_default(delay=3.0)
    assert r.ok == r.sent and r.extra["min_latency_s"] >= 3.0


def test_500s_open_the_breaker_recovery_closes_it_and_4xx_429_never_open_it():
    # the breaker stays open 8 s: its state is read once the 500s' load has ended, which on a busy
    # machine can be seconds after it opened (with 2.5 s it was read half-open)
    r = sc.run_breaker(open_time_s=8.0)
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["circuit_after_500s"] == "open" and r.extra["segment_circuit"] == 1
    assert r.extra["circuit_after_recovery"] == "closed" and r.extra["served_by_0_after"] >= 1
    for code in ("400", "429"):
        assert r.extra[f"requests_to_0_{code}"] >= 6 + 2    # more than the breaker's minimum_requests
        assert r.extra[f"circuit_after_{code}"] == "closed"
        assert r.extra[f"failure_rate_after_{code}"] == 0.0
    # the 500s were retried on worker 1 and 429s too; only the client's own 400s came back
    assert r.honest == r.extra["requests_to_0_400"]


def test_all_workers_dead_503_with_retry_after_then_rejoin_without_restart():
    r = sc.run_all_dead()
    assert r.extra["health"] == (503, "1")
    assert r.extra["statuses_while_dead"] == {503: 10}
    assert r.extra["retry_after"] == ["1"]
    assert r.lost == 0 and r.honest == 10 and r.ok == 10
    assert r.extra["served_after"] == {"0": 10}
    assert r.extra["router_alive"] and r.extra["health_after"] == 200


def test_remote_worker_dead_then_back_on_the_same_address_rejoins():
    r = sc.run_remote_rejoin()
    assert set(r.extra["statuses_while_dead"]) == {503}
    assert r.lost == 0 and r.honest == 5 and r.ok == 5
    assert r.recovery_s is not None
    assert len(r.extra["served_after"]) == 1
