"""``python -m bench.overload``: a burst above capacity, DPLB with its admission queue beside smg.

The same burst goes to each system in turn, in paired repeats (system order alternated from one
repeat to the next: A B, B A, A B, ...), each system in front of fresh sim engines with the same
flags:

- the workload: a window of the conversation trace (``--start``, ``--requests``), each arrival
  moved later by a seeded uniform draw in ``[0, --spread-ms)`` (the trace stamps in 3 s steps;
  ``dplb-simulate --arrival-spread-ms`` does the same), sent at ``--rate-scale`` × the trace's rate (open loop, streamed, output
  capped at ``--max-tokens-cap`` so that the 2-core machine streams what it can);
- two priority classes: a seeded ``--high-share`` of the requests is class 1 (high), the rest
  class 0, sent as DPLB's ``x-dplb-priority: 1|0`` and smg's ``x-smg-priority: interactive|bulk``
  (smg's classes are named: system, interactive, default, bulk; DPLB reads an integer from either
  header and skips a name);
- engines: ``--engines`` ``dplb-sim-engine`` processes at ``--time-scale T`` (a simulated second
  lasts 1/T wall second); the client's wall times are multiplied by T into simulated seconds.

The SLO is the simulator's (``dplb-simulate``): TTFT ≤ 1 s + 0.1 s per 1k prompt tokens and TPOT
≤ 0.1 s, in simulated seconds; a request that failed (a 429 or anything else) misses it. Reported
per system and repeat: goodput (SLO-met requests per simulated second of the burst, the span from
the first send to the last answer), attainment of each class, 429s and other errors, TTFT p50/p99.

DPLB runs with its shipped defaults (admission on) and the ``dplb`` policy; smg
with ``cache_aware`` and its priority scheduler on (``--smg-flags``: a concurrency limit of
``--smg-concurrency`` per engine, a queue with a ``--smg-queue-timeout-s`` wait, tenants allowed
the interactive class): without a limit smg forwards every request at once and has nothing to
order. Its limit is a number an operator tunes; ``--smg-concurrency`` takes several values
(comma-separated) to run smg at each.

    python -m bench.overload --engines 4 --requests 300 --rate-scale 3 --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engines import EngineFlags, start_engines, wait_idle
from bench.loadgen import RequestSpec, Result, chat_body, run_open
from bench.procs import ProcessSet
from bench.systems import MODEL, SystemSpec, start_system, stop_system
from dplb_trace.mooncake import DEFAULT_TRACE, TraceRequest, load_trace, prompt_for
from dplb_trace.stats import percentile

#: the simulator's per-request SLO (simulate/stats.py): TTFT base + per 1k prompt tokens, TPOT
TTFT_BASE_S, TTFT_PER_1K_S, TPOT_S = 1.0, 0.1, 0.1
#: smg's admission flags ({c}: its concurrency limit, {q}: queue timeout, seconds): the priority
#: scheduler orders what waits by x-smg-priority, every tenant may ask for the interactive class
SMG_FLAGS = ("--max-concurrent-requests {c} --queue-size 10000 --queue-timeout-secs {q} "
             "--priority-scheduler-enabled --priority-scheduler-default-max-class interactive")
SMG_CLASS = {"1": "interactive", "0": "bulk"}


def specs_for(reqs: Sequence[TraceRequest], rate_scale: float, time_scale: float, high_share: float,
              seed: int, spread_ms: float, max_tokens_cap: int) -> list[RequestSpec]:
    """One :class:`RequestSpec` per trace request: sent at (its trace time from the window's first
    + a seeded uniform draw in ``[0, spread_ms)``) / (rate × T) wall seconds, its output capped at
    ``max_tokens_cap``, class 1 for a seeded ``high_share`` of them (tag ``"1:<prompt tokens>"``),
    else class 0."""
    rng = random.Random(f"overload:{seed}")
    t0 = reqs[0].timestamp_ms
    out = []
    for r in reqs:
        cls = "1" if rng.random() < high_share else "0"
        at_ms = r.timestamp_ms - t0 + rng.random() * spread_ms
        body = chat_body(MODEL, [{"role": "user", "content": prompt_for(r)}], min(r.output_length, max_tokens_cap), True)
        out.append(RequestSpec(at=at_ms / 1000.0 / (rate_scale * time_scale), path="/v1/chat/completions",
                               body=body, stream=True, tag=f"{cls}:{r.input_length}",
                               headers=(("x-dplb-priority", cls), ("x-smg-priority", SMG_CLASS[cls]))))
    return out


def met_slo(r: Result, time_scale: float) -> bool:
    """Did ``r`` meet the SLO (in simulated seconds: wall × ``time_scale``)?"""
    if not r.ok or r.ttft is None or r.e2e is None:
        return False
    prompt = int(r.tag.split(":")[1])
    if r.ttft * time_scale > TTFT_BASE_S + TTFT_PER_1K_S * prompt / 1000.0:
        return False
    return r.output_tokens <= 1 or (r.e2e - r.ttft) * time_scale / (r.output_tokens - 1) <= TPOT_S


def figures(results: Sequence[Result], wall_s: float, time_scale: float) -> dict[str, Any]:
    """Goodput (SLO-met requests per simulated second), attainment per class, 429s, errors, TTFT."""
    by_cls: dict[str, list[Result]] = {}
    for r in results:
        by_cls.setdefault(r.tag.split(":")[0], []).append(r)
    met = [met_slo(r, time_scale) for r in results]
    ttft = [r.ttft * time_scale for r in results if r.ok and r.ttft is not None]
    out: dict[str, Any] = {
        "requests": len(results), "met": sum(met), "goodput_rps": round(sum(met) / (wall_s * time_scale), 3),
        "attainment": round(sum(met) / len(results), 4),
        "shed_429": sum(1 for r in results if r.status == 429),
        "errors_other": sum(1 for r in results if not r.ok and r.status != 429),
        "ttft_p50_s": round(percentile(ttft, 50) or 0.0, 3), "ttft_p99_s": round(percentile(ttft, 99) or 0.0, 3),
        "burst_sim_s": round(wall_s * time_scale, 2)}
    for c, rs in sorted(by_cls.items()):
        out[f"attainment_class{c}"] = round(sum(met_slo(r, time_scale) for r in rs) / len(rs), 4)
        out[f"n_class{c}"] = len(rs)
    return out


def run_one(spec: SystemSpec, specs: list[RequestSpec], ns: argparse.Namespace, log_dir: Path, seed: int,
            smg_concurrency: int = 0) -> dict[str, Any]:
    """Fresh engines, ``spec`` in front of them, the burst; its :func:`figures`. smg gets
    ``smg_concurrency`` × engines as its concurrency limit."""
    with ProcessSet(log_dir) as procs:
        es = start_engines(procs, ns.engines, EngineFlags(time_scale=ns.time_scale, seed=seed))
        extra = shlex.split(ns.smg_flags.format(c=smg_concurrency * ns.engines, q=ns.smg_queue_timeout_s)) \
            if spec.kind == "smg" else []
        running = start_system(spec, procs, es, log_dir, peer_extra=extra)
        try:
            wait_idle(es.urls, 30)
            results, wall_s = asyncio.run(run_open(running.base_url, specs, timeout_s=600.0))
        finally:
            stop_system(running, procs)
    label = spec.label + (f"/c{smg_concurrency}" if spec.kind == "smg" else "")
    return {"system": label, "seed": seed, **figures(results, wall_s, ns.time_scale)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--start", type=int, default=2000)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--time-scale", type=float, default=1.0, help="the sim engines' --time-scale")
    p.add_argument("--rate-scale", type=float, default=3.0,
                   help="offered rate x the trace's (4 engines on the default window: capacity about x1.5 in "
                        "dplb-simulate, bench/results/admission.md)")
    p.add_argument("--spread-ms", type=float, default=3000.0)
    p.add_argument("--max-tokens-cap", type=int, default=64)
    p.add_argument("--high-share", type=float, default=0.3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--systems", default="dplb/dplb,smg/cache_aware", help="kind/policy, comma-separated")
    p.add_argument("--smg-flags", default=SMG_FLAGS, help="smg's admission flags ({c}: concurrency, {q}: timeout)")
    p.add_argument("--smg-concurrency", default="8", help="smg's concurrency limit per engine (comma-separated: each)")
    p.add_argument("--smg-queue-timeout-s", type=int, default=30)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    ns = p.parse_args(argv)
    systems = [SystemSpec(*s.split("/", 1)) for s in ns.systems.split(",")]
    conc = [int(c) for c in ns.smg_concurrency.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="dplb-overload-"))
    reqs = load_trace(ns.trace, limit=ns.requests, start=ns.start)
    rows = []
    for rep in range(ns.repeats):
        seed = 100 + rep
        specs = specs_for(reqs, ns.rate_scale, ns.time_scale, ns.high_share, seed, ns.spread_ms, ns.max_tokens_cap)
        runs = [(sp, c) for sp in systems for c in (conc if sp.kind == "smg" else [0])]
        for spec, c in (runs if rep % 2 == 0 else runs[::-1]):
            t0 = time.monotonic()
            row = {"repeat": rep, **run_one(spec, specs, ns, log_dir / f"{rep}-{spec.kind}{c}", seed, c)}
            row["wall_s"] = round(time.monotonic() - t0, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if ns.out:
        Path(ns.out).write_text(json.dumps(rows, indent=1))
    print(f"\n{'repeat':>6} {'system':<18} {'goodput':>8} {'attain':>7} {'high':>6} {'low':>6} {'429':>5} {'err':>4} "
          f"{'p50 s':>6} {'p99 s':>6}")
    for r in rows:
        print(f"{r['repeat']:>6} {r['system']:<18} {r['goodput_rps']:>8} {r['attainment']:>7} "
              f"{r.get('attainment_class1', '-'):>6} {r.get('attainment_class0', '-'):>6} {r['shed_429']:>5} "
              f"{r['errors_other']:>4} {r['ttft_p50_s']:>6} {r['ttft_p99_s']:>6}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
