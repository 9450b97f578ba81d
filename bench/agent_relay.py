"""Relay overhead of the agent: latency added per request and requests/s, against an instant engine.

``python -m bench.agent_relay [--requests 2000] [--concurrency 1,16] [--stream-tokens 16]``

Starts an "instant engine" (a minimal aiohttp server on a Unix socket that answers a completion
immediately, or streams ``--stream-tokens`` SSE events back to back), a scratch segment and one
agent attached to it (``--engine openai --engine-url unix:<socket>``), then times the same
requests sent directly to the engine and through the agent. Prints p50/p99 latency and requests/s
for each; the difference is the agent's hop (HTTP parse, slot updates, re-send), plus the agent's own
CPU time per request (user + system, from psutil), which does not depend on how loaded the machine
is. Latencies do; nothing here asserts.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import orjson

from launcher.stack import agent_argv

MODEL = "instant"


def serve_instant_engine(uds: str, tokens: int) -> None:
    """Run the instant engine on ``uds`` until SIGTERM."""
    from aiohttp import web

    body = orjson.dumps({"id": "x", "object": "text_completion", "model": MODEL,
                         "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})
    event = b"data: " + orjson.dumps({"id": "x", "object": "text_completion", "model": MODEL,
                                      "choices": [{"index": 0, "text": " tok", "finish_reason": None}]}) + b"\n\n"

    async def completions(request: web.Request) -> web.StreamResponse:
        req = orjson.loads(await request.read())
        if not req.get("stream"):
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(tokens):
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    web.run_app(app, path=uds, print=None)


async def _run(uds: str, n: int, conc: int, stream: bool) -> tuple[list[float], float]:
    lat: list[float] = []
    body = {"model": MODEL, "prompt": "one two three four", "max_tokens": 16, "stream": stream}
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=uds, limits=limits),
                                 base_url="http://x", timeout=60) as c:
        for _ in range(20):  # warm the pools
            await c.post("/v1/completions", json=body)
        left = n

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                t = time.perf_counter()
                r = await c.post("/v1/completions", json=body)
                r.raise_for_status()
                lat.append((time.perf_counter() - t) * 1e3)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return lat, n / wall


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table; returns 0."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.agent_relay", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--stream-tokens", type=int, default=16)
    p.add_argument("--serve-instant-engine", metavar="UDS", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_instant_engine:
        serve_instant_engine(a.serve_instant_engine, a.stream_tokens)
        return 0

    from dplb_shm import Segment

    d = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
    eng_uds, agent_uds = os.path.join(d, "engine.sock"), os.path.join(d, "agent.sock")
    name = f"dplb-bench-{os.getpid()}"
    seg = Segment.create(name, num_slots=1, replace=True)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.agent_relay", "--serve-instant-engine", eng_uds,
                                       "--stream-tokens", str(a.stream_tokens)]))
        procs.append(subprocess.Popen(agent_argv(0, name, agent_uds, engine="openai", engine_url=f"unix:{eng_uds}",
                                                 log_level="warning")))
        deadline = time.monotonic() + 30
        while seg.read_slot(0).state.name != "READY":
            if time.monotonic() > deadline or any(pr.poll() is not None for pr in procs):
                print("agent did not become ready", file=sys.stderr)
                return 1
            time.sleep(0.05)
        import psutil

        agent_proc = psutil.Process(procs[1].pid)
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (latency is inflated by CPU "
              "contention; agent CPU per request is not)")
        print(f"{'path':<8} {'mode':<7} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'agent CPU us/req':>17}")
        for stream in (False, True):
            for conc in [int(x) for x in a.concurrency.split(",")]:
                for label, uds in (("direct", eng_uds), ("agent", agent_uds)):
                    c0 = agent_proc.cpu_times()
                    lat, rps = asyncio.run(_run(uds, a.requests, conc, stream))
                    c1 = agent_proc.cpu_times()
                    cpu = ((c1.user + c1.system) - (c0.user + c0.system)) / (a.requests + 20) * 1e6
                    cpu_s = f"{cpu:>17.0f}" if label == "agent" else f"{'-':>17}"
                    print(f"{label:<8} {'stream' if stream else 'json':<7} {conc:>4} {statistics.median(lat):>8.3f} "
                          f"{_pct(lat, 0.99):>8.3f} {rps:>8.0f} {cpu_s}", flush=True)
        s = seg.read_slot(0)
        print(f"slot after run: completed={s.completed} failed={s.failed} inflight={s.inflight}")
    finally:
        for pr in reversed(procs):
            pr.send_signal(signal.SIGTERM)
        for pr in procs:
            try:
                pr.wait(15)
            except subprocess.TimeoutExpired:
                pr.kill()
        seg.close()
        seg.unlink()
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
