"""The agent in front of a real simulated engine: in-flight counts, aborts, heartbeat, death, drain.

Each test starts one agent (which starts ``python -m sim_engine``) on a fresh segment; every
process is killed and the segment unlinked at teardown (fixtures in tests/conftest.py).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import orjson
import psutil
import pytest

from tests.worker_agent.conftest import aslot_wait, slot_wait

MODEL = "sim-llama-3.1-8b"
#: every simulated step 30x slower: a few tokens per second, so streams stay open while we look
SLOW = ["--slowdown", "30"]


def completion(max_tokens: int, stream: bool = True, prompt: str = "one two three four five six seven eight") -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True}


async def open_streams(client: httpx.AsyncClient, n: int, max_tokens: int, stack):
    """Open ``n`` streaming completions and read until each has produced its first chunk."""
    responses = []
    for _ in range(n):
        r = await stack.enter_async_context(client.stream("POST", "/v1/completions", json=completion(max_tokens)))
        assert r.status_code == 200
        responses.append(r)
    iters = [r.aiter_raw() for r in responses]
    for it in iters:
        stack.push_async_callback(it.aclose)   # keeps the iterator alive: a collected one closes its stream
        await asyncio.wait_for(it.__anext__(), 30)
    return responses, iters


async def test_five_open_streams_show_inflight_then_zero_after_end(start_agent, segment):
    a = start_agent(0, engine_args=SLOW, interval_ms=100)
    from contextlib import AsyncExitStack
    async with a.aclient() as client, AsyncExitStack() as stack:
        _, iters = await open_streams(client, 5, max_tokens=6, stack=stack)
        # the agent counts a request when it arrives, before relaying it: no state tick needed
        s = segment.read_slot(0)
        assert s.inflight == 5
        assert s.queued_prompt_tokens == 5 * 8
        assert sum(s.prompt_len_hist) == 5 and s.prompt_len_hist[3] == 5   # 8 words: bin [8, 16)
        for it in iters:
            async for _ in it:
                pass
    s = await aslot_wait(segment, 0, lambda s: s.inflight == 0, 10, "inflight back to 0")
    assert s.queued_prompt_tokens == 0 and sum(s.prompt_len_hist) == 0
    assert s.completed == 5 and s.failed == 0
    assert s.ttft_ms > 0 and s.e2e_ms >= s.ttft_ms and s.tpot_ms > 0
    # the engine's own view arrives with the next probe: nothing running any more
    await aslot_wait(segment, 0, lambda s: s.num_running == 0 and s.num_waiting == 0, 5, "engine idle")


async def test_cancelled_streams_return_inflight_to_zero_and_abort_in_engine(start_agent, segment):
    a = start_agent(1, engine_args=SLOW, interval_ms=100)
    client = a.aclient()
    from contextlib import AsyncExitStack
    stack = AsyncExitStack()
    await open_streams(client, 5, max_tokens=2000, stack=stack)
    assert segment.read_slot(1).inflight == 5
    await aslot_wait(segment, 1, lambda s: s.num_running == 5, 5, "engine reports 5 running")
    await stack.aclose()          # the router goes away mid-stream
    await client.aclose()
    s = await aslot_wait(segment, 1, lambda s: s.inflight == 0, 10, "inflight back to 0 after cancel")
    assert s.queued_prompt_tokens == 0
    assert s.completed == 0 and s.failed == 0          # aborted: neither
    # the disconnect reached the engine: it dropped the requests
    await aslot_wait(segment, 1, lambda s: s.num_running == 0, 10, "engine aborted the requests")
    with httpx.Client(transport=httpx.HTTPTransport(uds=os.path.join(a.run_dir, "engine-1.sock"))) as eng:
        st = eng.get("http://engine/sim/state").json()
    assert st["in_flight"] == [] and st["running"] == 0


def test_heartbeat_advances_and_engine_death_marks_slot_dead(start_agent, segment):
    a = start_agent(2, "--restart-max", "0", interval_ms=100)   # no restart: DEAD stays
    h1 = segment.read_slot(2).heartbeat_ns
    time.sleep(0.35)
    s = segment.read_slot(2)
    assert s.heartbeat_ns > h1 and s.heartbeat_age_ms < 1000
    assert s.pid == a.proc.pid and s.endpoint == a.uds and s.model == MODEL

    engine = psutil.Process(a.proc.pid).children()[0]
    assert "sim_engine" in " ".join(engine.cmdline())
    t0 = time.monotonic()
    os.kill(engine.pid, signal.SIGKILL)
    slot_wait(segment, 2, lambda s: s.state.name == "DEAD", 5, "slot DEAD")
    dead_after = time.monotonic() - t0
    assert dead_after < 0.1 + 0.5, f"DEAD after {dead_after:.3f}s (interval 0.1s, 0.5s slack for load)"
    # the agent stays up, keeps its heartbeat, and refuses requests OpenAI-style
    assert a.proc.poll() is None
    h = segment.read_slot(2).heartbeat_ns
    with a.client() as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "dead"
        r = c.post("/v1/completions", json=completion(4, stream=False))
        assert r.status_code == 503
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == 503
        assert r.headers["retry-after"]
    time.sleep(0.3)
    assert segment.read_slot(2).heartbeat_ns > h
    assert "exited unexpectedly with code -9" in a.log_text()


def test_sigterm_drains_in_flight_then_empties_slot(start_agent, segment):
    a = start_agent(3, "--drain-timeout", "60", engine_args=SLOW, interval_ms=100)
    with a.client() as c, c.stream("POST", "/v1/completions", json=completion(8)) as r:
        it = r.iter_raw()
        first = next(it)
        assert first.startswith(b"data: ")
        a.proc.send_signal(signal.SIGTERM)
        slot_wait(segment, 3, lambda s: s.state.name == "DRAINING", 5, "DRAINING")
        with a.client() as c2:
            r2 = c2.post("/v1/completions", json=completion(2, stream=False))
            assert r2.status_code == 503 and r2.json()["error"]["type"] == "service_unavailable"
            assert c2.get("/health").status_code == 503
        rest = b"".join(it)             # the in-flight stream runs to its end
    assert rest.rstrip().endswith(b"data: [DONE]")
    events = [e for e in (first + rest).split(b"\n\n") if e.strip()]
    assert len(events) == 8 + 1
    assert a.proc.wait(30) == 0
    s = segment.read_slot(3)
    assert s.state.name == "EMPTY"
    assert not os.path.exists(a.uds)


def test_relay_passes_paths_errors_and_non_streaming_bodies(start_agent, segment):
    a = start_agent(4, interval_ms=100)
    with a.client() as c:
        r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
        r = c.post("/v1/completions", json=completion(3, stream=False))
        assert r.status_code == 200
        body = r.json()
        assert body["usage"]["completion_tokens"] == 3
        # the engine's own validation error comes back untouched (not a 500 from the agent)
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500
        r = c.get("/dplb/state")
        assert r.status_code == 200
        st = r.json()
        assert st["worker_id"] == 4 and st["state"] == "ready" and st["completed"] >= 1
        assert orjson.loads(r.content) == st


@pytest.mark.parametrize("limit", [2])
async def test_max_queue_refuses_with_429(start_agent, segment, limit):
    a = start_agent(5, "--max-queue", str(limit), engine_args=SLOW, interval_ms=100)
    from contextlib import AsyncExitStack
    async with a.aclient() as client, AsyncExitStack() as stack:
        await open_streams(client, limit, max_tokens=500, stack=stack)
        r = await client.post("/v1/completions", json=completion(2, stream=False))
        assert r.status_code == 429 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
    await aslot_wait(segment, 5, lambda s: s.inflight == 0, 10, "inflight 0")


def test_engine_death_mid_stream_ends_with_error_event_and_counts_failed(start_agent, segment):
    a = start_agent(6, "--restart-max", "0", engine_args=SLOW, interval_ms=100)
    engine = psutil.Process(a.proc.pid).children()[0]
    with a.client() as c, c.stream("POST", "/v1/completions", json=completion(2000)) as r:
        it = r.iter_raw()
        first = next(it)
        assert first.startswith(b"data: ")
        os.kill(engine.pid, signal.SIGKILL)
        rest = b"".join(it)
    last = [e for e in rest.split(b"\n\n") if e.strip()][-1]
    assert last.startswith(b"data: ")
    err = orjson.loads(last[6:])["error"]
    assert err["code"] == 502 and "engine" in err["message"]
    s = slot_wait(segment, 6, lambda s: s.state.name == "DEAD" and s.inflight == 0, 5, "DEAD, nothing in flight")
    assert s.failed == 1 and s.completed == 0


def test_engine_that_fails_to_start_marks_slot_dead(start_agent, segment):
    a = start_agent(7, "--restart-max", "0", engine_args=["--no-such-flag"], wait_ready=False, interval_ms=100)
    s = slot_wait(segment, 7, lambda s: s.state.name == "DEAD" and s.state_reason.name == "GAVE_UP", 30,
                  "slot DEAD (gave up) after a failed start")
    assert s.last_exit_code == 2 and s.restarts == 0
    assert s.pid == a.proc.pid and a.proc.poll() is None
    assert oct(os.stat(a.uds).st_mode & 0o777) == oct(0o660)    # agent socket: owner and group only
    with a.client() as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "dead"
    assert "exited unexpectedly with code 2" in a.log_text()
    a.proc.send_signal(signal.SIGTERM)
    assert a.proc.wait(30) == 0
    assert segment.read_slot(7).state.name == "EMPTY"


def test_chat_stream_is_measured_and_tokenize_is_not_counted(start_agent, segment):
    a = start_agent(8, engine_args=SLOW, interval_ms=100)
    chat = {"model": MODEL, "stream": True, "max_tokens": 6, "ignore_eos": True,
            "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"}]}
    with a.client() as c:
        with c.stream("POST", "/v1/chat/completions", json=chat) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            it = r.iter_raw()
            first = next(it)
            s = segment.read_slot(8)
            assert s.inflight == 1 and s.queued_prompt_tokens == 5        # 2 + 3 words of content
            body = first + b"".join(it)
        events = [e for e in body.split(b"\n\n") if e.strip()]
        assert events[-1] == b"data: [DONE]"
        s = slot_wait(segment, 8, lambda s: s.completed == 1 and s.inflight == 0, 5, "chat counted")
        assert 0 < s.ttft_ms <= s.e2e_ms and s.tpot_ms > 0
        r = c.post("/tokenize", json={"model": MODEL, "prompt": "a b c"})
        assert r.status_code == 200
    s = segment.read_slot(8)
    assert s.completed == 1 and s.inflight == 0        # /tokenize is relayed but is not inference
