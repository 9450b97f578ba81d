"""Fidelity against the live stack: the same trace window through ``dplb-simulate`` and through the
launched system (sim engines at a high ``--time-scale``, worker agents, the router, ``dplb-replay``).

    python -m simulate.fidelity --requests 100 --engines 4 --policy dplb --time-scale 10

Live side (the same processes ``bench/`` starts): ``N`` ``dplb-sim-engine`` processes at
``--time-scale T`` (a step of ``d`` simulated seconds sleeps ``d/T`` wall seconds), one worker agent
per engine on a fresh segment, one router with the policy; ``dplb-replay`` sends the window at
``--time-scale 1/T`` (so the engines see the trace's own rate in simulated time) with
``max_tokens`` capped at ``--max-tokens-cap``. Live TTFT = the client's wall TTFT × T (simulated
seconds); per-engine share from ``X-DPLB-Worker-ID``; prefix hit rate from the engines' own
``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` deltas.

Simulated side: ``dplb-simulate`` on the same window, engines, policy and cap. Both sides run the
router's default config, admission included: requests the admission queue answers 429 are counted
apart (``shed``) from other errors on both sides.

What differs by construction (so the comparison has tolerances): the live system adds real time
(HTTP, relays, the router's CPU) that the time scale multiplies by ``T``; the live engines group
steps into bursts of at least 1 ms wall; arrivals are sent by a real client with send lag; the
agents' publication phases and the policies' random draws differ.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from bench.engines import EngineFlags, counter_delta, scrape, start_engines, wait_idle
from bench.procs import ProcessSet
from bench.replay import ReplayOptions, replay
from bench.replay import summarize as replay_summary
from bench.systems import SystemSpec, start_system, stop_system
from dplb_trace.mooncake import DEFAULT_TRACE, TraceRequest
from router.config import Config
from sim_engine.config import EngineConfig
from simulate.cluster import Simulation
from simulate.settings import Figures, SimSettings
from simulate.stats import summarize
from simulate.workload import load_workload

#: the router config (a ``dplb.yaml`` as a dict) that turns the admission queue off
ADMISSION_OFF: dict[str, object] = {"admission": {"enabled": False}}


def spread_bursts(reqs: list[TraceRequest], gap_ms: float) -> list[TraceRequest]:
    """The window with requests that share a timestamp (the Mooncake trace stamps in 3 s steps)
    spread ``gap_ms`` apart, in trace order, so the live router receives them in the order the
    simulator does (a real client sends a burst concurrently and larger bodies arrive later)."""
    out: list[TraceRequest] = []
    last = None
    k = 0
    for r in reqs:
        k = k + 1 if last is not None and r.timestamp_ms == last else 0
        last = r.timestamp_ms
        out.append(replace(r, timestamp_ms=r.timestamp_ms + k * gap_ms))
    out.sort(key=lambda r: r.timestamp_ms)
    return [replace(r, index=i) for i, r in enumerate(out)]


def run_live(reqs: list, engines: int, policy: str, time_scale: float, log_dir: Path,
             rate_scale: float = 1.0, router_config: Mapping[str, object] | None = None) -> Figures:
    """The window through the launched system; figures in simulated seconds (see module docstring).
    ``shed``: requests the router's admission queue answered 429 (its default config, as the
    simulator's, unless ``router_config`` gives one: a ``dplb.yaml`` as a dict); ``errors``: every
    other failed request."""
    with ProcessSet(log_dir) as procs:
        es = start_engines(procs, engines, EngineFlags(time_scale=time_scale, seed=0))
        running = start_system(SystemSpec("dplb", policy), procs, es, log_dir, router_config=router_config)
        try:
            wait_idle(es.urls, 30)
            before = scrape(es.urls)
            opts = ReplayOptions(base_url=running.base_url + "/v1", time_scale=1.0 / (time_scale * rate_scale),
                                 timeout_s=300)
            results, wall_s, _ = asyncio.run(replay(reqs, opts))
            wait_idle(es.urls, 60)
            after = scrape(es.urls)
        finally:
            stop_system(running, procs)
    rep = replay_summary(results, wall_s)
    d = counter_delta(before, after)
    q = sum(x["vllm:prefix_cache_queries_total"] for x in d)
    h = sum(x["vllm:prefix_cache_hits_total"] for x in d)
    counts = [rep["workers"].get(str(k), {}).get("requests", 0) for k in range(engines)]
    ttft = [r.ttft_s * time_scale for r in results if r.ok and r.ttft_s is not None]
    per = [(r.worker_id, None if r.ttft_s is None else r.ttft_s * time_scale) for r in results]
    shed = sum(1 for r in results if not r.ok and (r.error or "").startswith("HTTP 429"))
    return {"errors": rep["errors"] - shed, "shed": shed, "counts": counts, "ttft_s": ttft,
            "prefix_hit_rate": h / q if q else None,
            "per_request": per,
            "send_lag_p99_s": rep["send_lag_ms"]["p99"] / 1000.0 * time_scale if rep["send_lag_ms"]["p99"] else 0.0}


def live_like(engines: int, policy: str, time_scale: float, seed: int = 0, rate_scale: float = 1.0,
              admission: bool = True) -> SimSettings:
    """Settings that mimic the live cluster at ``--time-scale T`` in simulated time: the agents'
    state interval (200 ms), latency window (10 s), the router's health interval (200 ms) and
    heartbeat timeout (1 s) are wall-clock periods, T times longer in simulated time, and the
    latencies the agents measure and publish are wall times, T times shorter. ``admission``
    False: the router config's ``admission.enabled: false`` (as :data:`ADMISSION_OFF` live)."""
    d = Config()
    cfg = Config.model_validate({"health_check": {
        "interval_ms": round(d.health_check.interval_ms * time_scale),
        "heartbeat_timeout_ms": round(d.health_check.heartbeat_timeout_ms * time_scale)},
        **({} if admission else ADMISSION_OFF)})
    return SimSettings(engines=[EngineConfig() for _ in range(engines)], policy=policy, seed=seed, router=cfg,
                       rate_scale=rate_scale,
                       state_interval_ms=round(200 * time_scale), latency_window_s=10.0 * time_scale,
                       agent_latency_scale=1.0 / time_scale)


def run_sim(reqs: list, engines: int, policy: str, seed: int = 0, time_scale: float = 1.0,
            rate_scale: float = 1.0, admission: bool = True) -> Figures:
    """The window through ``dplb-simulate`` with :func:`live_like` settings (``admission`` False:
    the queue off); the same figures as :func:`run_live`."""
    res = Simulation(reqs, live_like(engines, policy, time_scale, seed, rate_scale, admission)).run()
    fig = summarize(res, engines)
    return {"counts": fig["per_engine"]["requests"], "ttft_s": [x for x in res.ttft if x is not None],
            "shed": fig["rejected_by_status"].get("429", 0),
            "per_request": list(zip(res.worker, res.ttft)),
            "prefix_hit_rate": fig["prefix_hit_rate"], "figures": fig}


def compare(live: Figures, sim: Figures) -> Figures:
    """Side by side: shares, prefix hit rate and TTFT p50/p90 with their relative differences."""
    from dplb_trace.stats import percentile

    def shares(c: list[int]) -> list[float]:
        t = sum(c)
        return [x / t for x in c] if t else []

    out: Figures = {}
    ls, ss = shares(live["counts"]), shares(sim["counts"])
    out["share_live"], out["share_sim"] = [round(x, 3) for x in ls], [round(x, 3) for x in ss]
    out["max_share_live"], out["max_share_sim"] = max(ls), max(ss)
    out["min_share_live"], out["min_share_sim"] = min(ls), min(ss)
    out["prefix_hit_rate_live"], out["prefix_hit_rate_sim"] = live["prefix_hit_rate"], sim["prefix_hit_rate"]
    for q in (50, 90):
        a, b = percentile(live["ttft_s"], q), percentile(sim["ttft_s"], q)
        out[f"ttft_p{q}_live_s"], out[f"ttft_p{q}_sim_s"] = a, b
        out[f"ttft_p{q}_rel_diff"] = None if not a or b is None else (b - a) / a
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m simulate.fidelity", allow_abbrev=False)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--start", type=int, default=5000)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--policy", default="dplb")
    p.add_argument("--time-scale", type=float, default=2.0, help="the live engines' --time-scale")
    p.add_argument("--rate-scale", type=float, default=2.0)
    p.add_argument("--max-tokens-cap", type=int, default=8)
    p.add_argument("--spread-ms", type=float, default=200.0, help="gap between requests of one burst (0: none)")
    p.add_argument("--seeds", type=int, default=5, help="simulated runs (seeds 0..n-1); the median is compared")
    p.add_argument("--admission", choices=("on", "off"), default="on",
                   help="the router's admission queue on both sides (on: the default config)")
    p.add_argument("--log-dir", default=None)
    ns = p.parse_args(argv)
    reqs = load_workload(ns.trace, "auto", ns.start, ns.requests, ns.max_tokens_cap)
    if ns.spread_ms > 0:
        reqs = spread_bursts(reqs, ns.spread_ms)
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="dplb-fid-"))
    on = ns.admission == "on"
    live = run_live(reqs, ns.engines, ns.policy, ns.time_scale, log_dir, rate_scale=ns.rate_scale,
                    router_config=None if on else ADMISSION_OFF)
    sims = [run_sim(reqs, ns.engines, ns.policy, seed=s, time_scale=ns.time_scale, rate_scale=ns.rate_scale,
                    admission=on) for s in range(ns.seeds)]
    rows = [compare(live, s) for s in sims]
    out: Figures = {"live_errors": live["errors"], "shed_live": live["shed"],
                    "shed_sim": [s["shed"] for s in sims]}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        if k.endswith(("_live", "_live_s")):
            out[k] = vals[0]
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k + "_median"] = statistics.median(vals)
        else:
            out[k] = vals
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
