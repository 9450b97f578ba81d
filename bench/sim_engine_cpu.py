"""How much CPU does one simulated engine cost? How many concurrent streams does it sustain per core?

Starts one ``python -m sim_engine`` pinned to one core, drives it with N concurrent streaming
completions (short prompts, ``--max-tokens`` each) from this process (pinned to another core when
there is one), and prints per N:

* ``tok/s``       generated tokens per wall second (from the engine's own counter);
* ``cpu%``        the engine process's CPU time / wall time (100 = one core saturated);
* ``us/tok``      engine CPU microseconds per generated token (HTTP + SSE + scheduling);
* ``pace``        modelled step time / wall time of those steps; 1.0 means the engine kept the
  modelled speed, below 1 means CPU (its own or a neighbour's) set the pace;
* ``step_ms``     mean modelled step (simulated ms) at that batch size.

One core's ceiling is 1 / (CPU per token) at the busiest level; ``max_scale`` = ceiling / the
level's rate: how many such engines one core carries at time scale 1 (or the fastest
``--time-scale`` one engine could run that load at on one core). CPU time per token hardly depends
on other load on the machine; ``pace`` and ``tok/s`` do.

    .venv/bin/python -m bench.sim_engine_cpu [--levels 16,64,128,256] [--max-tokens 200]
                                             [--time-scale 1] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time

import aiohttp
import orjson
import psutil

from bench.procs import ProcessGroup, start_sim_engine


async def _state(s: aiohttp.ClientSession) -> dict:
    async with s.get("http://sim/sim/state") as r:
        return orjson.loads(await r.read())


async def _stream(s: aiohttp.ClientSession, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    for attempt in range(5):  # a burst of connects can overflow the socket's accept queue
        try:
            n = 0
            async with s.post("http://sim/v1/completions", json=body) as r:
                async for chunk in r.content.iter_any():
                    n += chunk.count(b"data: ")
            return n
        except aiohttp.ClientConnectorError:
            if attempt == 4:
                raise
            await asyncio.sleep(0.05 * (attempt + 1))
    return 0


async def _level(sock: str, proc: psutil.Process, n: int, max_tokens: int) -> dict:
    conn = aiohttp.UnixConnector(path=sock, limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        st0 = await _state(s)
        c0, t0 = proc.cpu_times(), time.monotonic()
        await asyncio.gather(
            *[_stream(s, f"user {i} says hello to the engine", max_tokens) for i in range(n)]
        )
        wall = time.monotonic() - t0
        c1 = proc.cpu_times()
        st1 = await _state(s)
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    toks = st1["generation_tokens"] - st0["generation_tokens"]
    steps = max(1, st1["steps"] - st0["steps"])
    busy = st1["busy_time_s"] - st0["busy_time_s"]
    active = st1["wall_active_s"] - st0["wall_active_s"]
    return {
        "streams": n,
        "tokens": toks,
        "wall_s": round(wall, 3),
        "tok_per_s": round(toks / wall, 1),
        "cpu_pct": round(100 * cpu / wall, 1),
        "us_per_tok": round(1e6 * cpu / max(1, toks), 1),
        "pace": round(busy / st1["time_scale"] / max(1e-9, active), 3),
        "step_ms": round(1e3 * busy / steps, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the sweep; print a table (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="16,64,128,256", help="comma-separated concurrent stream counts")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    eng_cpu = cpus[0]
    if len(cpus) > 1:
        os.sched_setaffinity(0, set(cpus[1:]))
    d = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
    sock = os.path.join(d, "engine.sock")
    try:
        with ProcessGroup() as group:
            child = start_sim_engine(group, sock, "--time-scale", str(a.time_scale), "--max-num-seqs", "1024",
                                     cpu=eng_cpu)
            proc = psutil.Process(child.popen.pid)
            asyncio.run(_level(sock, proc, 4, 5))  # warm-up
            rows = [asyncio.run(_level(sock, proc, int(n), a.max_tokens)) for n in a.levels.split(",")]
    finally:
        shutil.rmtree(d, ignore_errors=True)
    # the ceiling of one core: 1 / (CPU per token), from the busiest level (least fixed overhead)
    max_tok_s = 1e6 / rows[-1]["us_per_tok"]
    for r in rows:
        r["max_time_scale_per_core"] = round(max_tok_s / max(1.0, r["tok_per_s"]), 1)
    results = {
        "engine_cpu": eng_cpu,
        "time_scale": a.time_scale,
        "levels": rows,
        "max_tok_per_s_per_core": round(max_tok_s),
    }
    if a.json:
        print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"engine pinned to CPU {eng_cpu}; time scale {a.time_scale}, {a.max_tokens} tokens per stream")
    print(
        f"{'streams':>8} {'tok/s':>9} {'cpu%':>6} {'us/tok':>7} {'pace':>6} {'step_ms':>8} {'max_scale':>9}"
    )
    for r in rows:
        print(
            f"{r['streams']:>8} {r['tok_per_s']:>9} {r['cpu_pct']:>6} {r['us_per_tok']:>7} {r['pace']:>6} "
            f"{r['step_ms']:>8} {r['max_time_scale_per_core']:>9}"
        )
    print(
        f"one core streams about {round(max_tok_s)} tokens/s "
        f"(1 / CPU per token at {rows[-1]['streams']} streams)"
    )
    print(
        "max_scale: how many such engines one core carries at this time scale "
        "(or how much faster one could run)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
