"""Regression tests for the bugs the fault suite found (one test per bug, named after it)."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from bench.faultsuite.cluster import MODEL_SIM, Stack
from bench.faultsuite.load import chat, send, sse_events
from router.config import BackendServer
from tests.helpers import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(120)]


def test_engine_death_mid_stream_ends_with_sse_error_event_not_silent_truncation():
    """worker_agent/relay.py ended the body cleanly when the engine died mid-stream: the client got
    a truncated stream with neither ``[DONE]`` nor an error. Since issue 14 the router reads the
    engine directly (one hop): the same death must end the router's stream with an error event."""
    with Stack() as st:
        a = st.agents_up(1)[0]
        pid = a.engine_pid()
        base = st.router({}, ready=1)

        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                return await send(c, chat(stream=True, max_tokens=3000, model=MODEL_SIM),
                                  on_first=lambda o: os.kill(pid, signal.SIGKILL))

        o = asyncio.run(go())
        assert o.status == 200 and o.kind == "honest", o.detail
        ev = sse_events(o.body)
        assert b"[DONE]" not in ev and b'"error"' in ev[-1]


def test_removed_worker_in_flight_stream_finishes_instead_of_hanging():
    """router/transport.py closed a departed worker's connection pool at once, under its live
    streams, which then hung until the read timeout."""
    with Stack() as st:
        f0 = st.fake(0)
        base = st.router({}, ready=1)
        hs = {"x-fake-mode": "stream", "x-fake-chunks": "8", "x-fake-delay": "0.1"}

        async def go():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                def remove(_):
                    box["code"] = httpx.delete(base + "/dplb/workers/0", timeout=10).status_code
                box: dict = {}
                o = await send(c, chat(stream=True), headers=hs, timeout=10,
                               on_first=lambda o: asyncio.get_running_loop().run_in_executor(None, remove, o))
                return o, box

        o, box = asyncio.run(go())
        assert o.kind == "ok", o.detail
        assert box.get("code") == 200 and st.row(base, 0) is None
        # the fake engine counts after its last write, which the client may read first
        wait_until(lambda: f0.client().stats()["completed"] == 1, 10, what="the fake engine's completed count")


def test_connect_refused_takes_a_worker_out_at_once_not_after_probes():
    """A worker whose socket refuses connections stayed eligible until probes or heartbeat caught
    up; every request meanwhile paid a failed attempt first."""
    cfg = {"health_check": {"enabled": False, "heartbeat_timeout_ms": 60000},
           "routing_policy": {"policy": "round_robin"}}
    with Stack() as st:
        f0 = st.fake(0)
        st.fake(1)
        base = st.router(cfg, ready=2)
        st.kill(f0.proc)
        f0.proc.wait(5)
        codes = [httpx.post(base + "/v1/chat/completions", json=chat(tag=i), timeout=10) for i in range(6)]
        assert [r.status_code for r in codes] == [200] * 6
        assert {r.headers["x-dplb-worker-id"] for r in codes} == {"1"}
        assert st.row(base, 0)["eligible"] is False
        assert st.seg.read_slot(0).dispatched == 1      # tried once, then left out


def test_text_plain_body_is_refused_with_415_and_not_forwarded():
    """The router forwarded bodies of any Content-Type; vLLM answers 415 for non-JSON ones."""
    with Stack() as st:
        f0 = st.fake(0)
        base = st.router({}, ready=1)
        body = b'{"messages": [{"role": "user", "content": "x"}]}'
        r = httpx.post(base + "/v1/chat/completions", content=body, headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
        assert "Content-Type" in r.json()["error"]["message"]
        ok = httpx.post(base + "/v1/chat/completions", content=body,
                        headers={"content-type": "application/json; charset=utf-8"})
        assert ok.status_code == 200
        assert f0.client().stats()["requests"] == 1


@pytest.mark.parametrize("endpoint", ["ftp://127.0.0.1:21", "gopher://127.0.0.1:70", "dict://127.0.0.1:11211",
                                      "http://user:pw@127.0.0.1:8080", "-bad-:80"])
def test_admin_endpoint_with_foreign_scheme_is_refused(endpoint):
    """BackendServer accepted ``scheme://host:port`` for any scheme and ``user@host``."""
    with pytest.raises(ValueError):
        BackendServer(endpoint=endpoint)


@pytest.mark.parametrize("endpoint", ["127.0.0.1:8001", "http://10.0.0.7:8001", "[::1]:8000", "/run/dplb/agent-0.sock",
                                      "node-3.example.com:8001"])
def test_admin_endpoint_forms_still_accepted(endpoint):
    assert BackendServer(endpoint=endpoint).endpoint


def test_new_router_zeroes_router_inflight_left_by_a_killed_router():
    """router_inflight atomics leaked by a router killed with requests in flight made those
    workers look busy to every later router."""
    with Stack() as st:
        st.fake(0)
        st.seg.router_inflight_add(0, 5)        # what a killed router leaves behind
        base = st.router({}, ready=1)
        assert st.seg.read_slot(0).router_inflight == 0
        # a second process of the same deployment (same state dir) must not zero live counts
        st.seg.router_inflight_add(0, 2)
        st.router({}, ready=1)
        assert st.seg.read_slot(0).router_inflight == 2
        st.seg.router_inflight_add(0, -2)
        assert httpx.get(base + "/health").status_code == 200
