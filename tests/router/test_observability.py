"""What an operator sees on the router's /metrics (issue 16): TTFT to the first chunk that carries
content, tokens per worker, phases, per-worker series read from the segment at scrape time, and
a page that ``promtool check metrics`` accepts."""
from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest

from bench.fakes import MODEL
from tests.helpers import metric, promtool

CHAT = "/v1/chat/completions"


def scrape(base: str) -> str:
    r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def stream_chat(base: str, headers: dict[str, str], usage: bool = True) -> float:
    """Stream one chat answer; return the client's time to the first content."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a b c d"}], "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", base + CHAT, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if first is None and '"content":"t' in line:
                first = time.perf_counter() - t0
    assert first is not None
    return first


def test_ttft_is_the_first_content_not_the_role_chunk(make_cluster):
    c = make_cluster(1)
    base = c.base
    before = scrape(base)
    n0 = metric(before, "dplb_router_time_to_first_token_seconds_count", route=CHAT) or 0.0
    s0 = metric(before, "dplb_router_time_to_first_token_seconds_sum", route=CHAT) or 0.0
    # the role-only event comes with the head, the first token 0.5 s later (a long prefill)
    client = stream_chat(base, {"x-fake-role-first": "1", "x-fake-first-delay": "0.5", "x-fake-chunks": "3"})
    after = scrape(base)
    assert metric(after, "dplb_router_time_to_first_token_seconds_count", route=CHAT) == n0 + 1
    router = metric(after, "dplb_router_time_to_first_token_seconds_sum", route=CHAT) - s0
    # before issue 16 the router recorded the role chunk: a few ms
    assert 0.45 <= router <= client + 0.05, (router, client)
    # tokens (the fake's usage: 1 prompt token, 3 completion tokens) and phases
    assert metric(after, "dplb_router_generation_tokens_total", worker="0", model=MODEL) == 3
    assert metric(after, "dplb_router_prompt_tokens_total", worker="0", model=MODEL) == 1
    qp = metric(after, "dplb_router_request_phase_seconds_sum", phase="queue_prefill", model=MODEL)
    assert qp is not None and 0.45 <= qp <= router + 0.01
    assert metric(after, "dplb_router_request_phase_seconds_count", phase="decode", model=MODEL) == 1
    assert metric(after, "dplb_router_request_phase_seconds_count", phase="routing", model=MODEL) == 1
    # the router's TTFT average for the worker (segment, dispatch to first content)
    assert 0.45 <= metric(after, "dplb_worker_recent_ttft_seconds", worker="0", model=MODEL) <= router + 0.01
    # a stream without usage: one token per content event; a non-streamed answer: its usage
    stream_chat(base, {"x-fake-chunks": "4"}, usage=False)
    httpx.post(base + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    final = scrape(base)
    assert metric(final, "dplb_router_generation_tokens_total", worker="0", model=MODEL) == 3 + 4 + 5


def test_worker_series_are_read_at_scrape_time(make_cluster):
    # health ticks every 10 s: whatever /metrics shows within that time was read when scraped
    c = make_cluster(2, {"health_check": {"interval_ms": 10000}})
    base = c.base
    text = scrape(base)
    for w in ("0", "1"):
        assert metric(text, "dplb_worker_ready", worker=w, model=MODEL) == 1
        assert metric(text, "dplb_worker_state", worker=w, model=MODEL, state="ready") == 1
        assert metric(text, "dplb_worker_requests_in_flight", worker=w) == 0
        assert metric(text, "dplb_worker_circuit_state", worker=w) == 0
        assert metric(text, "dplb_worker_engine_restarts_total", worker=w) == 0
        assert metric(text, "dplb_worker_heartbeat_age_seconds", worker=w) < 5
    info = metric(text, "dplb_build_info", policy="dplb")
    assert info == 1
    done = threading.Event()

    def slow() -> None:
        try:
            stream_chat(base, {"x-fake-first-delay": "3", "x-fake-chunks": "1"})
        finally:
            done.set()

    t = threading.Thread(target=slow, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 2.5
        seen = None
        while time.monotonic() < deadline and seen is None:
            text = scrape(base)
            busy = [w for w in ("0", "1") if metric(text, "dplb_worker_requests_in_flight", worker=w) == 1]
            if busy:
                seen = busy[0]
            else:
                time.sleep(0.05)
        assert seen is not None, "the in-flight request never showed on /metrics"
        assert metric(text, "dplb_worker_prefill_outstanding_tokens", worker=seen) > 0
        assert metric(text, "dplb_worker_decode_requests", worker=seen) == 0
    finally:
        t.join(30)
    assert done.is_set()
    text = scrape(base)
    assert metric(text, "dplb_worker_requests_in_flight") == 0
    assert metric(text, "dplb_worker_prefill_outstanding_tokens") == 0


def test_a_worker_that_leaves_loses_its_series(make_cluster):
    c = make_cluster(2)
    assert metric(scrape(c.base), "dplb_worker_ready", worker="1") == 1
    c.procs.stop(c.fakes[1].proc)  # the fake releases its slot on SIGTERM
    from tests.helpers import wait_until

    wait_until(lambda: metric(scrape(c.base), "dplb_worker_info", worker="1") is None, 15, what="worker 1 gone")
    text = scrape(c.base)
    assert not [ln for ln in text.splitlines() if ln.startswith("dplb_worker_") and 'worker="1"' in ln]
    assert metric(text, "dplb_worker_ready", worker="0") == 1


@pytest.mark.skipif(promtool() is None, reason="promtool not installed (Debian package prometheus; .ci/run installs it)")
def test_promtool_check_metrics_accepts_the_page(make_cluster):
    c = make_cluster(1)
    stream_chat(c.base, {"x-fake-chunks": "2"})
    httpx.post(c.base + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    text = scrape(c.base)
    cp = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60,
                        check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    # promtool's linter prints nothing when every family follows the naming conventions
    assert cp.stdout.strip() == "" and cp.stderr.strip() == "", cp.stdout + cp.stderr


def test_models_by_id_and_engine_metrics_through_the_router(make_cluster):
    c = make_cluster(2, fake_args=[["--model", "alpha"], ["--model", "org/beta"]])
    base = c.base
    assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["alpha", "org/beta"]
    m = httpx.get(base + "/v1/models/org/beta")
    assert m.status_code == 200 and m.json()["id"] == "org/beta" and m.json()["object"] == "model"
    miss = httpx.get(base + "/v1/models/gamma")
    assert miss.status_code == 404 and "alpha, org/beta" in miss.json()["error"]["message"]
    # each model's requests go to its worker; a request naming no model is refused (which one?)
    for model, wid in (("alpha", "0"), ("org/beta", "1")):
        r = httpx.post(base + CHAT, json={"model": model, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200 and r.headers["x-dplb-worker-id"] == wid
    r = httpx.post(base + CHAT, json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    # the engines' own pages, through the router
    page = httpx.get(base + "/dplb/workers/1/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    assert 'fake_requests_total{model_name="org/beta"} 1' in page.text
    assert httpx.get(base + "/dplb/workers/9/metrics").status_code == 404
    # Prometheus HTTP service discovery: one target per worker, on this router's address
    sd = httpx.get(base + "/dplb/prometheus/targets").json()
    host = base.removeprefix("http://")
    assert sd == [{"targets": [host], "labels": {"__metrics_path__": "/dplb/workers/0/metrics", "worker": "0",
                                                 "model": "alpha"}},
                  {"targets": [host], "labels": {"__metrics_path__": "/dplb/workers/1/metrics", "worker": "1",
                                                 "model": "org/beta"}}]


def test_router_families_carry_the_answering_workers_model(make_cluster):
    """The dashboard's model selector filtered nothing on the router-level panels (requests, errors,
    TTFT, duration): they had no ``model`` label (issue 32). The label is the worker's model, never
    the client's string (a 404 for an unknown model counts under ``model=""``: bounded)."""
    c = make_cluster(1)
    stream_chat(c.base, {"x-fake-chunks": "2"})
    with httpx.stream("POST", c.base + CHAT, headers={"x-fake-mode": "break"}, timeout=10,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
        r.read()   # two chunks, then the engine's connection breaks: an SSE error event, 502
    assert httpx.post(c.base + CHAT, json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
                      timeout=10).status_code == 404
    page = scrape(c.base)
    assert metric(page, "dplb_router_requests_total", worker="0", status="200", model=MODEL) == 1
    assert metric(page, "dplb_router_requests_total", worker="0", status="502", model=MODEL) == 1
    assert metric(page, "dplb_router_requests_total", worker="none", status="404", model="") == 1
    assert metric(page, "dplb_router_request_errors_total", worker="0", kind="stream_broken", model=MODEL) == 1
    assert metric(page, "dplb_router_time_to_first_token_seconds_count", route=CHAT, model=MODEL) == 2   # the broken stream had content
    assert metric(page, "dplb_router_request_duration_seconds_count", route=CHAT, model=MODEL) == 2
    assert "no-such-model" not in page


def test_status_counts_are_read_live_not_one_health_tick_old(make_cluster):
    """``/dplb/status`` showed each worker's ``completed`` as of the last health tick while the
    dump and ``/metrics`` read the slot live (issue 32): with a 30 s tick a request just answered
    was missing from the status for up to 30 s."""
    c = make_cluster(1, {"health_check": {"interval_ms": 30000}})
    before = httpx.get(c.base + "/dplb/status", timeout=10).json()["workers"][0]["completed"]
    for _ in range(3):
        assert httpx.post(c.base + CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                          timeout=10).status_code == 200
    row = httpx.get(c.base + "/dplb/status", timeout=10).json()["workers"][0]
    assert row["completed"] == before + 3 == c.seg.read_slot(0).completed
    assert metric(scrape(c.base), "dplb_worker_requests_completed_total", worker="0") == row["completed"]
