"""Soak run (issue 8, scenario 12): a long stretch of simulated traffic with router and agent memory sampled.

Usage::

    python -m bench.soak [--sim-minutes 30] [--time-scale 5] [--workers 2] [--max-growth-mb 48]
                         [--out bench/results/soak.md]

It starts a segment, ``--workers`` worker agents with sim engines running ``--time-scale`` times
faster than real time, and a router with the default config (``dplb`` policy, prefix affinity,
bounded prefix index), then replays the Mooncake conversation trace
(``dplb_trace/data/mooncake/conversation_trace.jsonl``) from its start for ``--sim-minutes``
simulated minutes: request *i* is sent at ``timestamp_i / time_scale`` wall seconds, with its real
prompt length (deterministic text per 512-token block, so prefix sharing survives; see
:mod:`dplb_trace.mooncake`) and ``max_tokens = output_length``; every ``--stream-every``-th request
streams. At most ``--max-inflight`` requests are outstanding (later ones wait and are counted
as *late*).

Every ``--sample-s`` wall seconds the resident set size (RSS, psutil) of the router, of every
agent and of every engine is recorded. Growth = (largest RSS over the last 10 % of the run) −
(largest RSS over the 10 % before the end of the warm-up, ``--warmup-frac`` of the run). The run
passes when the router's and every agent's growth stay within ``--max-growth-mb`` and no request
was lost (a hang, reset or truncated stream; see :mod:`bench.faultsuite.load`). The report goes to
``--out``; exit status 1 on failure.

The bound: after warm-up the only state that grows with traffic is the router's prefix index
(LRU, ``routing_policy.prefix_index_max_entries`` entries of ~250 B: 200k entries ≈ 50 MB at most,
see ``router/policies/prefix_index.py``) and the agents' fixed-size latency windows; the default
48 MiB allows the index to finish filling after warm-up, and nothing else.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1024 * 1024


class Sampler:
    """Samples RSS (bytes) of named processes every ``interval`` s in a thread.

    ``procs``: name → pid. ``samples``: list of (t_wall_s, {name: rss_bytes}); a process that is
    gone is left out of its sample."""

    def __init__(self, procs: dict[str, int], interval: float) -> None:
        import psutil

        self.procs = {n: psutil.Process(pid) for n, pid in procs.items()}
        self.interval = interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            row = {}
            for n, p in self.procs.items():
                try:
                    row[n] = p.memory_info().rss
                except psutil.Error:
                    continue
            self.samples.append((time.monotonic() - self.t0, row))
            self._stop.wait(self.interval)

    def start(self) -> None:
        """Begin sampling (one sample at once)."""
        self._t.start()

    def stop(self) -> None:
        """Take no more samples."""
        self._stop.set()
        self._t.join(5)

    def growth(self, name: str, warmup_end: float, end: float) -> tuple[float, float, float]:
        """(baseline MiB, final MiB, growth MiB) of ``name`` (see the module docstring)."""
        span = 0.1 * end
        base = [r[name] for t, r in self.samples if warmup_end - span <= t <= warmup_end and name in r]
        fin = [r[name] for t, r in self.samples if t >= end - span and name in r]
        if not base or not fin:
            return float("nan"), float("nan"), float("nan")
        b, f = max(base) / MB, max(fin) / MB
        return b, f, f - b


async def replay(base: str, reqs: list[Any], time_scale: float, stream_every: int, max_inflight: int,
                 model: str) -> tuple[list[Any], int]:
    """Send ``reqs`` at their trace times / ``time_scale``; returns (outcomes, late count)."""
    import httpx

    from bench.faultsuite.load import send
    from dplb_trace.mooncake import prompt_for

    sem = asyncio.Semaphore(max_inflight)
    late = 0
    limits = httpx.Limits(max_connections=max_inflight + 16, max_keepalive_connections=max_inflight)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=600) as c:
        t0 = time.monotonic()
        tasks = []

        async def one(i: int, r: Any) -> Any:
            try:
                body = {"model": model, "messages": [{"role": "user", "content": prompt_for(r)}],
                        "max_tokens": max(1, r.output_length), "stream": stream_every > 0 and i % stream_every == 0}
                return await send(c, body, timeout=600)
            finally:
                sem.release()

        for i, r in enumerate(reqs):
            await asyncio.sleep(max(0.0, t0 + r.timestamp_ms / 1000.0 / time_scale - time.monotonic()))
            if sem.locked():
                late += 1
            await sem.acquire()
            tasks.append(asyncio.ensure_future(one(i, r)))
        return list(await asyncio.gather(*tasks)), late


def build_parser() -> argparse.ArgumentParser:
    """The soak's command line (module docstring)."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--sim-minutes", type=float, default=30.0, help="simulated minutes of trace (30 or more for a full soak)")
    # 5: the Mooncake rate (3.4 req/s) x 5 = 17 req/s of ~12k-token prompts, about what router + 2 agents +
    # 2 sim engines sustain on a shared 2-core machine (at 10, a third of the requests wait client-side)
    p.add_argument("--time-scale", type=float, default=5.0, help="engines and arrivals run this much faster")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--stream-every", type=int, default=5, help="every n-th request streams (0: none)")
    p.add_argument("--max-inflight", type=int, default=128)
    p.add_argument("--sample-s", type=float, default=2.0)
    p.add_argument("--warmup-frac", type=float, default=0.25)
    p.add_argument("--max-growth-mb", type=float, default=48.0)
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace (default: the in-repository conversation trace)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak.md"))
    return p


@dataclass
class Soaked:
    """What one soak measured: the requests' outcomes (:mod:`bench.faultsuite.load`), how many
    were sent late, the wall seconds, the RSS samples of each process (``pids``: name → pid) and
    the router's workers at the end (``/dplb/status`` rows)."""

    outs: list[Any]
    late: int
    wall: float
    pids: dict[str, int]
    sampler: Sampler
    workers: list[dict[str, Any]]


def soak(args: argparse.Namespace, reqs: list[Any]) -> Soaked:
    """Start the stack (agents with sim engines, a router), replay ``reqs`` with RSS sampled, stop it."""
    from bench.faultsuite.cluster import MODEL_SIM, Stack

    with Stack() as st:
        agents = st.agents_up(args.workers, time_scale=args.time_scale, interval_ms=200)
        base = st.router({}, ready=args.workers)
        pids = {"router": st.routers[-1][0].pid}
        for a in agents:
            pids[f"agent-{a.worker_id}"] = a.proc.pid
            pids[f"engine-{a.worker_id}"] = a.engine_pid()
        sampler = Sampler(pids, args.sample_s)
        sampler.start()
        t0 = time.monotonic()
        try:
            outs, late = asyncio.run(replay(base, reqs, args.time_scale, args.stream_every, args.max_inflight,
                                            MODEL_SIM))
        finally:
            sampler.stop()
        wall = time.monotonic() - t0
        rows = st.status(base)
    return Soaked(outs, late, wall, pids, sampler, rows)


def write_report(args: argparse.Namespace, reqs: list[Any], run: Soaked, counts: dict[str, int],
                 lines: list[tuple[str, float, float, float, float, str]], failed: bool) -> None:
    """The Markdown report to ``args.out``: the run, the verdict, the growth table and RSS over time."""
    from bench.faultsuite.load import lost_details

    sampler, pids, wall = run.sampler, run.pids, run.wall
    lat = [o.t_end - o.t_start for o in run.outs if o.kind == "ok"]
    span = (reqs[-1].timestamp_ms / 60_000) if reqs else 0.0
    served = {w["id"]: w.get("state") for w in run.workers}
    md = [
        "# DPLB soak run (issue 8, scenario 12)",
        "",
        (f"Generated {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')} by `python -m bench.soak "
        f"--sim-minutes {args.sim_minutes:g} --time-scale {args.time_scale:g} --workers {args.workers}` on a "
        f"{os.cpu_count()}-CPU machine. Mooncake conversation trace from its start, default router config."),
        "",
        (f"- requests: {counts['sent']} sent, {counts['ok']} ok, {counts['honest']} failed honestly, "
        f"{counts['lost']} lost; {run.late} sent late (more than {args.max_inflight} outstanding)"),
        (f"- trace span {span:.1f} min of arrivals; wall time {wall:.0f} s = {wall * args.time_scale / 60:.1f} "
        f"minutes of simulated engine time; "
        f"latency of ok requests (wall s): median {statistics.median(lat) if lat else float('nan'):.2f}, "
        f"max {max(lat) if lat else float('nan'):.2f}"),
        (f"- RSS sampled every {args.sample_s:g} s ({len(sampler.samples)} samples); warm-up = first "
        f"{args.warmup_frac:.0%}; growth = max over the last 10 % − max over the 10 % before warm-up ended; "
        f"bound {args.max_growth_mb:g} MiB for the router and each agent (engines reported, not bounded)"),
        f"- workers at the end: {served}",
        f"- verdict: **{'PASS' if not failed else 'FAIL'}**",
        "",
        "| process | baseline MiB | final MiB | growth MiB | peak MiB | bounded |",
        "|---|---:|---:|---:|---:|---|",
    ]
    md += [f"| {n} | {b:.1f} | {f:.1f} | {g:+.1f} | {pk:.1f} | {v} |" for n, b, f, g, pk, v in lines]
    md += ["", "RSS over time (MiB):", "", "| t (s) | " + " | ".join(pids) + " |",
           "|---:|" + "---:|" * len(pids)]
    step = max(1, len(sampler.samples) // 20)
    for t, r in sampler.samples[::step]:
        md.append(f"| {t:.0f} | " + " | ".join(f"{r.get(n, 0) / MB:.1f}" for n in pids) + " |")
    if counts["lost"]:
        md += ["", "Lost requests (first 5):", ""] + [f"- {d}" for d in lost_details(run.outs)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run the soak, print a summary line per process, write the report; 1 on failure."""
    args = build_parser().parse_args(argv)
    from bench.faultsuite.load import tally
    from dplb_trace.mooncake import DEFAULT_TRACE, load_trace

    reqs = [r for r in load_trace(args.trace or DEFAULT_TRACE) if r.timestamp_ms <= args.sim_minutes * 60_000]
    print(f"soak: {len(reqs)} requests, {args.sim_minutes:g} simulated min at time scale {args.time_scale:g} "
          f"(~{args.sim_minutes * 60 / args.time_scale:.0f} s of arrivals), {args.workers} workers", flush=True)
    run = soak(args, reqs)
    sampler, wall = run.sampler, run.wall
    counts = tally(run.outs)
    end = sampler.samples[-1][0] if sampler.samples else wall
    warm = args.warmup_frac * end
    lines, failed = [], counts["lost"] > 0
    for name in run.pids:
        b, f, g = sampler.growth(name, warm, end)
        peak = max((r.get(name, 0) for _, r in sampler.samples), default=0) / MB
        bounded = name.startswith("engine") or g <= args.max_growth_mb
        failed = failed or not bounded
        lines.append((name, b, f, g, peak, "—" if name.startswith("engine") else ("ok" if bounded else "GREW")))
        print(f"soak {name:<9} baseline={b:.1f}MiB final={f:.1f}MiB growth={g:+.1f}MiB peak={peak:.1f}MiB", flush=True)
    span = (reqs[-1].timestamp_ms / 60_000) if reqs else 0.0
    print(f"soak requests sent={counts['sent']} ok={counts['ok']} honest={counts['honest']} lost={counts['lost']} "
          f"late={run.late} wall={wall:.0f}s trace={span:.1f}min engine-time={wall * args.time_scale / 60:.1f}min "
          f"{'PASS' if not failed else 'FAIL'}", flush=True)
    write_report(args, reqs, run, counts, lines, failed)
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
