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

The stack's own time: the live run also reports ``stack_overhead_s``, the clients' mean TTFT minus
the engines' own mean TTFT (``vllm:time_to_first_token_seconds``, from the request reaching the
engine) and minus the router's mean admission wait (``dplb_router_admission_wait_seconds``), in
simulated seconds: what HTTP, the router and the relays add per request. The simulator models it
as a fixed delay between the router's dispatch and the engine (``SimSettings.stack_overhead_s``).
By default the simulated side gets the live run's own measurement (``--stack-overhead-ms live``:
the stack's time grows with the machine's load), else :data:`LIVE_STACK_OVERHEAD_S`;
``--stack-overhead-ms 0,live,...`` compares several values against the one live run.

What differs by construction (so the comparison has tolerances): the live stack's time varies with
the machine's load (the simulator's delay is fixed); the live engines group steps into bursts of at
least 1 ms wall; arrivals are sent by a real client with send lag; the agents' publication phases
and the policies' random draws differ.
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
#: the engines' own TTFT histogram (sim_engine.metrics: engine arrival -> first token, wall seconds)
ENGINE_TTFT = "vllm:time_to_first_token_seconds"
#: the router's admission waits of the requests it dispatched after a wait (router.metrics)
ROUTER_WAIT = "dplb_router_admission_wait_seconds"
#: the router's learned prefill rate per worker, tokens per wall second (router.metrics)
ROUTER_RATE = "dplb_worker_prefill_rate_tokens_per_second"
#: the live test stack's own time per request, wall seconds, when a run does not measure its own
#: (:func:`live_like`): :func:`run_live`'s ``stack_overhead_s``, three runs of ``python -m
#: simulate.fidelity --time-scale 1 --rate-scale 2 --admission off`` on the shared 2-core machine
#: at load 11-12 (0.120, 0.153, 0.169 s; bench/results/admission.md, "Round 6: past capacity and
#: fidelity"). It grows with the machine's load: prefer a run's own measurement.
LIVE_STACK_OVERHEAD_S = 0.153


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


def metric_samples(url: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of ``url``'s ``/metrics`` page as ``(name, labels, value)``. Raises
    ``OSError`` when it does not answer 200."""
    from prometheus_client.parser import text_string_to_metric_families

    from bench.engines import http_get
    status, body = http_get(url + "/metrics", 5.0)
    if status != 200:
        raise OSError(f"{url}/metrics answered {status}")
    return [(smp.name, smp.labels, smp.value)
            for fam in text_string_to_metric_families(body.decode("utf-8", "replace")) for smp in fam.samples]


def _sum(samples: list[tuple[str, dict[str, str], float]], name: str) -> float:
    return sum(v for n, _, v in samples if n == name)


def stack_time(engine_urls: list[str], router_url: str) -> tuple[float, float, float]:
    """What :func:`run_live` reads before and after the window to price the stack's own time:
    the engines' own TTFT summed (wall s), its count, and the router's admission waits summed
    (wall s)."""
    eng = [smp for u in engine_urls for smp in metric_samples(u)]
    return (_sum(eng, ENGINE_TTFT + "_sum"), _sum(eng, ENGINE_TTFT + "_count"),
            _sum(metric_samples(router_url), ROUTER_WAIT + "_sum"))


def learned_rates(router_url: str, engines: int) -> list[float]:
    """Per worker, the prefill rate the live router learned (tokens per wall second; 0: none)."""
    out = [0.0] * engines
    for name, labels, v in metric_samples(router_url):
        if name == ROUTER_RATE and 0 <= (k := int(labels.get("worker", "-1"))) < engines:
            out[k] = v
    return out


def run_live(reqs: list, engines: int, policy: str, time_scale: float, log_dir: Path,
             rate_scale: float = 1.0, router_config: Mapping[str, object] | None = None) -> Figures:
    """The window through the launched system; figures in simulated seconds (see module docstring).
    ``shed``: requests the router's admission queue answered 429 (its default config, as the
    simulator's, unless ``router_config`` gives one: a ``dplb.yaml`` as a dict); ``errors``: every
    other failed request; ``stack_overhead_s``: the clients' mean TTFT minus the engines' own and
    the router's mean admission wait (module docstring); ``prefill_rate``: per worker, the rate the
    router learned (tokens per simulated second)."""
    with ProcessSet(log_dir) as procs:
        es = start_engines(procs, engines, EngineFlags(time_scale=time_scale, seed=0))
        running = start_system(SystemSpec("dplb", policy), procs, es, log_dir, router_config=router_config)
        try:
            wait_idle(es.urls, 30)
            before = scrape(es.urls)
            st_before = stack_time(es.urls, running.base_url)
            opts = ReplayOptions(base_url=running.base_url + "/v1", time_scale=1.0 / (time_scale * rate_scale),
                                 timeout_s=300)
            results, wall_s, _ = asyncio.run(replay(reqs, opts))
            wait_idle(es.urls, 60)
            after = scrape(es.urls)
            st_after = stack_time(es.urls, running.base_url)
            rates = learned_rates(running.base_url, engines)
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
    n_eng = st_after[1] - st_before[1]
    eng_mean = (st_after[0] - st_before[0]) / n_eng * time_scale if n_eng else None
    wait_mean = (st_after[2] - st_before[2]) / n_eng * time_scale if n_eng else 0.0
    return {"stack_overhead_s": statistics.fmean(ttft) - eng_mean - wait_mean if ttft and eng_mean is not None
            else None,
            "engine_ttft_mean_s": eng_mean, "admission_wait_mean_s": wait_mean, "prefill_rate": [r / time_scale for r in rates],"errors": rep["errors"] - shed, "shed": shed, "counts": counts, "ttft_s": ttft,
            "prefix_hit_rate": h / q if q else None,
            "per_request": per,
            "send_lag_p99_s": rep["send_lag_ms"]["p99"] / 1000.0 * time_scale if rep["send_lag_ms"]["p99"] else 0.0}


def live_like(engines: int, policy: str, time_scale: float, seed: int = 0, rate_scale: float = 1.0,
              admission: bool = True, stack_overhead_s: float | None = None) -> SimSettings:
    """Settings that mimic the live cluster at ``--time-scale T`` in simulated time: the agents'
    state interval (200 ms), latency window (10 s), the router's health interval (200 ms) and
    heartbeat timeout (1 s) are wall-clock periods, T times longer in simulated time, and the
    latencies the agents measure and publish are wall times, T times shorter; so is the stack's own
    time per request (``stack_overhead_s`` in simulated seconds; None:
    :data:`LIVE_STACK_OVERHEAD_S` wall seconds × T). ``admission`` False:
    the router config's ``admission.enabled: false`` (as :data:`ADMISSION_OFF` live)."""
    d = Config()
    cfg = Config.model_validate({"health_check": {
        "interval_ms": round(d.health_check.interval_ms * time_scale),
        "heartbeat_timeout_ms": round(d.health_check.heartbeat_timeout_ms * time_scale)},
        **({} if admission else ADMISSION_OFF)})
    return SimSettings(engines=[EngineConfig() for _ in range(engines)], policy=policy, seed=seed, router=cfg,
                       rate_scale=rate_scale,
                       state_interval_ms=round(200 * time_scale), latency_window_s=10.0 * time_scale,
                       agent_latency_scale=1.0 / time_scale,
                       stack_overhead_s=LIVE_STACK_OVERHEAD_S * time_scale if stack_overhead_s is None
                       else stack_overhead_s)


def run_sim(reqs: list, engines: int, policy: str, seed: int = 0, time_scale: float = 1.0,
            rate_scale: float = 1.0, admission: bool = True, stack_overhead_s: float | None = None) -> Figures:
    """The window through ``dplb-simulate`` with :func:`live_like` settings (``admission`` False:
    the queue off; ``stack_overhead_s`` as there); the same figures as :func:`run_live`."""
    res = Simulation(reqs, live_like(engines, policy, time_scale, seed, rate_scale, admission,
                                     stack_overhead_s)).run()
    fig = summarize(res, engines)
    return {"counts": fig["per_engine"]["requests"], "ttft_s": [x for x in res.ttft if x is not None],
            "prefill_rate": res.prefill_rate,
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
    p.add_argument("--stack-overhead-ms", default="live", metavar="MS,MS,...",
                   help="the simulator's stack time per request in live wall ms (x --time-scale in simulated "
                        "time), 'live': the live run's own measurement (default); several: each against the "
                        "one live run")
    p.add_argument("--log-dir", default=None)
    ns = p.parse_args(argv)
    overheads = [x.strip() for x in ns.stack_overhead_ms.split(",") if x.strip()]
    reqs = load_workload(ns.trace, "auto", ns.start, ns.requests, ns.max_tokens_cap)
    if ns.spread_ms > 0:
        reqs = spread_bursts(reqs, ns.spread_ms)
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="dplb-fid-"))
    on = ns.admission == "on"
    live = run_live(reqs, ns.engines, ns.policy, ns.time_scale, log_dir, rate_scale=ns.rate_scale,
                    router_config=None if on else ADMISSION_OFF)
    out: Figures = {"live_errors": live["errors"], "shed_live": live["shed"],
                    "stack_overhead_live_s": live["stack_overhead_s"],
                    "engine_ttft_mean_live_s": live["engine_ttft_mean_s"],
                    "admission_wait_mean_live_s": live["admission_wait_mean_s"],
                    "prefill_rate_live": [round(x) for x in live["prefill_rate"]]}
    for ms in overheads:
        sim_s = (live["stack_overhead_s"] or 0.0) if ms == "live" else float(ms) / 1000.0 * ns.time_scale
        sims = [run_sim(reqs, ns.engines, ns.policy, seed=s, time_scale=ns.time_scale, rate_scale=ns.rate_scale,
                        admission=on, stack_overhead_s=sim_s) for s in range(ns.seeds)]
        part = out if len(overheads) == 1 else out.setdefault(f"stack_overhead_ms={ms}", {})
        part["stack_overhead_sim_s"] = sim_s
        part.update(_medians(live, sims))
    print(json.dumps(out, indent=2))
    return 0


def _medians(live: Figures, sims: list[Figures]) -> Figures:
    """The :func:`compare` rows of ``sims`` against ``live``: a live figure once, a simulated one as
    the median over the seeds (a list where not a number), with the sheds and learned rates."""
    rows = [compare(live, s) for s in sims]
    out: Figures = {"shed_sim": [s["shed"] for s in sims],
                    "prefill_rate_sim_median": [round(statistics.median(s["prefill_rate"][k] for s in sims))
                                                for k in range(len(sims[0]["prefill_rate"]))]}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        if k.endswith(("_live", "_live_s")):
            out[k] = vals[0]
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k + "_median"] = statistics.median(vals)
        else:
            out[k] = vals
    return out


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
