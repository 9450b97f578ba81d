"""The load generator against a small in-process OpenAI-shaped server (loopback)."""
from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiohttp import web

from bench.loadgen import RequestSpec, chat_body, run_closed, run_open

CHAT = "/v1/chat/completions"


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    text = body["messages"][-1]["content"]
    n = int(body["max_tokens"])
    if text == "fail":
        return web.json_response({"error": {"message": "boom", "type": "server_error", "param": None,
                                            "code": None}}, status=500)
    if not body.get("stream"):
        await asyncio.sleep(0.01)
        return web.json_response({"choices": [{"message": {"content": "x " * n}}],
                                  "usage": {"completion_tokens": n}}, headers={"X-DPLB-Worker-ID": "3"})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-DPLB-Worker-ID": "3"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
    await asyncio.sleep(0.05)  # time to first token
    for _ in range(n):
        await resp.write(b'data: {"choices":[{"delta":{"content":"tok "}}]}\n\n')
        await asyncio.sleep(0.01)
    if body.get("stream_options", {}).get("include_usage"):
        await resp.write(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":%d}}\n\n' % n)
    if text != "nodone":
        await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def server():
    app = web.Application()
    app.router.add_post(CHAT, _chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def _spec(text: str, n: int, stream: bool, at: float = 0.0) -> RequestSpec:
    return RequestSpec(at, CHAT, chat_body("m", [{"role": "user", "content": text}], n, stream), stream, text)


async def test_stream_ttft_e2e_tokens_and_worker(server):
    (r,), wall = await run_open(server, [_spec("hello", 5, True)])
    assert r.ok and r.status == 200 and r.worker == "3"
    assert r.output_tokens == 5
    assert 0.04 <= r.ttft < r.e2e <= wall + 0.01  # first token after the 50 ms pause, before the end


async def test_non_stream_counts_usage(server):
    (r,), _ = await run_open(server, [_spec("hello", 7, False)])
    assert r.ok and r.output_tokens == 7 and r.ttft == r.e2e


async def test_errors_are_recorded_not_raised(server):
    results, _ = await run_open(server, [_spec("fail", 3, True), _spec("nodone", 2, True)])
    assert [r.ok for r in results] == [False, False]
    assert results[0].status == 500 and "HTTP 500" in results[0].error
    assert "DONE" in results[1].error


async def test_connection_refused_is_an_error():
    from bench.procs import free_port
    (r,), _ = await run_open(f"http://127.0.0.1:{free_port()}", [_spec("x", 1, False)])
    assert not r.ok and r.error


async def test_open_loop_respects_offsets(server):
    t0 = time.perf_counter()
    results, wall = await run_open(server, [_spec("a", 1, False, 0.0), _spec("b", 1, False, 0.3)])
    assert results[1].sent_at >= 0.29
    assert wall >= 0.3 and time.perf_counter() - t0 < 10


async def test_closed_loop_bounds_concurrency(server):
    specs = [_spec(f"q{i}", 1, False) for i in range(8)]
    results, _wall = await run_closed(server, specs, concurrency=2)
    assert len(results) == 8 and all(r.ok for r in results)
    # with 2 clients, never more than 2 requests overlap
    spans = sorted((r.sent_at, r.sent_at + r.e2e) for r in results)
    for i, (s, _) in enumerate(spans):
        overlapping = sum(1 for (s2, e2) in spans if s2 <= s < e2)
        assert overlapping <= 2, i


def test_chat_body_shape():
    b = orjson.loads(chat_body("m", [{"role": "user", "content": "x"}], 4, True))
    assert b["model"] == "m" and b["max_tokens"] == 4 and b["stream_options"] == {"include_usage": True}


async def test_sessions_wait_for_the_answer_then_think(server):
    # conversation 7: two turns; the second leaves 0.2 s after the first answer ended, never before
    specs = [
        RequestSpec(0.0, CHAT, chat_body("m", [{"role": "user", "content": "t1"}], 5, True), True, "a", session=7),
        RequestSpec(0.0, CHAT, chat_body("m", [{"role": "user", "content": "solo"}], 1, False), False, "b", session=9),
        RequestSpec(0.0, CHAT, chat_body("m", [{"role": "user", "content": "t2"}], 1, False), False, "c",
                    session=7, think=0.2),
    ]
    from bench.loadgen import run_sessions
    results, wall = await run_sessions(server, specs)
    assert [r.tag for r in results] == ["a", "b", "c"] and all(r.ok for r in results)
    first, _, second = results
    # the second turn was sent after the first turn's end plus the think time
    assert second.sent_at >= first.sent_at + first.e2e + 0.2
    assert wall >= second.sent_at + second.e2e - 1e-6
