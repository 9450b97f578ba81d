"""A minimal OpenAI-compatible server for the ``openai`` adapter tests (no /metrics by default).

``python -m tests.worker_agent.fake_engine --port P [--metrics] [--token-delay-ms 20]``

Serves ``GET /v1/models``, ``POST /v1/completions`` (streaming or not, one word per token, one
token every ``--token-delay-ms``), ``* /echo/...`` (echoes the request as JSON), ``GET /fake/state`` (``{"active": n, "aborted": n,
"completed": n}``) and, with ``--metrics``, a ``/metrics`` page in vLLM's names whose running
count is the number of active requests. Loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

STATE = {"active": 0, "aborted": 0, "completed": 0}


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})


async def fake_state(_: web.Request) -> web.Response:
    return web.json_response(STATE)


async def metrics(_: web.Request) -> web.Response:
    text = ("# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{engine="0",model_name="fake-model"}} {STATE["active"]}.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{engine="0",model_name="fake-model"} 0.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="fake-model"}} {0.125 * STATE["active"]}\n')
    return web.Response(text=text, content_type="text/plain")


async def echo(request: web.Request) -> web.Response:
    """Echo method, path, query, headers and body (base64-free: body as latin-1 text)."""
    body = await request.read()
    raw_query = request.raw_path.partition("?")[2]
    return web.json_response({"method": request.method, "path": request.path, "query": raw_query,
                              "headers": [[k, v] for k, v in request.headers.items()],
                              "body": body.decode("latin-1")},
                             headers={"X-Engine-Header": "kept", "Cache-Control": "no-store"})


def make_completions(delay_s: float):
    async def completions(request: web.Request) -> web.StreamResponse:
        req = orjson.loads(await request.read())
        n = int(req.get("max_tokens", 4))
        created = int(time.time())
        STATE["active"] += 1
        try:
            if not req.get("stream"):
                await asyncio.sleep(delay_s * n)
                STATE["completed"] += 1
                return web.json_response({"id": "cmpl-1", "object": "text_completion", "created": created,
                                          "model": "fake-model",
                                          "choices": [{"index": 0, "text": " tok" * n, "finish_reason": "length"}],
                                          "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                await asyncio.sleep(delay_s)
                chunk = {"id": "cmpl-1", "object": "text_completion", "created": created, "model": "fake-model",
                         "choices": [{"index": 0, "text": f" tok{i}", "finish_reason": None}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            STATE["completed"] += 1
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            STATE["aborted"] += 1
            raise
        finally:
            STATE["active"] -= 1
    return completions


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--token-delay-ms", type=float, default=20.0)
    a = p.parse_args()
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/fake/state", fake_state)
    app.router.add_route("*", "/echo/{tail:.*}", echo)
    app.router.add_post("/v1/completions", make_completions(a.token_delay_ms / 1000.0))
    if a.metrics:
        app.router.add_get("/metrics", metrics)
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, handle_signals=True,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
