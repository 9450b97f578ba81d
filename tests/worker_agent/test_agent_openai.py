"""The ``openai`` adapter attached to a small OpenAI-compatible server (tests/worker_agent/fake_engine.py):
the slot names the server's own address (routers forward there, one hop); state from its /metrics
when it has one, from the routers' in-flight count when not."""
from __future__ import annotations

import asyncio
import sys
from contextlib import AsyncExitStack

import pytest

from tests.helpers import free_port, wait_for_port
from tests.worker_agent.conftest import aendpoint_client, aslot_wait


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


async def test_without_metrics_slot_uses_the_routers_in_flight_count(procs, start_agent, segment):
    url = fake_engine(procs, "--token-delay-ms", "50")
    a = start_agent(0, "--engine-url", url, engine="openai", interval_ms=100)
    s = segment.read_slot(0)
    assert s.model == "fake-model" and s.kv_cache_usage == -1.0
    assert s.endpoint == url.removeprefix("http://") and s.control == a.uds
    segment.router_inflight_add(0, 3)          # three requests dispatched by routers, not finished
    s = await aslot_wait(segment, 0, lambda s: s.num_running == 3, 2, "running from the routers' count")
    assert s.inflight == 3 and s.num_waiting == 0 and s.kv_cache_usage == -1.0
    segment.router_inflight_add(0, -3)
    await aslot_wait(segment, 0, lambda s: s.inflight == 0 and s.num_running == 0, 5, "idle")
    assert "has no /metrics" in a.log_text()


async def test_with_metrics_slot_shows_engine_figures(procs, start_agent, segment):
    url = fake_engine(procs, "--metrics", "--token-delay-ms", "50")
    start_agent(1, "--engine-url", url, engine="openai", interval_ms=100)
    async with aendpoint_client(segment.read_slot(1).endpoint) as client, AsyncExitStack() as stack:
        await open_streams(client, 2, max_tokens=400, stack=stack)
        s = await aslot_wait(segment, 1, lambda s: s.num_running == 2, 2, "engine running count")
        assert s.kv_cache_usage == pytest.approx(0.25)
        assert s.inflight == 0          # no router sent these two: both are outside requests
        segment.router_inflight_add(1, 2)   # as if routers had sent them: published with the next scrape
        s = await aslot_wait(segment, 1, lambda s: s.inflight == 2, 2, "the routers' count at the scrape")
        assert s.num_running == 2
        segment.router_inflight_add(1, -2)
    await aslot_wait(segment, 1, lambda s: s.num_running == 0 and s.kv_cache_usage == 0.0, 5, "engine idle")


def test_https_engine_is_refused_on_the_command_line():
    """Routers forward plain HTTP/1.1 straight to the engine: an https:// engine cannot be attached."""
    from worker_agent.config import parse_args
    from worker_agent.errors import ConfigError

    with pytest.raises(ConfigError) as ei:
        parse_args(["--worker-id", "0", "--uds", "/tmp/a.sock", "--engine", "openai", "--engine-url",
                    "https://example.com"])
    assert ei.value.field == "--engine-url"
