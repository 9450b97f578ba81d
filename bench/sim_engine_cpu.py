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

Then a saturation run (high ``--time-scale``) measures the most tokens/s one core can emit;
``max_scale`` = that rate / the level's rate: how many such engines one core carries at time scale 1
(or the fastest ``--time-scale`` one engine can run that load at on one core).

    .venv/bin/python -m bench.sim_engine_cpu [--levels 16,64,128,256] [--max-tokens 200] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import aiohttp
import orjson
import psutil


def _start_engine(sock: str, time_scale: float, cpu: int | None) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "sim_engine",
        "--uds",
        sock,
        "--time-scale",
        str(time_scale),
        "--max-num-seqs",
        "1024",
    ]
    p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    if cpu is not None:
        os.sched_setaffinity(p.pid, {cpu})
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if time.monotonic() > deadline or p.poll() is not None:
            raise RuntimeError("engine did not start")
        time.sleep(0.05)
    return p


async def _state(s: aiohttp.ClientSession) -> dict:
    async with s.get("http://sim/sim/state") as r:
        return orjson.loads(await r.read())


async def _stream(s: aiohttp.ClientSession, prompt: str, max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    n = 0
    async with s.post("http://sim/v1/completions", json=body) as r:
        async for chunk in r.content.iter_any():
            n += chunk.count(b"data: ")
    return n


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
    """Run the sweep and the saturation run; print a table (or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="16,64,128,256", help="comma-separated concurrent stream counts")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--saturate-scale", type=float, default=50.0, help="time scale of the saturation run")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    eng_cpu = cpus[0]
    if len(cpus) > 1:
        os.sched_setaffinity(0, set(cpus[1:]))
    d = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
    results: dict = {"engine_cpu": eng_cpu, "levels": []}
    try:
        for ts, levels, key in (
            (1.0, [int(x) for x in a.levels.split(",")], "levels"),
            (a.saturate_scale, [64], "saturated"),
        ):
            sock = os.path.join(d, f"e{ts}.sock")
            p = _start_engine(sock, ts, eng_cpu)
            try:
                proc = psutil.Process(p.pid)
                asyncio.run(_level(sock, proc, 4, 5))  # warm-up
                rows = [asyncio.run(_level(sock, proc, n, a.max_tokens)) for n in levels]
            finally:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(10)
            if key == "levels":
                results["levels"] = rows
            else:
                results["saturated"] = dict(rows[0], time_scale=ts)
        sat = results["saturated"]
        max_tok_s = sat["tok_per_s"] * 100.0 / max(1.0, sat["cpu_pct"])  # per full core
        results["max_tok_per_s_per_core"] = round(max_tok_s)
        for r in results["levels"]:  # how much faster than real time one core could run this load
            r["max_time_scale_per_core"] = round(max_tok_s / max(1.0, r["tok_per_s"]), 1)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if a.json:
        print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"engine pinned to CPU {eng_cpu}; time scale 1 (real time), {a.max_tokens} tokens per stream")
    print(
        f"{'streams':>8} {'tok/s':>9} {'cpu%':>6} {'us/tok':>7} {'pace':>6} {'step_ms':>8} {'max_scale':>9}"
    )
    for r in results["levels"]:
        print(
            f"{r['streams']:>8} {r['tok_per_s']:>9} {r['cpu_pct']:>6} {r['us_per_tok']:>7} {r['pace']:>6} "
            f"{r['step_ms']:>8} {r['max_time_scale_per_core']:>9}"
        )
    s = results["saturated"]
    print(
        f"saturation (time scale {s['time_scale']}, 64 streams): {s['tok_per_s']} tok/s at "
        f"{s['cpu_pct']}% CPU, {s['us_per_tok']} us/token "
        f"-> about {results['max_tok_per_s_per_core']} tokens/s per core"
    )
    print(
        "max_scale: the --time-scale at which that load would saturate one core (engines per core at "
        "time scale 1)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
