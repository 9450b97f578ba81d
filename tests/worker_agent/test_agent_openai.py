"""The ``openai`` adapter attached to a small OpenAI-compatible server (tests/worker_agent/fake_engine.py):
state from /metrics when it has one, from the agent's own counters when not; relay fidelity; aborts."""
from __future__ import annotations

import asyncio
import sys
from contextlib import AsyncExitStack

import httpx
import pytest

from tests.helpers import free_port, wait_for_port
from tests.worker_agent.conftest import aslot_wait


def fake_engine(procs, *args: str) -> str:
    port = free_port()
    procs.start([sys.executable, "-m", "tests.worker_agent.fake_engine", "--port", str(port), *args])
    wait_for_port(port, timeout=30)
    return f"http://127.0.0.1:{port}"


async def open_streams(client, n, max_tokens, stack):
    its = []
    for _ in range(n):
        r = await stack.enter_async_context(client.stream(
            "POST", "/v1/completions", json={"model": "fake-model", "prompt": "a b", "max_tokens": max_tokens,
                                             "stream": True}))
        assert r.status_code == 200
        it = r.aiter_raw()
        stack.push_async_callback(it.aclose)   # keeps the iterator alive: a collected one closes its stream
        await asyncio.wait_for(it.__anext__(), 20)
        its.append(it)
    return its


async def test_without_metrics_slot_uses_agent_counters(procs, start_agent, segment):
    url = fake_engine(procs, "--token-delay-ms", "50")
    a = start_agent(0, "--engine-url", url, engine="openai", interval_ms=100)
    s = segment.read_slot(0)
    assert s.model == "fake-model" and s.kv_cache_usage == -1.0
    async with a.aclient() as client, AsyncExitStack() as stack:
        await open_streams(client, 3, max_tokens=400, stack=stack)
        s = await aslot_wait(segment, 0, lambda s: s.num_running == 3, 2, "running from the agent's own count")
        assert s.inflight == 3 and s.num_waiting == 0 and s.kv_cache_usage == -1.0
    await aslot_wait(segment, 0, lambda s: s.inflight == 0 and s.num_running == 0, 5, "idle")
    assert "has no /metrics" in a.log_text()


async def test_with_metrics_slot_shows_engine_figures(procs, start_agent, segment):
    url = fake_engine(procs, "--metrics", "--token-delay-ms", "50")
    a = start_agent(1, "--engine-url", url, engine="openai", interval_ms=100)
    async with a.aclient() as client, AsyncExitStack() as stack:
        await open_streams(client, 2, max_tokens=400, stack=stack)
        s = await aslot_wait(segment, 1, lambda s: s.num_running == 2, 2, "engine running count")
        assert s.kv_cache_usage == pytest.approx(0.25)
    await aslot_wait(segment, 1, lambda s: s.num_running == 0 and s.kv_cache_usage == 0.0, 5, "engine idle")


def test_relay_keeps_path_query_headers_body(procs, start_agent, segment):
    url = fake_engine(procs)
    a = start_agent(2, "--engine-url", url, engine="openai", interval_ms=100)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "weird": "\\u00e9"}'
    with a.client() as c:
        r = c.post("/echo/v1/chat/completions/render?x=1&y=%20z", content=body,
                   headers={"Authorization": "Bearer sk-test", "X-Request-Id": "req-42",
                            "Content-Type": "application/json", "Connection": "keep-alive", "TE": "trailers"})
    assert r.status_code == 200
    e = r.json()
    assert e["method"] == "POST" and e["path"] == "/echo/v1/chat/completions/render"
    assert e["query"] == "x=1&y=%20z"
    hdrs = {k.lower(): v for k, v in e["headers"]}
    assert hdrs["authorization"] == "Bearer sk-test" and hdrs["x-request-id"] == "req-42"
    assert "te" not in hdrs                       # hop-by-hop headers stop at the agent
    assert e["body"].encode("latin-1") == body    # byte for byte
    assert r.headers["x-engine-header"] == "kept" and r.headers["cache-control"] == "no-store"


async def test_disconnect_before_response_aborts_upstream(procs, start_agent, segment):
    url = fake_engine(procs, "--token-delay-ms", "100")
    a = start_agent(3, "--engine-url", url, engine="openai", interval_ms=100)
    async with a.aclient() as client:
        task = asyncio.create_task(client.post(
            "/v1/completions", json={"model": "fake-model", "prompt": "x", "max_tokens": 300, "stream": False}))
        await aslot_wait(segment, 3, lambda s: s.inflight == 1, 5, "request in flight")
        task.cancel()                              # the router gives up before any byte came back
        with pytest.raises(asyncio.CancelledError):
            await task
    await aslot_wait(segment, 3, lambda s: s.inflight == 0, 5, "inflight 0 after the disconnect")
    with httpx.Client(base_url=url) as eng:
        for _ in range(100):
            st = eng.get("/fake/state").json()
            if st["aborted"] == 1:
                break
            await asyncio.sleep(0.05)
    assert st == {"active": 0, "aborted": 1, "completed": 1}   # completed: the warm-up request
