"""The response side observed (epp.observe) through a real Envoy: the first ext_proc filter
processes the request only, a second one in Envoy's ``observability_mode`` carries the response to
the picker, which takes the lease over by the token the pick set. The accounting is the
synchronous side's: in-flight back to zero, the status counted, the TTFT and the token counts
learned, a client that leaves counted 499. The stack is the module's (tests/epp/conftest.py)."""
from __future__ import annotations

import time

import httpx
import openai
import orjson
import pytest

from launcher.stack import wait_for
from tests.helpers import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


def scrape(gateway) -> str:
    return httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).text


def count(text: str, name: str, **labels: str) -> float:
    return metric(text, name, **labels) or 0.0


def test_chat_and_stream_are_accounted_through_the_observer(gateway):
    c = openai.OpenAI(base_url=gateway.observed + "/v1", api_key="none", timeout=30, max_retries=0)
    before = scrape(gateway)
    seen = []
    for _ in range(3):
        raw = c.chat.completions.with_raw_response.create(**CHAT)
        assert raw.parse().choices[0].message.content.startswith("hello from fake worker")
        seen.append(raw.headers["x-dplb-worker-id"])   # from the pick's dynamic metadata (the route)
    assert len(set(seen)) == 3, seen                    # round_robin over the three engines
    with c.chat.completions.with_streaming_response.create(
            **CHAT, stream=True, extra_headers={"x-fake-mode": "stream", "x-fake-delay": "0.05",
                                                "x-fake-chunks": "5"}) as resp:
        w = resp.headers["x-dplb-worker-id"]
        text = [ch.choices[0].delta.content for ch in resp.parse() if ch.choices and ch.choices[0].delta.content]
    assert text == [f"t{i} " for i in range(5)]
    wait_for(gateway.idle, 15, "router lines back to zero")
    after = scrape(gateway)
    # every answer counted 200 on the worker the picker chose (the observer's end of each lease)
    for wid in {*seen, w}:
        n = seen.count(wid) + (wid == w)
        assert count(after, "dplb_router_requests_total", worker=wid, status="200") - \
            count(before, "dplb_router_requests_total", worker=wid, status="200") == n, (wid, n)
    # the stream's first content was seen (TTFT) and its tokens counted
    ttft = "dplb_router_time_to_first_token_seconds_count"
    assert count(after, ttft) - count(before, ttft) >= 1
    gen = "dplb_router_generation_tokens_total"
    assert count(after, gen, worker=w) - count(before, gen, worker=w) >= 5
    # nothing was left waiting for an observer (each stream took its lease over)
    assert "dplb_router_request_errors_total" not in after or \
        count(after, "dplb_router_request_errors_total", kind="client_disconnect") == \
        count(before, "dplb_router_request_errors_total", kind="client_disconnect")


def test_client_leaving_mid_stream_is_seen_by_the_observer(gateway):
    before = scrape(gateway)
    with httpx.Client(timeout=30) as h, h.stream(
            "POST", gateway.observed + "/v1/chat/completions",
            headers={"x-fake-mode": "stream", "x-fake-delay": "0.5", "x-fake-chunks": "40"},
            content=orjson.dumps({**CHAT, "stream": True})) as r:
        chunks = r.iter_raw()
        next(chunks)
        assert r.status_code == 200
        wid = r.headers["x-dplb-worker-id"]
        assert gateway.seg.router_line(int(wid))["router_inflight"] == 1
    t = time.monotonic()
    # Envoy closes the observer's stream OBSERVE_CLOSE_S after the client left; the probe finds the engine alive
    wait_for(lambda: gateway.seg.router_line(int(wid))["router_inflight"] == 0, 15, "lease released")
    assert time.monotonic() - t < 12
    wait_for(gateway.idle, 10, "router lines back to zero")
    after = scrape(gateway)
    assert count(after, "dplb_router_requests_total", worker=wid, status="499") - \
        count(before, "dplb_router_requests_total", worker=wid, status="499") == 1


def test_the_pickers_own_errors_are_unchanged(gateway):
    r = httpx.post(gateway.observed + "/v1/chat/completions", json={**CHAT, "model": "no-such-model"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error" or r.json()["error"]["message"]
    assert r.headers["x-dplb-worker-id"] == "none"
    wait_for(gateway.idle, 10, "router lines back to zero")


def test_an_engine_abort_is_counted_but_the_answer_goes_unchanged(gateway):
    """What the observed side cannot do: change an answer Envoy does not hold. A stream its engine
    aborted is counted 502 ``engine_abort`` (the observer read it as an event stream: its
    content type reached the picker) and reaches the client without an error event; a non-streamed
    aborted answer is counted 502 while the client gets the engine's 200."""
    before = scrape(gateway)
    s = httpx.post(gateway.observed + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30,
                   headers={"x-fake-mode": "abort", "x-fake-chunks": "3"})
    assert s.status_code == 200 and b'"finish_reason":"abort"' in s.content and b'"error"' not in s.content
    r = httpx.post(gateway.observed + "/v1/chat/completions", json=CHAT, timeout=30, headers={"x-fake-mode": "abort"})
    assert r.status_code == 200
    wait_for(gateway.idle, 10, "router lines back to zero")
    after = scrape(gateway)
    for w in {s.headers["x-dplb-worker-id"], r.headers["x-dplb-worker-id"]}:
        n = (s.headers["x-dplb-worker-id"] == w) + (r.headers["x-dplb-worker-id"] == w)
        for name, labels in (("dplb_router_requests_total", {"status": "502"}),
                             ("dplb_router_request_errors_total", {"kind": "engine_abort"})):
            assert count(after, name, worker=w, **labels) - count(before, name, worker=w, **labels) == n, (name, w)
