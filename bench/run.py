"""``python -m bench.run [--quick]``: DPLB's policies and the field's routers, side by side.

For each system (:func:`bench.systems.all_systems`) the harness starts fresh sim engines with the
same flags for everyone, starts the system in front of them, waits until a request gets through,
runs the workloads of :mod:`bench.workloads` one after another, ``--repeats`` times (3: each
repeat has its own seed, for the trace its own window; waiting for idle engines in between),
reads the engines' counters and the routing processes' CPU time around each run, and stops
everything it started. (a) and (s) run on the ``trace`` engine set, (d) on a set with one engine
at ``--slowdown 3``. Then the goodput search on (a) and (b)
(:func:`bench.goodput_search.run_goodput`: fresh engines and system per step, the highest rate
multiplier that meets the SLO), the overhead run (f), and the scaling run on 1, 2, 4, 8 engines,
all with repeats. The harness itself is :mod:`bench.harness`.

Cores (issue 17): with two or more CPUs the routing processes (router, DPLB's agents) are pinned
to one core and the engines and the load generator to the others (:func:`bench.procs.core_plan`),
so that the load generator does not steal from the router; ``--no-pin`` turns it off.

Output (``--out``, default ``bench/results``): ``latest.json`` (rows with exactly the keys of
:data:`bench.stats.ROW_KEYS`), ``latest.md`` (tables, machine, versions, command line) and PNG
plots (TTFT CDF on (a), per-worker share on (e), scaling curve). Logs of every process go to
``bench/results/tmp/<run id>/`` (git-ignored).

Engine speed: ``--time-scale`` (default :data:`TIME_SCALE`) is passed to every engine; workload
rates in :mod:`bench.workloads` were set once so that 4 engines are busy but not saturated by a
neutral round-robin spread, and are the same for every system.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

from bench import report
from bench.engines import EngineFlags
from bench.goodput_search import GOODPUT, goodput_systems, run_goodput
from bench.harness import (
    FAST_TIME_SCALE,
    HETERO_SLOWDOWN,
    NUM_ENGINES,
    REPEATS,
    TIME_SCALE,
    TRACE_TIME_SCALE,
    Harness,
)
from bench.procs import core_plan
from bench.systems import SystemSpec, all_systems
from bench.workloads import FULL, QUICK, WORKLOADS, Profile

RESULTS = Path(__file__).resolve().parent / "results"
#: ``--quick`` runs DPLB's main policy, the best peers and the direct run (every workload, plot
#: and the scaling run, with repeats, on smaller sizes)
QUICK_SYSTEMS = ("dplb/dplb", "sglang/cache_aware", "smg/least_load", "direct")
#: the full run: DPLB's default and every peer's best policies on everything; the field's
#: policies inside DPLB (the same ideas as smg's least_load, Dynamo's cost, LMetric, session
#: affinity) on the trace (a), beside the Rust routers. Within the 60-minute budget of
#: ``make bench``; any other system runs with ``--systems``.
FULL_SYSTEMS = ("dplb/dplb", "sglang/cache_aware", "vllm/cache_aware", "smg/cache_aware", "smg/least_load",
                "dplb/least_load", "dplb/kv_cost", "dplb/lmetric", "dplb/session", "direct")
#: systems that, in the default full run, take only the named workload (no goodput, no overhead
#: run): the field's policies inside DPLB, there for comparison with the same idea in a Rust
#: router; session affinity on the conversation replay. ``--systems`` runs what it names on every
#: workload.
TRACE_ONLY: dict[str, str] = {"dplb/least_load": "a_mooncake", "dplb/kv_cost": "a_mooncake",
                              "dplb/lmetric": "a_mooncake", "dplb/session": "s_sessions"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``python -m bench.run``."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small request counts (make bench-quick, < 10 min)")
    ap.add_argument("--systems", default=None,
                    help="comma list of systems (dplb/dplb, sglang/cache_aware, smg/least_load, direct, ...) or "
                         "'all'; default: " + ",".join(FULL_SYSTEMS) + "; with --quick: " + ",".join(QUICK_SYSTEMS))
    ap.add_argument("--workloads", default="all", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--no-scaling", action="store_true", help="skip the 1/2/4/8-engine scaling run")
    ap.add_argument("--no-goodput", action="store_true",
                    help="skip the goodput search on (a) and (b) (--quick always skips it)")
    ap.add_argument("--goodput-only", action="store_true",
                    help="run only the goodput search and put it into the run already in --out (its latest.json "
                         "rows choose the peers; latest.md's summary and goodput section are rewritten)")
    ap.add_argument("--repeats", type=int, default=REPEATS,
                    help=f"runs of every workload per system, each with its own seed (default {REPEATS})")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin the routing processes to one core and the rest to the others")
    ap.add_argument("--scaling-policy", default=None,
                    help="comma list of DPLB policies for the scaling run; the first is judged against the "
                         "goal, the others are for comparison (round_robin separates policy from machine)")
    ap.add_argument("--time-scale", type=float, default=TIME_SCALE,
                    help="sim_engine --time-scale for the main and hetero engine sets")
    ap.add_argument("--trace-time-scale", type=float, default=TRACE_TIME_SCALE,
                    help="sim_engine --time-scale for the trace set ((a), (s))")
    ap.add_argument("--seed", type=int, default=1234, help="base seed of the engines")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override one workload size of the profile (bench.workloads.Profile), e.g. "
                         "--set mooncake_requests=50; repeatable")
    ap.add_argument("--out", type=Path, default=RESULTS, help="where latest.json/latest.md/plots go")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    return ap.parse_args(argv)


def select(args: argparse.Namespace) -> tuple[list[SystemSpec], list[str]]:
    """The systems and workloads the flags ask for; ``SystemExit`` (code 2) naming unknown ones."""
    systems = all_systems()
    chosen = args.systems or ",".join(QUICK_SYSTEMS if args.quick else FULL_SYSTEMS)
    if chosen != "all":
        want = [s.strip() for s in chosen.split(",") if s.strip()]
        by = {s.label: s for s in systems}
        bad = [w for w in want if w not in by]
        if bad:
            raise SystemExit(f"unknown system(s) {bad}; known: {sorted(by)}")
        systems = [by[w] for w in want]
    workloads = list(WORKLOADS)
    if args.workloads != "all":
        workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
        bad = [w for w in workloads if w not in WORKLOADS]
        if bad:
            raise SystemExit(f"unknown workload(s) {bad}; known: {list(WORKLOADS)}")
    return systems, workloads


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def apply_overrides(profile: Profile, pairs: list[str]) -> Profile:
    """``profile`` with ``FIELD=VALUE`` overrides applied (value cast to the field's type).

    ``SystemExit`` (code 2 message) for an unknown field or a value of the wrong type.
    """
    kinds = {f.name: type(getattr(profile, f.name)) for f in fields(profile)}
    changes: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in kinds:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE with FIELD one of {sorted(kinds)}")
        try:
            changes[key] = kinds[key](value)
        except ValueError:
            raise SystemExit(f"--set {pair!r}: {key} takes a {kinds[key].__name__}") from None
    return replace(profile, **changes)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write ``latest.json``, ``latest.md`` and plots under ``--out``; exit 0."""
    args = parse_args(argv)
    systems, workloads = select(args)
    # SIGTERM unwinds like Ctrl-C, so every ProcessSet stops its children and segments are unlinked
    signal.signal(signal.SIGTERM, _terminate)
    profile = apply_overrides(replace(QUICK if args.quick else FULL, time_scale=args.time_scale,
                                      trace_time_scale=args.trace_time_scale), args.set)
    flags = EngineFlags(time_scale=args.time_scale, seed=args.seed)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out / "tmp" / run_id
    cores = core_plan(not args.no_pin)
    if cores.active:  # the load generator (this process) and everything it starts stay off the router's core
        os.sched_setaffinity(0, cores.rest)
    h = Harness(profile, flags, args.out, log_dir, verbose=not args.quiet, repeats=args.repeats, cores=cores)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.monotonic()
    for w in workloads:  # build every request list first: a missing trace fails before anything starts
        for rep in range(h.repeats):
            h.specs(w, rep)
    cmdline = " ".join(["python -m bench.run", *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))])
    trace_only = TRACE_ONLY if args.systems is None and not args.quick else {}
    slo_meta = {w: {"scaled": f, "ttft_p99_s": t, "tpot_p99_s": p, "ladder": list(up), "down": list(dn)}
                for w, (f, t, p, up, dn) in GOODPUT.items()}
    if args.goodput_only:
        import json
        h.rows = json.loads((args.out / "latest.json").read_text())
        for w in (w for w in workloads if w in GOODPUT):
            for spec in goodput_systems(systems, h.rows, w, trace_only):
                run_goodput(h, spec, w)
        report.update_goodput(args.out, h.goodput, slo_meta,
                              f"goodput searched by `{cmdline}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
                              f"({time.monotonic() - t0:.0f} s), after the rows above; the peers searched are the "
                              "two best of those rows")
        h.log(f"done; goodput written into {args.out}/latest.md and goodput.json")
        return 0
    for spec in systems:  # each system alone on fresh engines; the direct run only takes part in (f)
        mine = [w for w in workloads if spec.kind != "direct" and WORKLOADS[w].engines != "fast"
                and trace_only.get(spec.label, w) == w]
        for name in ("trace", "sessions", "main", "hetero"):
            h.run_group(spec, [w for w in mine if WORKLOADS[w].engines == name], name)
    if not args.no_goodput and not args.quick:
        for w in (w for w in workloads if w in GOODPUT):
            for spec in goodput_systems(systems, h.rows, w, trace_only):
                run_goodput(h, spec, w)
    for w in (w for w in workloads if WORKLOADS[w].engines == "fast"):
        h.run_overhead([s for s in systems if s.label not in trace_only], w)
    if not args.no_scaling:
        scaling_pols = args.scaling_policy or ("dplb" if args.quick else "dplb,round_robin")
        for pol in (p.strip() for p in scaling_pols.split(",") if p.strip()):
            h.run_scaling(pol)
    elapsed = time.monotonic() - t0
    meta = {"command": cmdline, "elapsed_s": round(elapsed, 1), "profile": "quick" if args.quick else "full",
            "engine_flags": asdict(flags), "fast_time_scale": FAST_TIME_SCALE, "num_engines": NUM_ENGINES,
            "hetero_slowdown": HETERO_SLOWDOWN, "repeats": h.repeats, "trace_time_scale": profile.trace_time_scale,
            "chunks_per_router_cpu_s": h.chunks_per_cpu, "cores": cores.describe(),
            "goodput_slo": slo_meta,
            "profile_values": asdict(profile), "run_id": run_id, "log_dir": str(log_dir),
            "load_start": load_start}
    report.write_all(args.out, h.rows, meta, h.notes, h.ttft_a, h.share_e, h.router_only_cpu, h.goodput)
    h.log(f"done in {elapsed:.0f} s; wrote {args.out}/latest.json, latest.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
