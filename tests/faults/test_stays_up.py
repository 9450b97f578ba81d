"""Issue 15 regressions, one test per failure an operator saw (named after it); scenarios in
:mod:`bench.faultsuite.scen_issue15`. The kill -9 "Shows" test is scenario 1 in ``test_workers_fail.py``
(``test_kill9_of_an_engine_under_load_it_comes_back_ready_by_itself_and_nothing_is_lost``)."""
from __future__ import annotations

import pytest

from bench.faultsuite import scen_issue15 as sc
from bench.faultsuite.load import lost_details
from router.policies import PrefixIndex, RequestInfo, RoundRobinPolicy

pytestmark = [pytest.mark.faults, pytest.mark.timeout(240)]


def test_crashed_engine_is_restarted_and_one_that_keeps_crashing_stays_dead_and_says_so_until_admin_restart():
    r = sc.run_crash_loop_gave_up_then_admin_restart()
    assert r.lost == 0 and r.honest == 0, lost_details(r.outcomes)
    row = r.extra["row_gave_up"]
    assert row["state"] == "dead" and row["state_reason"] == "gave_up" and row["eligible"] is False
    assert row["restarts"] == 1 and row["last_exit_code"] == -9 and row["restart_in_s"] is None
    assert r.extra["listed_in_workers"]
    assert r.extra["metrics_gave_up"] == {"ready": 0.0, "dead": 1.0, "restarts": 1.0}
    assert r.extra["served_while_dead"] == {"1": 10}
    assert r.extra["restarts_after_wait"] == 1            # it gave up: no attempt of its own
    assert r.extra["admin_restart"][0] == 202 and r.extra["admin_restart"][1]["restarting"] is True
    assert r.extra["slot_after"] == {"state": "READY", "restarts": 2}
    assert r.extra["unknown_restart"] == 404
    assert set(r.extra["served_after"]) == {"0", "1"}     # it takes traffic again
    assert r.extra["agent_log_says"] == ["exited unexpectedly with code -9", "last lines", "giving up",
                                         "restarting engine"]


def test_dead_worker_is_listed_as_dead_with_ready_0_and_departed_workers_leave_no_stale_series():
    r = sc.run_dead_and_departed_workers_in_plain_sight()
    assert r.lost == 0 and r.honest == 0, lost_details(r.outcomes)
    seen = r.extra["seen"]
    want = {0: "dead", 1: "ready", 2: "draining"}
    # the dump, the status API, the admin listing and the metrics agree on every state
    assert seen["status"] == seen["workers"] == seen["dump"] == seen["metric_state"] == want, seen
    assert seen["ready_gauge"] == {0: 0.0, 1: 1.0, 2: 0.0}
    assert r.extra["served"] == {"1": 8}
    after = r.extra["after_leave"]
    assert r.extra["remove_2"] == 200 and after["rows"] == [1]
    assert after["series_0"] == [] and after["series_2"] == [], after
    assert after["ready_1"] == 1.0


def test_slow_request_is_answered_504_once_on_one_worker_not_run_on_every_worker():
    r = sc.run_slow_request_one_504(first_byte_timeout_s=1.0, delay=4.0)
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["status"] == 504 and r.extra["error_type"] == "timeout_error"
    assert sum(r.extra["requests_per_worker"]) == 1, r.extra["requests_per_worker"]      # one worker, once
    assert r.extra["worker_header"] == str(r.extra["requests_per_worker"].index(1))
    assert sum(r.extra["disconnects_per_worker"]) == 1     # the worker was told to stop (connection closed)
    assert 1.0 <= r.extra["elapsed_s"] < 1.0 + 2.5          # one timeout, not three
    assert r.extra["timeout_errors"] == 1.0 and not r.extra["retries"]  # the series starts at 0: no retry
    # a stream whose head came at once but whose first token is late: still a clean 504
    assert r.extra["stream_status"] == 504 and r.extra["stream_elapsed_s"] < 1.0 + 2.5
    # a lone hung worker, nothing else to try: 504 naming it, not 502
    assert r.extra["lone_hung_worker"] == (504, "0")


def test_long_prefill_is_not_cut_but_a_stalled_stream_is_a_timeout_not_stream_broken():
    r = sc.run_first_byte_vs_idle_timeout()
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["prefill_stream"][0] == "ok" and r.extra["prefill_stream"][1] >= 1.5
    kind, status, took = r.extra["stalled_stream"]
    assert kind == "honest" and status == 200 and took < 2.0 + 1.5
    assert r.extra["stalled_error"] == ("timeout_error", 504)
    assert r.extra["errors"] == {"timeout": 1.0, "stream_broken": None}
    assert r.extra["requests_504"] == 1.0


def test_round_robin_alternating_two_models_spreads_each_model_over_its_workers():
    r = sc.run_round_robin_per_model(40)
    assert r.ok == r.sent == 40, lost_details(r.outcomes)
    assert r.extra["model_a"] == {"0": 10, "1": 10} and r.extra["model_b"] == {"2": 10, "3": 10}


def test_round_robin_keeps_one_position_per_model_and_a_bounded_number_of_them():
    class W:
        def __init__(self, i: int) -> None:
            self.worker_id, self.weight = i, 1.0

    pol = RoundRobinPolicy()
    a, b = [W(0), W(1)], [W(2), W(3)]
    picks = [pol.choose(a if i % 2 == 0 else b, RequestInfo(model="a" if i % 2 == 0 else "b")).worker_id
             for i in range(40)]
    assert sorted(picks[0::2].count(w) for w in (0, 1)) == [10, 10]
    assert sorted(picks[1::2].count(w) for w in (2, 3)) == [10, 10]
    for i in range(3000):       # a client naming random models cannot grow the state without bound
        pol.choose(a, RequestInfo(model=f"m{i}"))
    assert len(pol._n) <= pol.max_models


def test_prefix_index_does_not_match_the_same_text_across_models():
    idx = PrefixIndex(chunk_chars=4)
    idx.insert(idx.hashes("aaaabbbbcccc", "model-a"), 0)
    assert idx.match(idx.hashes("aaaabbbbcccc", "model-a")) == {0: 3}
    assert idx.match(idx.hashes("aaaabbbbcccc", "model-b")) == {}


def test_oversized_and_too_many_headers_get_431_before_the_body_and_memory_stays_flat():
    r = sc.run_header_limits()
    codes = r.extra["codes"]
    assert codes["64KB value"] == 431 and codes["200 headers"] == 431 and codes["1KB header"] == 200
    # 16 MB: 431 from the protocol guard (or the connection closed while the client still sent)
    assert codes["16MB header"] in (431, "RemoteProtocolError", "WriteError", "ReadError"), codes
    assert r.extra["forwarded"] == 1                        # only the ordinary request reached the worker
    line, took = r.extra["before_body"]
    assert line.startswith("HTTP/1.1 431") and took < 5.0   # answered without waiting for the 1 MB body
    f = r.extra["flood"]
    assert f["answer"].startswith("HTTP/1.1 431") or "Reset" in f["answer"] or f["answer"] == "", f
    assert f["rss_after_mb"] - f["rss_before_mb"] < 16, f    # an unfinished 64 MB header costs < 16 MB
    assert r.extra["health_after"] == 200


def test_admin_is_not_open_through_a_reverse_proxy_nor_beyond_loopback_without_a_token():
    r = sc.run_admin_exposure()
    assert r.extra["mismatches"] == {}, r.extra
    assert r.extra["open_host_no_token"] == (2, True)
    assert r.extra["open_host_with_token_allowed"] is True


def test_registry_keeps_a_dead_worker_listed_and_resets_it_when_its_engine_restarts():
    """The router dropped a dead worker's handle (it vanished from the listings, its gauges froze)."""
    from dataclasses import replace

    from dplb_shm import StateReason, WorkerSnapshot, WorkerState
    from router.config import Config
    from router.policies.round_robin import RoundRobinPolicy
    from router.scheduling import Scheduler
    from router.workers import Registry

    def Snap(wid: int, state: WorkerState) -> WorkerSnapshot:   # a real snapshot: every field the registry reads
        return WorkerSnapshot(worker_id=wid, state=state, pid=7, endpoint="/tmp/x.sock", model="m", gpu_ids=[],
                              weight=1.0, heartbeat_ns=0, heartbeat_age_ms=1.0, num_running=0, num_waiting=0,
                              inflight=0, router_inflight=0, dispatched=0, queued_prompt_tokens=0, max_num_seqs=0,
                              kv_cache_usage=0.0, gpu_mem_used_bytes=0, gpu_mem_total_bytes=0, ttft_ms=0.0,
                              tpot_ms=0.0, e2e_ms=0.0, ttft_p99_ms=0.0, tpot_p99_ms=0.0, e2e_p99_ms=0.0,
                              prompt_len_hist=[], completed=0, failed=0, circuit=0)

    resets: list[int] = []
    reg = Registry(seg=None, cfg=Config(), on_reset=resets.append)
    sched = Scheduler(reg, RoundRobinPolicy(), seg=None)   # eligibility lives in the scheduler
    s = Snap(0, WorkerState.READY)
    reg.sync([s])
    reg.handles[0].breaker.record(False)
    reg.sync([replace(s, state=WorkerState.DEAD, state_reason=StateReason.ENGINE_EXITED)])
    assert list(reg.handles) == [0] and resets == [0]                # listed, and reset once
    assert reg.handles[0].breaker.failure_rate == 0.0
    assert sched.routing_state(reg.handles[0]) == "dead"
    assert sched.candidates(None, set(), "kernel") == []             # never a candidate, even unchecked
    reg.sync([replace(s, state=WorkerState.STARTING, restarts=1)])
    reg.sync([replace(s, restarts=1)])
    assert sched.routing_state(reg.handles[0]) == "eligible"
    n = len(resets)
    reg.sync([replace(s, restarts=1)])
    assert len(resets) == n                                          # nothing changed: no reset
    reg.sync([replace(s, state=WorkerState.STARTING, restarts=2)])   # an admin restart, no DEAD between
    assert len(resets) == n + 1
    reg.sync([replace(s, state=WorkerState.EMPTY)])
    assert reg.handles == {}
