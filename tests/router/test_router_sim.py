"""The router in front of real worker agents driving simulated engines (slow: real processes)."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import sim_agents_and_router, wait_until

pytestmark = pytest.mark.slow
SIM_MODEL = "sim-llama-3.1-8b"


@pytest.fixture(scope="module")
def sim2():
    """Segment + 2 agents (sim engines 20× faster than real time) + a dplb router; yields
    (base url, segment)."""
    with sim_agents_and_router(2, ["--time-scale", "20"]) as (base, seg):
        yield base, seg


def test_openai_client_through_router_to_sim_engines(sim2):
    base, _ = sim2
    c = openai.OpenAI(base_url=base + "/v1", api_key="sk-x", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == [SIM_MODEL]
    raw = c.chat.completions.with_raw_response.create(
        model=SIM_MODEL, messages=[{"role": "user", "content": "tell me a story"}], max_tokens=8)
    assert raw.headers["x-dplb-worker-id"] in {"0", "1"}
    chat = raw.parse()
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    with c.chat.completions.with_streaming_response.create(
            model=SIM_MODEL, messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True) as r:
        assert r.headers["x-dplb-worker-id"] in {"0", "1"}
        pieces = [ch.choices[0].delta.content for ch in r.parse() if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) >= 3
    comp = c.completions.create(model=SIM_MODEL, prompt="one two three", max_tokens=4)
    assert comp.choices[0].text
    st = httpx.get(base + "/dplb/status").json()
    assert [(w["id"], w["state"], w["eligible"]) for w in st["workers"]] == [(0, "ready", True), (1, "ready", True)]
    text = httpx.get(base + "/metrics").text
    assert f'dplb_router_requests_total{{model="{SIM_MODEL}",status="200",worker="' in text


def test_prefix_affinity_and_route_agreement_with_sim(sim2):
    base, _ = sim2
    system = "You are a meticulous assistant who answers in full sentences. " * 30
    body = {"model": SIM_MODEL, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "first"}]}
    first = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert first.status_code == 200
    home = first.headers["x-dplb-worker-id"]
    body["messages"][1]["content"] = "second question"
    d = httpx.post(base + "/dplb/route", json=body, timeout=30).json()
    assert str(d["worker_id"]) == home and d["reason"] == "prefix"
    uncached = {s["worker_id"]: s["uncached_tokens"] for s in d["scores"]}
    assert uncached[int(home)] < 10 < uncached[1 - int(home)]   # the cached system prompt is priced there
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.headers["x-dplb-worker-id"] == home


def test_stream_counts_in_flight_until_its_end_with_real_agent(sim2):
    base, seg = sim2
    seen = []
    body = {"model": SIM_MODEL, "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": "count slowly"}]}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
        wid = int(r.headers["x-dplb-worker-id"])
        for _ in r.iter_raw():
            s = seg.read_slot(wid)
            seen.append((s.router_inflight, s.inflight))
    assert seen and seen[0][0] == 1
    wait_until(lambda: seg.read_slot(wid).router_inflight == 0 and seg.read_slot(wid).inflight == 0, 10,
               what="in-flight released after the stream")
