"""``dplb-simulate``: replay a trace through N simulated engines and the router's real policies in
virtual time; compare policies; find capacity.

    dplb-simulate --trace dplb_trace/data/mooncake/conversation_trace.jsonl --engines 8 \\
        --policy round_robin,cache_aware,dplb --rate-scale 2 --json-out sim.json --plot-dir plots/
    dplb-simulate --engines 8 --policy round_robin,cache_aware,dplb --find-capacity --slo-ttft-p99 10
    dplb-simulate --engines 4 --policy round_robin,dplb --find-capacity --slo-attainment 0.99,0.90

Exit status: 0 done, 2 bad command line, trace or config (the message names the flag, file or line),
130 interrupted (the private segments are unlinked in every case).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace

from dplb_trace.errors import TraceFormatError
from dplb_trace.mooncake import DEFAULT_TRACE, TraceRequest
from router.config import Config, load_config
from router.errors import ConfigError
from router.policies import policy_names
from sim_engine.config import EngineConfig, add_engine_args, config_from_args
from simulate.admission import (
    admission_figures,
    assign_mix,
    group_lines,
    parse_mix,
    sweep_table,
)
from simulate.capacity import find_capacity, min_engines, rate_sweep, trace_rate
from simulate.cluster import Simulation
from simulate.generators import DEFAULT_REQUESTS, WORKLOADS, describe, generate
from simulate.report import (
    LEGEND,
    Progress,
    attainment_line,
    capacity_table,
    grid_table,
    plot,
    progress_enabled,
    table,
    write_json,
)
from simulate.settings import (
    CLIENT_BOUNDS,
    DEFAULT_ATTAINMENT,
    DEFAULT_STACK_OVERHEAD_S,
    DEFAULT_TPOT_S,
    DEFAULT_TTFT_BASE_S,
    DEFAULT_TTFT_PER_1K_S,
    SLO,
    AttainmentSLO,
    Figures,
    SimSettings,
)
from simulate.stats import summarize
from simulate.workload import (
    APIS,
    EngineHasher,
    load_workload,
    spread_arrivals,
    window_of,
)

#: engine fields that do not apply in virtual time (or are names, not model constants)
_NOT_SETTINGS = ("time_scale",)


class UsageError(Exception):
    """A bad flag value; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dplb-simulate", allow_abbrev=False,
        description="Simulate the whole DPLB cluster (router policies, agents, engines) in virtual time.")
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=str(DEFAULT_TRACE),
                   help="Mooncake JSONL or Azure LLM inference CSV (default: the conversation trace)")
    g.add_argument("--trace-format", choices=("auto", "mooncake", "azure"), default="auto")
    g.add_argument("--workload", choices=sorted(WORKLOADS), default=None,
                   help="a generated workload instead of --trace (simulate.generators; seeded by "
                        "--workload-seed, default --seed; as written by dplb-workload)")
    g.add_argument("--workload-seed", type=int, default=None, help="seed of --workload (default: --seed)")
    g.add_argument("--start", type=int, default=0, help="first request of the window (0-based)")
    g.add_argument("--requests", type=int, default=None, help="requests in the window (default: all)")
    g.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiply the arrival rate (arrival times are divided by it; 2 = twice as fast)")
    g.add_argument("--arrival-spread-ms", type=float, default=0.0, metavar="W",
                   help="move each arrival later by a seeded uniform draw in [0, W) ms, then re-sort "
                        "(3000 undoes the conversation trace's 3 s timestamp grid; default 0: as recorded)")
    g.add_argument("--max-tokens-cap", type=int, default=None,
                   help="cap every request's output length (as dplb-replay --max-tokens-cap)")
    g.add_argument("--api", choices=APIS, default="chat",
                   help="what dplb-replay would send: a chat message (default) or a completions prompt")
    c = p.add_argument_group("cluster")
    c.add_argument("--engines", type=int, default=8, help="number of engines (default: 8)")
    c.add_argument("--engine-slowdown", default=None,
                   help="per-engine step-time factors, comma-separated, cycled over the engines (1,1,1,3)")
    c.add_argument("--engine-override", action="append", default=[], metavar="K:FLAGS",
                   help="engine flags for engine K only, e.g. '3:--num-gpu-blocks 9000 --slowdown 2' (repeatable)")
    c.add_argument("--state-interval-ms", type=int, default=200,
                   help="agents' publication period of engine state (dplb-worker-agent's default: 200)")
    c.add_argument("--latency-window-s", type=float, default=10.0,
                   help="age at which latency samples leave the slot windows (agent default: 10)")
    c.add_argument("--stack-overhead-ms", type=float, default=DEFAULT_STACK_OVERHEAD_S * 1000.0,
                   help="the stack's own time per request, from the router's dispatch to the engine "
                        f"(default {DEFAULT_STACK_OVERHEAD_S * 1000.0:g}; the live test stack's: simulate.fidelity)")
    r = p.add_argument_group("routing")
    r.add_argument("--policy", default=None,
                   help=f"comma-separated policies to compare (of {', '.join(policy_names())}; default: the config's)")
    r.add_argument("--config", default=None, help="router config (dplb.yaml): weights, thresholds, health interval")
    r.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="R router replicas behind a round-robin front, each with its own policy state, "
                        "prefix index and in-flight accounting (as on R nodes), the engines shared (default 1)")
    r.add_argument("--oracle-prefix", action="store_true",
                   help="simulator only: prefix-aware policies see each engine's true cached prefix of the "
                        "request instead of the router's prefix index (what the index costs)")
    r.add_argument("--events-prefix", action="store_true",
                   help="simulator only: prefix-aware policies see each engine's cached prefix of the request as "
                        "the engines' KV-cache events tell it (one block set per engine, updated when each step "
                        "ends, shared by every replica) instead of the router's prefix index")
    r.add_argument("--events-pending-s", type=float, default=30.0, metavar="S",
                   help="with --events-prefix: a replica's own placements count as the engine's blocks until "
                        "the engine's events store them or S seconds pass (0: the events alone; default 30)")
    r.add_argument("--share-load-ms", type=float, default=None, metavar="D",
                   help="with --replicas: the replicas share their in-flight work per engine (requests, prefill "
                        "tokens, decodes) through a store, each change seen by the others D ms later (a Redis "
                        "or NATS publication; default: nothing shared)")
    r.add_argument("--client-max-tokens", choices=CLIENT_BOUNDS, default="exact",
                   help="the max_tokens the router is told (the engine still generates the trace's output "
                        "length): exact (the trace's length, an oracle; default), pow2 (rounded up to a power "
                        "of two), x4 (four times over) or none (absent: the policy's default)")
    a = p.add_argument_group("admission (the router's queue: config admission.*)")
    a.add_argument("--admission", choices=("config", "on", "off"), default="config",
                   help="the router's admission queue: as the config says (admission.enabled, default on), on or off")
    a.add_argument("--priority-mix", default=None, metavar="P:W,...",
                   help="draw each request's priority class by weight, e.g. 1:0.3,0:0.7 (seeded by --seed)")
    a.add_argument("--tenant-mix", default=None, metavar="NAME:W,...",
                   help="draw each request's tenant by weight, e.g. heavy:10,light:1 (seeded by --seed)")
    a.add_argument("--goodput-sweep", default=None, metavar="F,F,...",
                   help="per policy, complete runs at --rate-scale x each factor: the goodput (SLO-met "
                        "requests/s) vs offered load curve")
    o = p.add_argument_group("output")
    o.add_argument("--json-out", default=None, help="write one JSON object per policy (a JSON array)")
    o.add_argument("--plot-dir", default=None, help="write ttft_cdf.png and queue_<policy>.png here")
    o.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (auto: when stderr is a terminal)")
    o.add_argument("--load-points", type=int, default=300, help="samples of load over time per engine (300)")
    k = p.add_argument_group("capacity")
    k.add_argument("--find-capacity", action="store_true",
                   help="per policy, the highest rate multiple served within the SLO (bisection): at each "
                        "--slo-attainment Q, and at the p99 SLO when --slo-ttft-p99/--slo-tpot-p99 is given "
                        "(then the attainment search runs only if --slo-attainment is given too)")
    k.add_argument("--min-engines", action="store_true",
                   help="per policy, the fewest engines meeting the SLO at --rate-scale (same SLO rule)")
    k.add_argument("--slo-ttft-p99", type=float, default=None, help="TTFT p99 bound, seconds")
    k.add_argument("--slo-tpot-p99", type=float, default=None, help="TPOT p99 bound, seconds")
    k.add_argument("--slo-ttft-s", type=float, default=DEFAULT_TTFT_BASE_S, metavar="BASE",
                   help="per-request SLO: fixed part of the TTFT bound, seconds (default 1.0, as vLLM "
                        "router's smetric_ttft_slo_secs)")
    k.add_argument("--slo-ttft-per-1k-s", type=float, default=DEFAULT_TTFT_PER_1K_S, metavar="PER",
                   help="per-request SLO: TTFT allowance per 1000 prompt tokens, seconds (default 0.1; "
                        "vLLM router's smetric uses 0.0625, below the engine model's idle prefill time of "
                        "prompts over ~79k tokens: see simulate.cluster)")
    k.add_argument("--slo-tpot-s", type=float, default=DEFAULT_TPOT_S, metavar="T",
                   help="per-request SLO: TPOT bound, seconds; 0 = none (default 0.1)")
    k.add_argument("--slo-attainment", action="append", default=None, metavar="Q",
                   help="share of requests that must meet the per-request SLO, in (0, 1]; repeatable or "
                        "comma-separated (default 0.99 and 0.90)")
    k.add_argument("--capacity-tolerance", type=float, default=0.05,
                   help="stop bisecting when hi/lo <= 1 + this (default 0.05)")
    k.add_argument("--rate-grid", default=None, metavar="F,F,...",
                   help="per policy, complete runs at --rate-scale x each factor (e.g. 0.7,0.8,0.9,1,1.1,1.2,1.3): "
                        "SLO misses per rate, their sum, and the sustained capacity at each Q (the highest grid "
                        "rate with every grid rate at or below it attaining Q); the same rates for every policy")
    k.add_argument("--max-engines", type=int, default=64, help="upper bound of --min-engines (64)")
    add_engine_args(p)  # every dplb-sim-engine engine flag (--seed also seeds the router and agents)
    return p


def parse_floats(flag: str, text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated numbers like 1,1,1,3") from None
    if not vals or any(not v > 0 for v in vals):
        raise UsageError(f"{flag} {text!r}: every factor must be > 0")
    return vals


def attainment_targets(ns: argparse.Namespace) -> list[float]:
    """The ``--slo-attainment`` values (every occurrence, comma lists split), in the order given,
    duplicates dropped; the defaults (0.99, 0.90) when the flag is absent."""
    if ns.slo_attainment is None:
        return list(DEFAULT_ATTAINMENT)
    out: list[float] = []
    for text in ns.slo_attainment:
        for part in text.split(","):
            if not part.strip():
                continue
            try:
                q = float(part)
            except ValueError:
                raise UsageError(f"--slo-attainment {text!r}: expected numbers like 0.99,0.9") from None
            if not 0 < q <= 1:
                raise UsageError(f"--slo-attainment {part.strip()}: must be in (0, 1]")
            if q not in out:
                out.append(q)
    if not out:
        raise UsageError("--slo-attainment: no value given")
    return out


def attainment_slo(ns: argparse.Namespace) -> AttainmentSLO:
    """The per-request SLO of the ``--slo-ttft-s/--slo-ttft-per-1k-s/--slo-tpot-s`` flags."""
    if not ns.slo_ttft_s > 0:
        raise UsageError(f"--slo-ttft-s {ns.slo_ttft_s}: must be > 0")
    if not ns.slo_ttft_per_1k_s >= 0:
        raise UsageError(f"--slo-ttft-per-1k-s {ns.slo_ttft_per_1k_s}: must be >= 0")
    if not ns.slo_tpot_s >= 0:
        raise UsageError(f"--slo-tpot-s {ns.slo_tpot_s}: must be >= 0 (0 = no TPOT bound)")
    return AttainmentSLO(ns.slo_ttft_s, ns.slo_ttft_per_1k_s, ns.slo_tpot_s or None)


def engine_configs(ns: argparse.Namespace) -> list[EngineConfig]:
    """One :class:`EngineConfig` per engine: the shared engine flags, ``--engine-slowdown`` (cycled),
    then each ``--engine-override K:FLAGS`` parsed by the same engine flag parser."""
    if ns.engines < 1:
        raise UsageError(f"--engines {ns.engines}: must be >= 1")
    try:
        base = config_from_args(ns)
    except ValueError as e:
        raise UsageError(f"engine flags: {e}") from None
    out = [replace(base) for _ in range(ns.engines)]
    if ns.engine_slowdown:
        sl = parse_floats("--engine-slowdown", ns.engine_slowdown)
        for k, ecfg in enumerate(out):
            ecfg.slowdown = sl[k % len(sl)]
    for ov in ns.engine_override:
        head, sep, flags = ov.partition(":")
        if not sep or not head.strip().isdigit() or not 0 <= int(head) < ns.engines:
            raise UsageError(f"--engine-override {ov!r}: expected K:FLAGS with 0 <= K < {ns.engines}")
        k = int(head)
        sub = add_engine_args(argparse.ArgumentParser(prog=f"engine {k}", allow_abbrev=False, add_help=False))
        defaults = asdict(out[k])
        sub.set_defaults(**defaults)
        try:
            sub_ns = sub.parse_args(flags.split())
            out[k] = config_from_args(sub_ns)
        except (SystemExit, ValueError) as e:
            raise UsageError(f"--engine-override {ov!r}: invalid engine flags ({e})") from None
    return out


def run_settings(ns: argparse.Namespace, reqs: list[TraceRequest], engines: list[EngineConfig],
                 cfg: Config) -> Figures:
    """The settings of the run, as they appear in the JSON (what to pass to get the same run)."""
    e0 = {f.name: getattr(engines[0], f.name) for f in fields(EngineConfig) if f.name not in _NOT_SETTINGS}
    per_engine = []
    for k, e in enumerate(engines):
        diff = {f.name: getattr(e, f.name) for f in fields(EngineConfig)
                if f.name not in _NOT_SETTINGS and getattr(e, f.name) != e0[f.name]}
        if diff:
            per_engine.append({"engine": k, **diff})
    return {
        "trace": ns.trace, "trace_format": ns.trace_format, "start": ns.start, "requests": len(reqs),
        "max_tokens_cap": ns.max_tokens_cap, "rate_scale": ns.rate_scale, "engines": len(engines),
        "arrival_spread_ms": ns.arrival_spread_ms,
        "engine_slowdown": [e.slowdown for e in engines], "engine": e0, "engine_differences": per_engine,
        "seed": ns.seed, "state_interval_ms": ns.state_interval_ms, "latency_window_s": ns.latency_window_s,
        "api": ns.api, "config": ns.config, "oracle_prefix": ns.oracle_prefix, "events_prefix": ns.events_prefix,
        "events_pending_s": ns.events_pending_s, "client_max_tokens": ns.client_max_tokens,
        "replicas": ns.replicas, "share_load_ms": ns.share_load_ms, "stack_overhead_ms": ns.stack_overhead_ms,
        "routing_policy": cfg.routing_policy.model_dump(),
        "health_check_interval_ms": cfg.health_check.interval_ms,
        "heartbeat_timeout_ms": cfg.health_check.heartbeat_timeout_ms,
    }


def _policies(ns: argparse.Namespace, cfg: Config) -> list[str]:
    names = [x.strip() for x in (ns.policy or cfg.routing_policy.policy).split(",") if x.strip()]
    bad = [x for x in names if x not in policy_names()]
    if bad or not names:
        raise UsageError(f"--policy {ns.policy!r}: unknown {', '.join(bad) or 'empty list'}; "
                         f"one of {', '.join(policy_names())}")
    if len(set(names)) != len(names):
        raise UsageError(f"--policy {ns.policy!r}: a policy is named twice")
    return names


def att_slo_text(slo: AttainmentSLO) -> str:
    """``per request TTFT <= 1 s + 0.1 s/1k prompt tokens, TPOT <= 0.1 s`` (the SLO in words)."""
    tpot = f", TPOT <= {slo.tpot_s:g} s" if slo.tpot_s is not None else ""
    return f"per request TTFT <= {slo.ttft_base_s:g} s + {slo.ttft_per_1k_s:g} s/1k prompt tokens{tpot}"


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C: finally blocks unlink the private segments
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return _main(ns)
    except (UsageError, ConfigError, TraceFormatError, ValueError, FileNotFoundError) as e:
        print(f"dplb-simulate: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ndplb-simulate: interrupted", file=sys.stderr)
        return 130


@dataclass
class _Plan:
    """What one ``dplb-simulate`` invocation runs: the router config and policies, the requests and
    engines, the per-request SLO and the searches asked for (capacity, rate grid, goodput sweep)."""

    ns: argparse.Namespace
    cfg: Config
    policies: list[str]
    reqs: list[TraceRequest]
    engines: list[EngineConfig]
    att_slo: AttainmentSLO
    targets: list[float]                 # the --slo-attainment values
    search_q: list[float]                # the attainment values the capacity searches look for
    p99: bool                            # a p99 SLO is given (--slo-ttft-p99/--slo-tpot-p99)
    grid: list[float] | None             # --rate-grid factors
    sweep: list[float] | None            # --goodput-sweep factors
    show: bool                           # the progress bar
    hashers: dict[tuple[int, str], EngineHasher] = field(default_factory=dict)

    def run(self, settings: SimSettings, label: str) -> tuple[Figures, list[float]]:
        """One simulation: its figures (with ``_wall_s``, the wall seconds it took) and its TTFT samples (s)."""
        bar = Progress(label, self.show)
        t0 = time.perf_counter()
        try:
            res = Simulation(self.reqs, settings, self.hashers).run(bar)
        finally:
            bar.close()
        fig = summarize(res, len(settings.engines), self.att_slo)
        fig["admission"] = admission_figures(res, fig["slo_attainment"])
        fig["_wall_s"] = time.perf_counter() - t0
        return fig, [x for x in res.ttft if x is not None]

    def figures(self, settings: SimSettings, label: str) -> Figures:
        """One simulation's figures alone (a search's step)."""
        f, _ = self.run(settings, label)
        f.pop("_wall_s", None)
        return f


def _check_numbers(ns: argparse.Namespace) -> None:
    """The run's plain number flags in range, else :class:`UsageError` naming the flag."""
    if ns.rate_scale <= 0:
        raise UsageError(f"--rate-scale {ns.rate_scale}: must be > 0")
    if ns.state_interval_ms < 10:
        raise UsageError(f"--state-interval-ms {ns.state_interval_ms}: must be >= 10 (as the agent's)")
    if ns.replicas < 1:
        raise UsageError(f"--replicas {ns.replicas}: must be >= 1")
    if ns.share_load_ms is not None and ns.share_load_ms < 0:
        raise UsageError(f"--share-load-ms {ns.share_load_ms}: must be >= 0")
    if ns.latency_window_s < 0:
        raise UsageError(f"--latency-window-s {ns.latency_window_s}: must be >= 0")
    if ns.stack_overhead_ms < 0:
        raise UsageError(f"--stack-overhead-ms {ns.stack_overhead_ms}: must be >= 0")


def _requests(ns: argparse.Namespace) -> tuple[list[TraceRequest], int | None]:
    """The requests of the window (``--workload`` generated, else ``--trace`` read), arrivals
    spread by ``--arrival-spread-ms``, and the workload's seed (None for a trace). Sets
    ``ns.trace`` to ``workload:<name>:seed=<seed>`` for a generated workload."""
    wseed = None
    if ns.workload:
        if ns.start < 0 or (ns.requests is not None and ns.requests < 1):
            raise UsageError("--start must be >= 0 and --requests >= 1")
        if ns.max_tokens_cap is not None and ns.max_tokens_cap < 1:
            raise UsageError(f"--max-tokens-cap {ns.max_tokens_cap}: must be >= 1")
        wseed = ns.seed if ns.workload_seed is None else ns.workload_seed
        size = DEFAULT_REQUESTS if ns.requests is None else ns.start + ns.requests
        reqs = window_of(generate(ns.workload, wseed, size), ns.start, ns.requests, ns.max_tokens_cap)
        ns.trace = f"workload:{ns.workload}:seed={wseed}"
    else:
        reqs = load_workload(ns.trace, ns.trace_format, ns.start, ns.requests, ns.max_tokens_cap)
    if ns.arrival_spread_ms < 0:
        raise UsageError(f"--arrival-spread-ms {ns.arrival_spread_ms}: must be >= 0")
    return spread_arrivals(reqs, ns.arrival_spread_ms, ns.seed), wseed


def _plan(ns: argparse.Namespace) -> tuple[_Plan, Figures, SimSettings]:
    """The invocation's plan, the settings as the JSON rows carry them, and the base settings
    (no policy yet). Raises :class:`UsageError` (bad flag), ``ConfigError``, ``TraceFormatError``."""
    cfg = load_config(ns.config) if ns.config else Config()
    if ns.admission != "config":
        cfg.admission.enabled = ns.admission == "on"
    policies = _policies(ns, cfg)
    _check_numbers(ns)
    att_slo = attainment_slo(ns)
    targets = attainment_targets(ns)
    grid = parse_floats("--rate-grid", ns.rate_grid) if ns.rate_grid is not None else None
    p99 = ns.slo_ttft_p99 is not None or ns.slo_tpot_p99 is not None
    # a p99 SLO alone keeps today's search; --slo-attainment (or no p99 bound) adds one per Q
    search_q = targets if ns.slo_attainment is not None or not p99 else []
    engines = engine_configs(ns)
    reqs, wseed = _requests(ns)
    together = len(reqs) - len({r.timestamp_ms for r in reqs})
    if search_q and (ns.find_capacity or ns.min_engines) and together > 0.1 * len(reqs):
        print(f"dplb-simulate: note: {together} of {len(reqs)} arrivals share their instant with an earlier "
              "one; --rate-scale does not spread such groups, so per-request SLOs may stay out of reach "
              "at any rate (--arrival-spread-ms 3000 spreads the conversation trace's 3 s grid)",
              file=sys.stderr)
    try:
        prio_mix = parse_mix("--priority-mix", ns.priority_mix, int)
        tenant_mix = parse_mix("--tenant-mix", ns.tenant_mix, str)
    except ValueError as e:
        raise UsageError(str(e)) from None
    sweep = parse_floats("--goodput-sweep", ns.goodput_sweep) if ns.goodput_sweep is not None else None
    settings_json = run_settings(ns, reqs, engines, cfg)
    settings_json["admission"] = cfg.admission.model_dump()
    settings_json["priority_mix"] = ns.priority_mix
    settings_json["tenant_mix"] = ns.tenant_mix
    if ns.workload:
        settings_json["workload"] = {"name": ns.workload, "seed": wseed, **describe(reqs)}
    plan = _Plan(ns=ns, cfg=cfg, policies=policies, reqs=reqs, engines=engines, att_slo=att_slo, targets=targets,
                 search_q=search_q, p99=p99, grid=grid, sweep=sweep, show=progress_enabled(ns.progress))
    base = SimSettings(engines=engines, router=cfg, state_interval_ms=ns.state_interval_ms,
                       latency_window_s=ns.latency_window_s, rate_scale=ns.rate_scale, api=ns.api,
                       seed=ns.seed, load_points=ns.load_points, oracle_prefix=ns.oracle_prefix,
                       client_max_tokens=ns.client_max_tokens, replicas=ns.replicas,
                       events_prefix=ns.events_prefix, share_load_ms=ns.share_load_ms,
                       events_pending_s=ns.events_pending_s, stack_overhead_s=ns.stack_overhead_ms / 1000.0,
                       priorities=assign_mix(len(reqs), prio_mix, ns.seed + 1, 0) if prio_mix else None,
                       tenants=assign_mix(len(reqs), tenant_mix, ns.seed + 2, "") if tenant_mix else None)
    return plan, settings_json, base


def _capacity(plan: _Plan, row: Figures, name: str, settings: SimSettings, fig: Figures) -> None:
    """``--find-capacity``: the highest rate multiple within the p99 SLO and at each attainment Q, into ``row``."""
    ns = plan.ns
    rate = trace_rate(plan.reqs)
    slo = SLO(ns.slo_ttft_p99, ns.slo_tpot_p99)

    def cap_run(st: SimSettings) -> Figures:
        return plan.figures(st, f"{name} capacity x{st.rate_scale:.3g}")

    if plan.p99:
        row["capacity"] = find_capacity(cap_run, settings, slo, rate, start=ns.rate_scale,
                                        tolerance=ns.capacity_tolerance, known={ns.rate_scale: fig})
    if plan.search_q:
        # a run that went to the end decides every Q: the searches share them
        complete: dict[float, Figures] = {ns.rate_scale: fig}

        def att_run(st: SimSettings) -> Figures:
            f = cap_run(st)
            if not f["aborted_early"]:
                complete[st.rate_scale] = f
            return f

        row["capacity_attainment"] = {
            f"{q:g}": find_capacity(att_run, settings, slo, rate, start=ns.rate_scale,
                                    tolerance=ns.capacity_tolerance, known=complete,
                                    attainment=(plan.att_slo, q))
            for q in plan.search_q}


def _goodput_sweep(plan: _Plan, name: str, settings: SimSettings, fig: Figures) -> list[Figures]:
    """``--goodput-sweep``: one point per factor (offered and SLO-met requests/s, sheds, TTFT)."""
    out: list[Figures] = []
    for f in plan.sweep or []:
        x = plan.ns.rate_scale * f
        fx = fig if f == 1.0 else plan.run(replace(settings, rate_scale=x), f"{name} sweep x{x:.3g}")[0]
        fx.pop("_wall_s", None)
        a = fx["admission"]
        out.append({
            "policy": name, "x": x, "offered_rps": a["offered_rps"], "goodput_rps": a["goodput_rps"],
            "attainment": fx["slo_attainment"]["attainment"], "shed": a["shed"],
            "ttft_p50": fx["ttft_s"]["p50"] or 0.0, "ttft_p99": fx["ttft_s"]["p99"] or 0.0,
            "by_class": a.get("by_class"), "by_tenant": a.get("by_tenant")})
    return out


def _min_engines(plan: _Plan, row: Figures, name: str, settings: SimSettings) -> None:
    """``--min-engines``: the fewest engines within the p99 SLO and at each attainment Q, into ``row``."""
    ns = plan.ns
    slo = SLO(ns.slo_ttft_p99, ns.slo_tpot_p99)

    def eng_run(st: SimSettings) -> Figures:
        return plan.figures(st, f"{name} {len(st.engines)} engines")

    if plan.p99:
        row["min_engines"] = min_engines(eng_run, settings, slo, ns.max_engines)
    if plan.search_q:
        row["min_engines_attainment"] = {
            f"{q:g}": min_engines(eng_run, settings, slo, ns.max_engines, attainment=(plan.att_slo, q))
            for q in plan.search_q}


def _policy_row(plan: _Plan, settings: SimSettings, settings_json: Figures) -> tuple[Figures, list[float], float]:
    """One policy's row: the run at ``--rate-scale`` and every search asked for; with its TTFT
    samples (s) and the wall seconds of the first run."""
    ns, name = plan.ns, settings.policy
    fig, samples = plan.run(settings, f"{name} x{ns.rate_scale:g}")
    wall = fig.pop("_wall_s")
    row: Figures = {"policy": name, "settings": settings_json, **fig}
    if ns.find_capacity:
        _capacity(plan, row, name, settings, fig)
    if plan.grid is not None:
        row["rate_grid"] = rate_sweep(lambda st: plan.figures(st, f"{name} grid x{st.rate_scale:.3g}"), settings,
                                      plan.grid, trace_rate(plan.reqs), plan.targets, known={ns.rate_scale: fig})
    if plan.sweep is not None:
        row["goodput_sweep"] = _goodput_sweep(plan, name, settings, fig)
    if ns.min_engines:
        _min_engines(plan, row, name, settings)
    return row, samples, wall


def _report(plan: _Plan, rows: list[Figures]) -> None:
    """Print the rows: the table, the attainment line, replicas and admission, then each search's table."""
    ns, att_slo = plan.ns, plan.att_slo
    print(f"trace {ns.trace}: {len(plan.reqs)} requests from #{ns.start}, rate x{ns.rate_scale:g}, "
          f"{len(plan.engines)} engines, seed {ns.seed} (times in s, TPOT in ms)")
    print(table(rows))
    print(f"({LEGEND})")
    print(attainment_line(rows, att_slo))
    if ns.replicas > 1:
        for row in rows:
            acc = (row.get("replicas") or {}).get("accounting_error") or {}
            print(f"{row['policy']}: {ns.replicas} router replicas (round robin); accounting error "
                  f"{acc.get('inflight')} (sum over replicas of |requests a replica counts on an engine - "
                  "requests there| / requests there)")
    adm_txt = ", ".join(f"{r['policy']} queued {r['admission']['queued']}, shed {r['admission']['shed']} "
                        f"(longest wait {r['admission']['shed_wait_max_s']} s), goodput {r['admission']['goodput_rps']} "
                        f"req/s of {r['admission']['offered_rps']} offered" for r in rows)
    print(f"admission ({'on' if plan.cfg.admission.enabled else 'off'}): {adm_txt}")
    groups = group_lines(rows)
    if groups:
        print(groups)
    if plan.sweep is not None:
        print(f"\ngoodput vs offered load ({att_slo_text(att_slo)})")
        print(sweep_table([p for r in rows for p in r["goodput_sweep"]]))
    _report_searches(plan, rows)


def _report_searches(plan: _Plan, rows: list[Figures]) -> None:
    """Print the capacity (p99 and attainment) and rate-grid tables the searches filled in."""
    ns, att_slo = plan.ns, plan.att_slo
    if (ns.find_capacity or ns.min_engines) and plan.p99:
        slo_txt = ", ".join(x for x in (f"TTFT p99 <= {ns.slo_ttft_p99} s" if ns.slo_ttft_p99 is not None else "",
                                        f"TPOT p99 <= {ns.slo_tpot_p99} s" if ns.slo_tpot_p99 is not None else "")
                            if x)
        print(f"\ncapacity within {slo_txt} (x = multiple of the trace's own rate)")
        print(capacity_table(rows))
    if (ns.find_capacity or ns.min_engines) and plan.search_q:
        print(f"\ncapacity at SLO attainment Q (x = multiple of the trace's own rate; {att_slo_text(att_slo)})")
        print(capacity_table(rows, [f"{q:g}" for q in plan.search_q]))
    if plan.grid is not None:
        print(f"\nSLO misses over the rate grid (of {len(plan.reqs)} requests per rate; {att_slo_text(att_slo)})")
        print(grid_table(rows, [f"{q:g}" for q in plan.targets]))


def _main(ns: argparse.Namespace) -> int:
    plan, settings_json, base = _plan(ns)
    rows: list[Figures] = []
    ttfts: dict[str, list[float]] = {}
    walls: list[str] = []
    for name in plan.policies:
        row, ttfts[name], wall = _policy_row(plan, replace(base, policy=name), settings_json)
        walls.append(f"{name} {wall:.1f} s")
        rows.append(row)
    _report(plan, rows)
    print("wall: " + ", ".join(walls), file=sys.stderr)
    if ns.json_out:
        write_json(ns.json_out, rows)
    if ns.plot_dir:
        for path in plot(rows, ttfts, ns.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
