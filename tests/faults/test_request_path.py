"""Issue 27, the router's request path: one test per failure (items 1, 2, 8 and 9), named after it;
scenario code in :mod:`bench.faultsuite.scen_request_path` (rows ``27.*`` of ``bench/results/faults.md``)."""
from __future__ import annotations

import pytest

from bench.faultsuite import scen_request_path as sc
from bench.faultsuite.load import lost_details

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_kill9_of_an_engine_under_streamed_and_non_streamed_load_fails_no_request_that_had_no_byte_yet():
    """Item 1 ("2 of about 1,390 requests got 502: the ones in flight on that engine"): each request
    in flight on the killed engine whose client had received nothing is sent once more elsewhere.
    What may still fail is a stream cut after its first events (its bytes are the client's), and
    it then ends with an SSE error event."""
    r = sc.run_engine_kill_retried()
    assert r.lost == 0, (lost_details(r.outcomes), r.extra.get("router_log_tail"))
    assert r.extra["inflight_at_kill"] >= 2
    assert r.extra["failed_non_streamed"] == [] and r.extra["failed_before_first_byte"] == []
    assert r.ok + r.extra["cut_mid_stream"] == r.sent and r.honest == r.extra["cut_mid_stream"]
    assert r.extra["query_of_death"] == 0.0


def test_requests_in_flight_on_a_killed_worker_before_their_first_byte_are_served_elsewhere_and_none_fails():
    """Item 1's "Shows": kill -9 under steady streamed (in prefill) and non-streamed load, with
    requests in flight on the killed worker: 0 failed, every one answered 200."""
    r = sc.run_in_flight_retried_streamed_and_not()
    assert r.extra["in_flight_on_0_at_kill"] >= 1
    assert r.ok == r.sent and r.honest == 0 and r.lost == 0, lost_details(r.outcomes)
    assert r.extra["retried"] >= 1
    assert r.extra["statuses"] == {"200": float(r.sent)}
    assert r.extra["streamed_ok"] >= 1 and r.extra["non_streamed_ok"] >= 1


def test_a_query_of_death_breaks_two_workers_at_most_then_is_answered_502_and_counted():
    """Item 1's bound: a request that crashes whatever engine reads it is tried on two workers, not
    on the whole fleet; its 502 names the last one and has its own metric."""
    r = sc.run_query_of_death()
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["qod_status"] == 502 and r.extra["qod_error"] == "upstream_error"
    assert sorted(r.extra["read_by_worker"]) == [0, 1, 1]
    assert r.extra["qod_worker_header"] in {"0", "1", "2"}
    assert r.extra["read_by_worker"][int(r.extra["qod_worker_header"])] == 1
    assert r.extra["query_of_death"] == 1.0
    assert r.extra["ordinary_ok"] == 20


def test_every_worker_down_before_the_router_noticed_is_503_with_retry_after_not_502():
    """Item 1: "all 3 worker(s) tried failed before the first byte: connect error" was a 502 in the
    0.1 s before the router notices that every worker is down."""
    r = sc.run_all_down_before_noticed()
    assert r.lost == 0, lost_details(r.outcomes)
    assert r.extra["statuses"] == {503: 6} and r.extra["retry_after"] == ["1"]
    assert r.extra["worker_header"] == ["none"]
    assert "tried failed before the first byte" in r.extra["first_message"]
    assert r.extra["after_back"] == (200, "1")


def test_a_model_whose_workers_are_all_down_is_503_with_retry_after_not_404_and_stays_listed():
    """Item 2: 'the model ... does not exist (served: none)' (404, which OpenAI clients never retry)
    for a model whose only worker was down."""
    r = sc.run_model_known_while_down()
    assert r.lost == 0, lost_details(r.outcomes)
    c = r.extra["checks"]
    for name in ("beta at once", "beta, worker out", "beta, worker removed"):
        assert c[name][:2] == (503, "1"), (name, c[name])
    # why, per worker: refused probes (unhealthy), or a heartbeat gone stale by the time of asking
    assert any(f"worker 1: {why}" in c["beta, worker out"][2] for why in ("unhealthy", "stale"))
    assert c["alpha meanwhile"][0] == 200 and c["beta, back"][0] == 200
    assert c["gamma (never served)"][0] == 404 and "served: alpha, beta" in c["gamma (never served)"][2]
    assert r.extra["models_listed"] == ["alpha", "beta"] == r.extra["models_after_remove"]
    assert r.extra["model_beta"] == 200 and r.extra["model_gamma"] == 404
    assert r.extra["status_models"] == {"alpha": {"workers": [0], "eligible": [0]},
                                        "beta": {"workers": [1], "eligible": []}}
    row = r.extra["row1"]
    assert row["model"] == "beta" and row["eligible"] is False and row["routing"] in ("unhealthy", "stale")


def test_complete_streams_read_with_the_sync_openai_client_are_counted_200_and_a_real_disconnect_499():
    """Item 8: 3.5-5 % of streams read to their end with the official sync ``openai`` client were
    counted ``client_disconnect`` and missing from the 200s; real disconnects were in no request count."""
    r = sc.run_sync_openai_streams_counted(200)
    assert r.ok == 200 and r.lost == 0, r.extra.get("client_error")
    assert r.extra["statuses"] == {"200": 200.0}
    assert r.extra["client_disconnect"] == 0.0
    assert r.extra["leaver_status"] == 200
    assert r.extra["statuses_after_leaver"] == {"200": 200.0, "499": 1.0}


def test_framing_errors_are_answered_in_the_openai_error_shape_and_nothing_is_forwarded():
    """Item 9: Content-Length with chunked, obs-fold, bare LF, HTTP/1.2 ... were refused with
    uvicorn's plain text ("Invalid HTTP request received.")."""
    r = sc.run_framing_errors()
    assert r.lost == 0 and r.honest == len(sc.FRAMING_ERRORS), r.extra["answers"]
    for name, a in r.extra["answers"].items():
        assert a["status"] == "HTTP/1.1 400 Bad Request" and a["json"] and a["shaped"], (name, a)
        assert a["closed"] and a["worker"] == "none", (name, a)
        assert a["message"].startswith("malformed HTTP/1.1 request: "), (name, a)
    assert "Content-Length" in r.extra["answers"]["Content-Length with chunked"]["message"]
    assert "version" in r.extra["answers"]["HTTP/1.2"]["message"]
    assert r.extra["forwarded"] == 0 and r.extra["forwarded_after_ok"] == 1
