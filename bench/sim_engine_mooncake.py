"""Replay the head of the Mooncake conversation trace through ONE simulated engine.

Shows that the engine behaves like a loaded vLLM: shared prompt blocks hit the prefix cache, and
time to first token grows with the queue the request finds on arrival. Each trace request is sent
at ``timestamp / time_scale`` wall seconds as a streamed completion with ``max_tokens =
output_length``; its prompt is :func:`dplb_trace.mooncake.prompt_for` (512 fixed words per block id).

Printed: prefix-cache hit rate (``vllm:prefix_cache_hits_total / queries_total``), preemptions,
TTFT percentiles (simulated seconds = wall x time scale), mean TTFT per band of queue depth at
arrival (requests in flight at the engine), and the Spearman rank correlation of depth and TTFT.

    .venv/bin/python -m bench.sim_engine_mooncake [--requests 200] [--time-scale 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import tempfile
import time

import aiohttp
import orjson

from bench.procs import ProcessGroup, start_sim_engine
from dplb_trace.mooncake import DEFAULT_TRACE, load_trace, prompt_for


def _ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=xs.__getitem__)
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (ties get average ranks); 0.0 when either side is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx and vy else 0.0


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _replay(sock: str, reqs, scale: float) -> tuple[list[dict], dict]:
    conn = aiohttp.UnixConnector(path=sock, limit=0)
    inflight = 0
    rows: list[dict] = []
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        prompts = [prompt_for(r) for r in reqs]
        t0 = time.monotonic()

        async def one(i: int) -> None:
            nonlocal inflight
            r = reqs[i]
            await asyncio.sleep(max(0.0, r.timestamp_ms / 1000 / scale - (time.monotonic() - t0)))
            depth = inflight
            inflight += 1
            sent = time.monotonic()
            ttft = None
            body = {"prompt": prompts[i], "max_tokens": max(1, r.output_length), "stream": True}
            try:
                async with s.post("http://sim/v1/completions", json=body) as resp:
                    if resp.status != 200:
                        raise RuntimeError(f"request {i}: HTTP {resp.status}: {(await resp.read())[:200]!r}")
                    async for chunk in resp.content.iter_any():
                        if ttft is None and b'"text"' in chunk:
                            ttft = time.monotonic() - sent
            finally:
                inflight -= 1
            rows.append(
                {
                    "i": i,
                    "depth": depth,
                    "ttft_s": (ttft or 0.0) * scale,
                    "e2e_s": (time.monotonic() - sent) * scale,
                    "input": r.input_length,
                    "output": r.output_length,
                }
            )

        await asyncio.gather(*[one(i) for i in range(len(reqs))])
        async with s.get("http://sim/metrics") as m:
            text = (await m.read()).decode()
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            vals[name.split("{")[0]] = vals.get(name.split("{")[0], 0.0) + float(v)
    return rows, vals


def main(argv: list[str] | None = None) -> int:
    """Run the replay and print the summary (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--time-scale", type=float, default=10.0)
    ap.add_argument("--engine-args", default="", help="extra flags for the engine, e.g. '--slowdown 3'")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    reqs = load_trace(a.trace, limit=a.requests)
    d = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
    sock = os.path.join(d, "engine.sock")
    try:
        with ProcessGroup() as group:
            start_sim_engine(group, sock, "--time-scale", str(a.time_scale), *a.engine_args.split())
            wall0 = time.monotonic()
            rows, m = asyncio.run(_replay(sock, reqs, a.time_scale))
            wall = time.monotonic() - wall0
    finally:
        shutil.rmtree(d, ignore_errors=True)
    rows.sort(key=lambda r: r["i"])
    ttft = [r["ttft_s"] for r in rows]
    depth = [float(r["depth"]) for r in rows]
    qs = m.get("vllm:prefix_cache_queries_total", 0.0)
    bands = []
    edges = sorted({0, 1, 2, 4, 8, 16, 32, 64, 128, int(max(depth)) + 1})
    for lo, hi in itertools.pairwise(edges):
        sel = [r["ttft_s"] for r in rows if lo <= r["depth"] < hi]
        if sel:
            bands.append(
                {"depth": f"{lo}-{hi - 1}", "n": len(sel), "mean_ttft_s": round(sum(sel) / len(sel), 3)}
            )
    out = {
        "requests": len(rows),
        "time_scale": a.time_scale,
        "wall_s": round(wall, 1),
        "prefix_hit_rate": round(m.get("vllm:prefix_cache_hits_total", 0.0) / qs, 4) if qs else 0.0,
        "preemptions": m.get("vllm:num_preemptions_total", 0.0),
        "ttft_p50_s": round(_pct(ttft, 0.5), 3),
        "ttft_p90_s": round(_pct(ttft, 0.9), 3),
        "ttft_p99_s": round(_pct(ttft, 0.99), 3),
        "max_depth": int(max(depth)),
        "spearman_depth_ttft": round(spearman(depth, ttft), 3),
        "ttft_by_depth": bands,
    }
    if a.json:
        print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(
        f"{out['requests']} Mooncake requests through one engine, time scale {a.time_scale} "
        f"({out['wall_s']} s wall)"
    )
    print(f"prefix cache hit rate {out['prefix_hit_rate']:.1%}, preemptions {out['preemptions']:.0f}")
    print(f"TTFT (simulated s) p50 {out['ttft_p50_s']} p90 {out['ttft_p90_s']} p99 {out['ttft_p99_s']}")
    print(f"{'depth at arrival':>17} {'n':>4} {'mean TTFT s':>12}")
    for b in bands:
        print(f"{b['depth']:>17} {b['n']:>4} {b['mean_ttft_s']:>12}")
    print(f"Spearman(depth, TTFT) = {out['spearman_depth_ttft']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
