"""``python -m bench.run [--quick]``: DPLB's policies and the field's routers, side by side.

For each system (:func:`bench.systems.all_systems`) the harness starts fresh sim engines with the
same flags for everyone, starts the system in front of them, waits until a request gets through,
runs the workloads of :mod:`bench.workloads` one after another (waiting for idle engines in
between), reads the engines' counters and the routing processes' CPU time around each workload,
and stops everything it started. Workload (d) gets its own engine set with one engine at
``--slowdown 3``. Then DPLB's scaling run on 1, 2, 4, 8 engines.

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
import asyncio
import os
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from bench import report
from bench.engines import EngineFlags, counter_delta, scrape, start_engines, wait_idle
from bench.errors import BenchError
from bench.loadgen import RequestSpec, Result, run_closed, run_open
from bench.procs import ProcessSet, cpu_seconds
from bench.stats import make_row
from bench.systems import (
    MODEL,
    SystemSpec,
    all_systems,
    probe,
    start_system,
    stop_system,
)
from bench.workloads import FULL, QUICK, WORKLOADS, Profile, scaling

RESULTS = Path(__file__).resolve().parent / "results"
#: simulated seconds per wall second given to every engine (``sim_engine --time-scale``) of the
#: ``main`` and ``hetero`` sets. Below 1, the simulated GPU runs slower than real time, so the
#: engines are the bottleneck while the token rate stays within what 2 CPU cores can stream.
TIME_SCALE = 0.5
#: ``--time-scale`` of the ``fast`` set used by (f): a 5 ms step takes 0.05 ms of wall time, so
#: the engine adds next to nothing and the router's own added latency shows.
FAST_TIME_SCALE = 100.0
NUM_ENGINES = 4
HETERO_SLOWDOWN = 3.0


def engine_sets(time_scale: float, seed: int, n: int = NUM_ENGINES) -> dict[str, tuple[EngineFlags, tuple[float, ...]]]:
    """The engine sets by name: ``(flags, per-engine slowdowns)``; every system gets the same."""
    flags = EngineFlags(time_scale=time_scale, seed=seed)
    return {"main": (flags, tuple([1.0] * n)),
            "hetero": (flags, tuple([1.0] * (n - 1) + [HETERO_SLOWDOWN])),
            "fast": (EngineFlags(time_scale=FAST_TIME_SCALE, seed=seed), tuple([1.0] * n))}
SCALING_SIZES = (1, 2, 4, 8)
#: ``--quick`` runs DPLB's main policy and one baseline, each peer's cache-aware policy and the
#: direct run (every workload, plot and the scaling run; the full run has all ten systems)
QUICK_SYSTEMS = ("dplb/dplb", "dplb/round_robin", "sglang/cache_aware", "vllm/cache_aware", "direct")


def _run_async(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    except ImportError:
        return asyncio.run(coro)


def send(base_url: str, specs: list[RequestSpec], closed_concurrency: int | None) -> tuple[list[Result], float]:
    """Run one workload's requests against ``base_url``; ``(results, wall seconds)``."""
    if closed_concurrency:
        return _run_async(run_closed(base_url, specs, closed_concurrency))
    return _run_async(run_open(base_url, specs))


def with_load_format(flags: EngineFlags, systems: list[SystemSpec]) -> EngineFlags:
    """``flags`` plus ``--get-load-format vllm`` when a vllm-router system is among ``systems``.

    The flag changes only the JSON shape of the engines' ``GET /get_load`` (vllm-router's
    power_of_two reads ``{"load": N}``, SGLang's router a list); no other system here reads that
    endpoint (SGLang's router polls it only for its power_of_two, which is not benchmarked; DPLB's
    agents read ``/metrics``), so engine behaviour stays identical for everyone.
    """
    if any(s.kind == "vllm" for s in systems):
        return replace(flags, extra=(*flags.extra, "--get-load-format", "vllm"))
    return flags


@dataclass
class Measured:
    """Raw figures of one workload on one system: client results, wall seconds, per-engine
    counter deltas, routing CPU seconds (router + agents; ``None`` without a router) and the
    router processes' own CPU seconds."""

    results: list[Result]
    wall: float
    deltas: list[dict[str, float]]
    cpu: float | None
    router_cpu: float | None

    def add(self, other: Measured) -> None:
        """Accumulate another batch of the same workload (interleaved runs)."""
        self.results += other.results
        self.wall += other.wall
        self.deltas = other.deltas if not self.deltas else [
            {k: a[k] + b[k] for k in a} for a, b in zip(self.deltas, other.deltas)]
        if self.cpu is not None and other.cpu is not None:
            self.cpu += other.cpu
        if self.router_cpu is not None and other.router_cpu is not None:
            self.router_cpu += other.router_cpu


def measure(running, engine_urls: list[str], specs: list[RequestSpec],  # type: ignore[no-untyped-def]
            closed_concurrency: int | None) -> Measured:
    """Send ``specs`` through ``running``; engine counters and routing CPU read around it."""
    before = scrape(engine_urls)
    cpu0, rcpu0 = cpu_seconds(running.route_pids), cpu_seconds(running.router_pids)
    results, wall = send(running.base_url, specs, closed_concurrency)
    wait_idle(engine_urls, 60)
    cpu1, rcpu1 = cpu_seconds(running.route_pids), cpu_seconds(running.router_pids)
    after = scrape(engine_urls)
    has_router = bool(running.route_pids)
    return Measured(results, wall, counter_delta(before, after), (cpu1 - cpu0) if has_router else None,
                    (rcpu1 - rcpu0) if has_router else None)


class Harness:
    """One benchmark run: settings, the rows gathered so far, raw samples for plots, notes."""

    def __init__(self, profile: Profile, flags: EngineFlags, out: Path, log_dir: Path, verbose: bool = True):
        self.profile = profile
        self.flags = flags
        self.sets = engine_sets(flags.time_scale, flags.seed)
        self.out = out
        self.log_dir = log_dir
        self.verbose = verbose
        self.rows: list[dict[str, object]] = []
        self.notes: list[str] = []
        self.ttft_a: dict[str, list[float]] = {}
        self.share_e: dict[str, list[float]] = {}
        self.router_only_cpu: dict[tuple[str, str], float] = {}
        self._specs: dict[str, list[RequestSpec]] = {}

    def log(self, msg: str) -> None:
        """Progress line on stderr (timestamped)."""
        if self.verbose:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def specs(self, workload: str) -> list[RequestSpec]:
        """The (cached) request list of ``workload`` — the same bytes for every system."""
        if workload not in self._specs:
            self._specs[workload] = WORKLOADS[workload].build(self.profile, MODEL)
        return self._specs[workload]

    def _failed_row(self, spec: SystemSpec, workload: str, workers: int, n: int) -> dict[str, object]:
        row = make_row(spec.kind, spec.policy, workload, workers, [], 0.0, None, None)
        row["requests"] = n
        row["errors"] = n
        return row

    def run_group(self, spec: SystemSpec, workloads: list[str], engine_set: str) -> None:
        """Start the ``engine_set`` engines + ``spec``, run ``workloads`` in order, stop everything."""
        if not workloads:
            return
        flags, slow = self.sets[engine_set]
        flags = with_load_format(flags, [spec])
        n = len(slow)
        tag = spec.label.replace("/", "-") + "-" + engine_set
        with ProcessSet(self.log_dir / tag) as procs:
            running = None
            try:
                self.log(f"{spec.label}: starting {n} engines ({engine_set} set)")
                engines = start_engines(procs, n, flags, slow, tag="engine")
                running = start_system(spec, procs, engines, self.log_dir / tag / "run")
                for _ in range(2 * n):  # warm-up: connections, first-request paths (not counted)
                    probe(running.base_url)
                for w in workloads:
                    self.run_workload(spec, w, running, engines.urls, procs)
            except BenchError as e:
                self.log(f"{spec.label}: FAILED: {e}")
                self.notes.append(f"{spec.label} ({engine_set} engine set): "
                                  f"{str(e).splitlines()[0]}")
                done = {(r["system"], r["policy"], r["workload"]) for r in self.rows}
                for w in workloads:
                    if (spec.kind, spec.policy, w) not in done:
                        self.rows.append(self._failed_row(spec, w, n, len(self.specs(w))))
            finally:
                if running is not None:
                    stop_system(running, procs)

    def run_workload(self, spec: SystemSpec, workload: str, running, engine_urls: list[str],  # type: ignore[no-untyped-def]
                     procs: ProcessSet) -> dict[str, object]:
        """Run one workload on a started system and append its row."""
        specs = self.specs(workload)
        if not wait_idle(engine_urls, 180):
            self.notes.append(f"{spec.label}/{workload}: engines still busy before the start")
        conc = self.profile.overhead_concurrency if WORKLOADS[workload].closed else None
        self.log(f"{spec.label}: {workload} ({len(specs)} requests)")
        m = measure(running, engine_urls, specs, conc)
        return self.record(spec, workload, m)

    def record(self, spec: SystemSpec, workload: str, m: Measured) -> dict[str, object]:
        """Turn a :class:`Measured` into a row (appended) and keep what the plots need."""
        deltas = m.deltas
        if spec.kind == "direct":  # one engine took everything; share over the others is meaningless
            deltas = deltas[:1]
        row = make_row(spec.kind, spec.policy, workload, len(deltas), m.results, m.wall, deltas, m.cpu)
        self.rows.append(row)
        if m.router_cpu is not None:
            self.router_only_cpu[(spec.label, workload)] = m.router_cpu * 1000.0 / max(1, len(m.results))
        if workload == "a_mooncake":
            self.ttft_a[spec.label] = [r.ttft for r in m.results if r.ok and r.ttft is not None]
        if workload == "e_burst":
            done = [d["vllm:request_success_total"] for d in deltas]
            tot = sum(done) or 1.0
            self.share_e[spec.label] = [x / tot for x in done]
        errs = [r.error for r in m.results if not r.ok]
        if errs:
            self.notes.append(f"{spec.label}/{workload}: {len(errs)} errors, first: {errs[0][:200]}")
        self.log(f"  -> {spec.label}/{workload}: ttft p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, "
                 f"e2e p50 {row['e2e_p50_ms']} ms, {row['output_tok_s']} tok/s, hit {row['prefix_hit_rate']}, "
                 f"share {row['max_share']}/{row['min_share']}, errors {row['errors']}")
        return row

    def run_overhead(self, systems: list[SystemSpec], workload: str = "f_overhead") -> None:
        """(f) for every system at once, interleaved, on one ``fast`` engine set.

        All systems are started side by side in front of the same fast engines (they add next to
        no time and tiny prompts leave no prefix state), then the requests go out in rounds: each
        round gives every system, in a shuffled order, the next batch of ``overhead_batch``
        requests at ``overhead_concurrency``. So a burst of background load on this shared
        machine hits every system alike instead of whichever ran at that moment. Routing CPU is
        summed over the system's own batches only.
        """
        flags, slow = self.sets["fast"]
        flags = with_load_format(flags, systems)
        specs = self.specs(workload)
        batch = max(1, min(self.profile.overhead_batch, len(specs)))
        chunks = [specs[i:i + batch] for i in range(0, len(specs), batch)]
        rng = random.Random(self.flags.seed)
        with ProcessSet(self.log_dir / workload) as procs:
            runnings = []
            try:
                self.log(f"{workload}: starting {len(slow)} fast engines and {len(systems)} systems side by side")
                engines = start_engines(procs, len(slow), flags, slow, tag="engine")
                for spec in systems:
                    try:
                        r = start_system(spec, procs, engines, self.log_dir / workload / "run")
                    except BenchError as e:
                        self.log(f"{spec.label}: FAILED: {e}")
                        self.notes.append(f"{spec.label} ({workload}): {str(e).splitlines()[0]}")
                        self.rows.append(self._failed_row(spec, workload, engines.n, len(specs)))
                        continue
                    runnings.append(r)
                    for _ in range(2 * engines.n):
                        probe(r.base_url)
                acc = {r.spec.label: Measured([], 0.0, [], 0.0 if r.route_pids else None,
                                              0.0 if r.router_pids else None) for r in runnings}
                for k, chunk in enumerate(chunks):
                    order = list(runnings)
                    rng.shuffle(order)
                    self.log(f"{workload}: round {k + 1}/{len(chunks)} ({len(chunk)} requests per system)")
                    for r in order:
                        acc[r.spec.label].add(measure(r, engines.urls, chunk, self.profile.overhead_concurrency))
                for r in runnings:
                    self.record(r.spec, workload, acc[r.spec.label])
            except BenchError as e:
                self.log(f"{workload}: FAILED: {e}")
                self.notes.append(f"{workload}: {str(e).splitlines()[0]}")
            finally:
                for r in runnings:
                    stop_system(r, procs)

    def run_scaling(self, policy: str) -> None:
        """DPLB ``policy`` on 1, 2, 4, 8 engines, closed loop with concurrency ∝ engines."""
        spec = SystemSpec("dplb", policy)
        for n in SCALING_SIZES:
            specs = scaling(self.profile, MODEL, n)
            tag = f"scaling-{policy}-{n}"
            with ProcessSet(self.log_dir / tag) as procs:
                running = None
                try:
                    self.log(f"scaling: dplb/{policy} on {n} engines ({len(specs)} requests)")
                    engines = start_engines(procs, n, self.flags, tag="engine")
                    running = start_system(spec, procs, engines, self.log_dir / tag / "run")
                    for _ in range(2 * n):
                        probe(running.base_url)
                    wait_idle(engines.urls, 60)
                    before = scrape(engines.urls)
                    cpu0 = cpu_seconds(running.route_pids)
                    results, wall = send(running.base_url, specs, self.profile.scaling_concurrency_per_engine * n)
                    wait_idle(engines.urls, 60)
                    deltas = counter_delta(before, scrape(engines.urls))
                    row = make_row("dplb", policy, "scaling", n, results, wall, deltas,
                                   cpu_seconds(running.route_pids) - cpu0)
                    self.rows.append(row)
                    self.log(f"  -> {row['output_tok_s']} tok/s, errors {row['errors']}")
                except BenchError as e:
                    self.log(f"scaling {n}: FAILED: {e}")
                    self.notes.append(f"scaling dplb/{policy} on {n} engines: {str(e).splitlines()[0]}")
                    self.rows.append(self._failed_row(spec, "scaling", n, len(specs)))
                finally:
                    if running is not None:
                        stop_system(running, procs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line flags of ``python -m bench.run``."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small request counts (make bench-quick, < 10 min)")
    ap.add_argument("--systems", default=None,
                    help="comma list of systems (dplb/dplb, sglang/cache_aware, vllm/power_of_two, direct, ...) or "
                         "'all'; default: all, or with --quick: " + ",".join(QUICK_SYSTEMS))
    ap.add_argument("--workloads", default="all", help=f"comma list of {', '.join(WORKLOADS)}")
    ap.add_argument("--no-scaling", action="store_true", help="skip the 1/2/4/8-engine scaling run")
    ap.add_argument("--scaling-policy", default="dplb,round_robin",
                    help="comma list of DPLB policies for the scaling run; the first is judged against the "
                         "goal, the others are for comparison (round_robin separates policy from machine)")
    ap.add_argument("--time-scale", type=float, default=TIME_SCALE, help="sim_engine --time-scale for every engine")
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
    chosen = args.systems or (",".join(QUICK_SYSTEMS) if args.quick else "all")
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
    profile = apply_overrides(replace(QUICK if args.quick else FULL, time_scale=args.time_scale), args.set)
    flags = EngineFlags(time_scale=args.time_scale, seed=args.seed)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    log_dir = args.out / "tmp" / run_id
    h = Harness(profile, flags, args.out, log_dir, verbose=not args.quiet)
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.monotonic()
    for w in workloads:  # build every request list first: a missing trace fails before anything starts
        h.specs(w)
    cmdline = " ".join(["python -m bench.run", *(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))])
    for spec in systems:  # each system alone on fresh engines; the direct run only takes part in (f)
        mine = [w for w in workloads if spec.kind != "direct" and WORKLOADS[w].engines != "fast"]
        for name in ("main", "hetero"):
            h.run_group(spec, [w for w in mine if WORKLOADS[w].engines == name], name)
    for w in (w for w in workloads if WORKLOADS[w].engines == "fast"):
        h.run_overhead(systems, w)
    if not args.no_scaling:
        for pol in (p.strip() for p in args.scaling_policy.split(",") if p.strip()):
            h.run_scaling(pol)
    elapsed = time.monotonic() - t0
    meta = {"command": cmdline, "elapsed_s": round(elapsed, 1), "profile": "quick" if args.quick else "full",
            "engine_flags": asdict(flags), "fast_time_scale": FAST_TIME_SCALE, "num_engines": NUM_ENGINES,
            "hetero_slowdown": HETERO_SLOWDOWN,
            "profile_values": asdict(profile), "run_id": run_id, "log_dir": str(log_dir),
            "load_start": load_start}
    report.write_all(args.out, h.rows, meta, h.notes, h.ttft_a, h.share_e, h.router_only_cpu)
    h.log(f"done in {elapsed:.0f} s; wrote {args.out}/latest.json, latest.md and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
