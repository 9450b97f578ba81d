"""``python -m bench.run [--quick]``: DPLB's policies and the field's routers, side by side.

For each system (:func:`bench.systems.all_systems`) the harness starts fresh sim engines with the
same flags for everyone, starts the system in front of them, waits until a request gets through,
runs the workloads of :mod:`bench.workloads` one after another, ``--repeats`` times (3: each
repeat has its own seed, for the trace its own window; waiting for idle engines in between),
reads the engines' counters and the routing processes' CPU time around each run, and stops
everything it started. (a) and (s) run on the ``trace`` engine set, (d) on a set with one engine
at ``--slowdown 3``. Then the goodput search on (a) and (b) (:meth:`Harness.run_goodput`: fresh
engines and system per step, the highest rate multiplier that meets the SLO), the overhead run
(f), and the scaling run on 1, 2, 4, 8 engines, all with repeats.

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
from bench.loadgen import RequestSpec, Result, run_closed, run_open, run_sessions
from bench.procs import CorePlan, ProcessSet, core_plan, cpu_seconds, pin
from bench.stats import make_row
from bench.systems import (
    MODEL,
    SystemSpec,
    all_systems,
    probe,
    start_system,
    stop_system,
)
from bench.workloads import FULL, QUICK, WORKLOADS, Profile, mooncake, scaling

RESULTS = Path(__file__).resolve().parent / "results"
#: simulated seconds per wall second given to every engine (``sim_engine --time-scale``) of the
#: ``main`` and ``hetero`` sets. Below 1, the simulated GPU runs slower than real time, so the
#: engines are the bottleneck while the token rate stays within what 2 CPU cores can stream.
TIME_SCALE = 0.5
#: ``--time-scale`` of the ``fast`` set used by (f): a 5 ms step takes 0.05 ms of wall time, so
#: the engine adds next to nothing and the router's own added latency shows.
FAST_TIME_SCALE = 100.0
#: ``--time-scale`` of the ``trace`` and ``sessions`` sets that (a) and (s) run on: the 500-request
#: window takes about 40 s of wall time at load 1.0 instead of 300 s at 0.5. Measured at 3.0: the
#: two cores stayed about 60 % idle (pinned as below), so the engines, not the CPU, set the pace.
TRACE_TIME_SCALE = 4.0
NUM_ENGINES = 4
HETERO_SLOWDOWN = 3.0
#: every workload runs this many times per system (``--repeats``)
REPEATS = 3


def engine_sets(time_scale: float, seed: int, n: int = NUM_ENGINES,
                trace_time_scale: float = TRACE_TIME_SCALE) -> dict[str, tuple[EngineFlags, tuple[float, ...]]]:
    """The engine sets by name: ``(flags, per-engine slowdowns)``; every system gets the same."""
    flags = EngineFlags(time_scale=time_scale, seed=seed)
    return {"main": (flags, tuple([1.0] * n)),
            "trace": (EngineFlags(time_scale=trace_time_scale, seed=seed), tuple([1.0] * n)),
            # (s) on engines of its own, so that it does not start on caches (a) warmed with the same window
            "sessions": (EngineFlags(time_scale=trace_time_scale, seed=seed), tuple([1.0] * n)),
            "hetero": (flags, tuple([1.0] * (n - 1) + [HETERO_SLOWDOWN])),
            "fast": (EngineFlags(time_scale=FAST_TIME_SCALE, seed=seed), tuple([1.0] * n))}
SCALING_SIZES = (1, 2, 4, 8)
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
#: the goodput search runs for ``dplb/dplb`` and this many peers: those with the lowest median
#: TTFT p99 on the workload's repeats (the search is the costliest part of the run)
GOODPUT_PEERS = 2
#: workloads with a goodput search: (Profile field scaled, SLO TTFT p99 and TPOT p99 in
#: *simulated* seconds, rate multipliers climbed while the SLO holds, multipliers tried downwards
#: when the first one misses). (a): a 10 s TTFT p99 as in ``dplb-simulate --find-capacity`` and a
#: 0.5 s TPOT p99 (the repeats at load 1 measured 0.27-0.53 s: a target near the trace's own
#: rate, where a router's choices show); (b): an interactive target of 0.25 s TTFT p99 (its repeats
#: at 8 req/s: 0.08 s; 0.2-0.3 s at 6-8×), ladder from 2× (its own rate is light).
GOODPUT: dict[str, tuple[str, float, float, tuple[float, ...], tuple[float, ...]]] = {
    "a_mooncake": ("mooncake_load", 10.0, 0.5, (1.0, 1.5, 2.0, 3.0), (0.75, 0.5)),
    "b_shared_prefix": ("gsp_rate", 0.25, 0.5, (2.0, 4.0, 6.0, 8.0, 10.0), (1.0, 0.5)),
}


def _run_async(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    except ImportError:
        return asyncio.run(coro)


def send(base_url: str, specs: list[RequestSpec], closed_concurrency: int | None,
         mode: str = "open") -> tuple[list[Result], float]:
    """Run one workload's requests against ``base_url``; ``(results, wall seconds)``.

    ``closed_concurrency`` set: closed loop; else ``mode`` ``sessions`` (conversations with think
    times) or ``open`` (each spec at its offset).
    """
    if closed_concurrency:
        return _run_async(run_closed(base_url, specs, closed_concurrency))
    if mode == "sessions":
        return _run_async(run_sessions(base_url, specs))
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
            closed_concurrency: int | None, mode: str = "open") -> Measured:
    """Send ``specs`` through ``running``; engine counters and routing CPU read around it."""
    before = scrape(engine_urls)
    cpu0, rcpu0 = cpu_seconds(running.route_pids), cpu_seconds(running.router_pids)
    results, wall = send(running.base_url, specs, closed_concurrency, mode)
    wait_idle(engine_urls, 60)
    cpu1, rcpu1 = cpu_seconds(running.route_pids), cpu_seconds(running.router_pids)
    after = scrape(engine_urls)
    has_router = bool(running.route_pids)
    return Measured(results, wall, counter_delta(before, after), (cpu1 - cpu0) if has_router else None,
                    (rcpu1 - rcpu0) if has_router else None)


class Harness:
    """One benchmark run: settings, the rows gathered so far, raw samples for plots, notes."""

    def __init__(self, profile: Profile, flags: EngineFlags, out: Path, log_dir: Path, verbose: bool = True,
                 repeats: int = 1, cores: CorePlan | None = None):
        self.profile = profile
        self.flags = flags
        self.repeats = max(1, repeats)
        self.cores = cores or CorePlan(frozenset(), frozenset())
        self.sets = engine_sets(flags.time_scale, flags.seed, trace_time_scale=profile.trace_time_scale)
        self.out = out
        self.log_dir = log_dir
        self.verbose = verbose
        self.rows: list[dict[str, object]] = []
        self.notes: list[str] = []
        self.ttft_a: dict[str, list[float]] = {}
        self.share_e: dict[str, list[float]] = {}
        self.router_only_cpu: dict[tuple[str, str], list[float]] = {}
        self.goodput: list[dict[str, object]] = []
        self.chunks_per_cpu: dict[str, list[float]] = {}
        self._specs: dict[tuple[str, int], list[RequestSpec]] = {}

    def log(self, msg: str) -> None:
        """Progress line on stderr (timestamped)."""
        if self.verbose:
            print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    def specs(self, workload: str, rep: int = 0) -> list[RequestSpec]:
        """The (cached) request list of ``workload``'s repeat ``rep`` — the same bytes for every system."""
        if (workload, rep) not in self._specs:
            self._specs[(workload, rep)] = WORKLOADS[workload].build(self.profile, MODEL, rep)
        return self._specs[(workload, rep)]

    def pin_system(self, running, engines) -> None:  # type: ignore[no-untyped-def]
        """Pin ``running``'s routing processes and ``engines`` per :attr:`cores` (no-op when off)."""
        if not self.cores.active:
            return
        pin(running.route_pids, self.cores.router)
        pin([c.pid for c in engines.children], self.cores.rest)

    def _failed_row(self, spec: SystemSpec, workload: str, workers: int, n: int, rep: int = 0) -> dict[str, object]:
        row = make_row(spec.kind, spec.policy, workload, workers, [], 0.0, None, None, rep)
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
                self.pin_system(running, engines)
                for _ in range(2 * n):  # warm-up: connections, first-request paths (not counted)
                    probe(running.base_url)
                for rep in range(self.repeats):
                    for w in workloads:
                        self.run_workload(spec, w, running, engines.urls, procs, rep)
            except BenchError as e:
                self.log(f"{spec.label}: FAILED: {e}")
                self.notes.append(f"{spec.label} ({engine_set} engine set): "
                                  f"{str(e).splitlines()[0]}")
                done = {(r["system"], r["policy"], r["workload"], r["repeat"]) for r in self.rows}
                for rep in range(self.repeats):
                    for w in workloads:
                        if (spec.kind, spec.policy, w, rep) not in done:
                            self.rows.append(self._failed_row(spec, w, n, len(self.specs(w, rep)), rep))
            finally:
                if running is not None:
                    stop_system(running, procs)

    def run_workload(self, spec: SystemSpec, workload: str, running, engine_urls: list[str],  # type: ignore[no-untyped-def]
                     procs: ProcessSet, rep: int = 0) -> dict[str, object]:
        """Run repeat ``rep`` of one workload on a started system and append its row."""
        specs = self.specs(workload, rep)
        if not wait_idle(engine_urls, 180):
            self.notes.append(f"{spec.label}/{workload}: engines still busy before the start")
        wl = WORKLOADS[workload]
        conc = self.profile.overhead_concurrency if wl.closed else None
        self.log(f"{spec.label}: {workload} repeat {rep + 1}/{self.repeats} ({len(specs)} requests)")
        m = measure(running, engine_urls, specs, conc, wl.mode)
        return self.record(spec, workload, m, rep)

    def record(self, spec: SystemSpec, workload: str, m: Measured, rep: int = 0,
               keep: bool = True) -> dict[str, object]:
        """Turn a :class:`Measured` into a row (appended when ``keep``) and keep what the plots need."""
        deltas = m.deltas
        if spec.kind == "direct":  # one engine took everything; share over the others is meaningless
            deltas = deltas[:1]
        row = make_row(spec.kind, spec.policy, workload, len(deltas), m.results, m.wall, deltas, m.cpu, rep)
        if not keep:
            return row
        self.rows.append(row)
        if m.router_cpu is not None:
            self.router_only_cpu.setdefault((spec.label, workload), []).append(
                m.router_cpu * 1000.0 / max(1, len(m.results)))
            if WORKLOADS[workload].engines in ("trace", "sessions") and m.router_cpu > 0:
                toks = sum(r.output_tokens for r in m.results if r.ok)
                self.chunks_per_cpu.setdefault(f"{spec.label}|{workload}", []).append(toks / m.router_cpu)
        if workload == "a_mooncake":
            self.ttft_a.setdefault(spec.label, []).extend(r.ttft for r in m.results if r.ok and r.ttft is not None)
        if workload == "e_burst" and rep == 0:
            done = [d["vllm:request_success_total"] for d in deltas]
            tot = sum(done) or 1.0
            self.share_e[spec.label] = [x / tot for x in done]
        errs = [r.error for r in m.results if not r.ok]
        if errs:
            self.notes.append(f"{spec.label}/{workload}: {len(errs)} errors, first: {errs[0][:200]}")
        self.log(f"  -> {spec.label}/{workload}#{rep}: ttft p50/p99 {row['ttft_p50_ms']}/{row['ttft_p99_ms']} ms, "
                 f"tpot p99 {row['tpot_p99_ms']} ms, "
                 f"e2e p50 {row['e2e_p50_ms']} ms, {row['output_tok_s']} tok/s, hit {row['prefix_hit_rate']}, "
                 f"share {row['max_share']}/{row['min_share']}, errors {row['errors']}")
        return row

    def run_overhead(self, systems: list[SystemSpec], workload: str = "f_overhead") -> None:
        """(f) for every system at once, interleaved, on one ``fast`` engine set, ``repeats`` times.

        All systems are started side by side in front of the same fast engines (they add next to
        no time and tiny prompts leave no prefix state), then the requests go out in rounds: each
        round gives every system, in a shuffled order, the next batch of ``overhead_batch``
        requests at ``overhead_concurrency``. So a burst of background load on this shared
        machine hits every system alike instead of whichever ran at that moment. Routing CPU is
        summed over the system's own batches only. Each repeat (its own requests and shuffle
        seed) gives one row per system.
        """
        flags, slow = self.sets["fast"]
        flags = with_load_format(flags, systems)
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
                        for rep in range(self.repeats):
                            self.rows.append(self._failed_row(spec, workload, engines.n,
                                                              len(self.specs(workload, rep)), rep))
                        continue
                    runnings.append(r)
                    self.pin_system(r, engines)
                    for _ in range(2 * engines.n):
                        probe(r.base_url)
                for rep in range(self.repeats):
                    specs = self.specs(workload, rep)
                    batch = max(1, min(self.profile.overhead_batch, len(specs)))
                    chunks = [specs[i:i + batch] for i in range(0, len(specs), batch)]
                    rng = random.Random(self.flags.seed * 1000 + rep)
                    acc = {r.spec.label: Measured([], 0.0, [], 0.0 if r.route_pids else None,
                                                  0.0 if r.router_pids else None) for r in runnings}
                    for k, chunk in enumerate(chunks):
                        order = list(runnings)
                        rng.shuffle(order)
                        self.log(f"{workload} repeat {rep + 1}/{self.repeats}: round {k + 1}/{len(chunks)} "
                                 f"({len(chunk)} requests per system)")
                        for r in order:
                            acc[r.spec.label].add(measure(r, engines.urls, chunk, self.profile.overhead_concurrency))
                    for r in runnings:
                        self.record(r.spec, workload, acc[r.spec.label], rep)
            except BenchError as e:
                self.log(f"{workload}: FAILED: {e}")
                self.notes.append(f"{workload}: {str(e).splitlines()[0]}")
            finally:
                for r in runnings:
                    stop_system(r, procs)

    def _goodput_specs(self, workload: str, mult: float) -> list[RequestSpec]:
        field_name = GOODPUT[workload][0]
        p = replace(self.profile, **{field_name: getattr(self.profile, field_name) * mult})
        if workload == "a_mooncake":  # a window of its own, after the repeats' windows
            return mooncake(p, MODEL, rep=self.repeats, n=self.profile.goodput_requests)
        return WORKLOADS[workload].build(p, MODEL, self.repeats)

    def _goodput_step(self, spec: SystemSpec, workload: str, mult: float) -> tuple[bool, dict[str, object]]:
        """One rate of the search on fresh engines and a fresh ``spec``: ``(meets the SLO, row)``."""
        engine_set = WORKLOADS[workload].engines
        flags, slow = self.sets[engine_set]
        flags = with_load_format(flags, [spec])
        specs = self._goodput_specs(workload, mult)
        tag = f"goodput-{spec.label.replace('/', '-')}-{workload}-{mult}"
        _, slo_ttft, slo_tpot, _, _ = GOODPUT[workload]
        with ProcessSet(self.log_dir / tag) as procs:
            running = None
            try:
                engines = start_engines(procs, len(slow), flags, slow, tag="engine")
                running = start_system(spec, procs, engines, self.log_dir / tag / "run")
                self.pin_system(running, engines)
                for _ in range(2 * engines.n):
                    probe(running.base_url)
                m = measure(running, engines.urls, specs, None, WORKLOADS[workload].mode)
            finally:
                if running is not None:
                    stop_system(running, procs)
        row = self.record(spec, workload, m, keep=False)
        ts = flags.time_scale
        ttft, tpot = row["ttft_p99_ms"], row["tpot_p99_ms"]
        ok = (row["errors"] == 0 and ttft is not None and tpot is not None
              and ttft * ts / 1000.0 <= slo_ttft and tpot * ts / 1000.0 <= slo_tpot)  # type: ignore[operator]
        self.log(f"  goodput {spec.label}/{workload} ×{mult}: ttft p99 {ttft} ms, tpot p99 {tpot} ms (wall, "
                 f"time scale {ts}) -> {'meets' if ok else 'misses'} the SLO")
        return ok, row

    def run_goodput(self, spec: SystemSpec, workload: str) -> dict[str, object]:
        """The highest rate multiplier of ``workload`` that ``spec`` serves within its SLO.

        Climbs the workload's ladder (:data:`GOODPUT`) while the SLO holds and stops at the first
        miss, or walks its downward ladder when the first step misses. Each step runs on
        fresh engines and a fresh system (no prefix cache carried from the step before). The SLO
        (:data:`GOODPUT`): no error, TTFT p99 and TPOT p99 under the targets in simulated seconds
        (wall × the engines' time scale). Returns (and records) ``{system, policy, workload,
        goodput_mult, goodput_req_s, steps: [[mult, ok, ttft_p99_ms, tpot_p99_ms], ...]}``, with
        ``goodput_mult`` 0 when no step meets the SLO.
        """
        steps: list[list[object]] = []
        best: float = 0.0
        best_rate: float | None = None
        _, _, _, ladder, down = GOODPUT[workload]
        try:
            for k, mult in enumerate(ladder):
                ok, row = self._goodput_step(spec, workload, mult)
                steps.append([mult, ok, row["ttft_p99_ms"], row["tpot_p99_ms"]])
                if not ok:
                    if k == 0:
                        for low in down:
                            ok, row = self._goodput_step(spec, workload, low)
                            steps.append([low, ok, row["ttft_p99_ms"], row["tpot_p99_ms"]])
                            if ok:
                                best, best_rate = low, row["req_s"]  # type: ignore[assignment]
                                break
                    break
                best, best_rate = mult, row["req_s"]  # type: ignore[assignment]
        except BenchError as e:
            self.log(f"goodput {spec.label}/{workload}: FAILED: {e}")
            self.notes.append(f"goodput {spec.label}/{workload}: {str(e).splitlines()[0]}")
        out: dict[str, object] = {"system": spec.kind, "policy": spec.policy, "workload": workload,
                                  "goodput_mult": best, "goodput_req_s": best_rate, "steps": steps}
        self.goodput.append(out)
        return out

    def run_scaling(self, policy: str) -> None:
        """DPLB ``policy`` on 1, 2, 4, 8 engines, closed loop with concurrency ∝ engines, ``repeats`` times."""
        spec = SystemSpec("dplb", policy)
        for n in SCALING_SIZES:
            tag = f"scaling-{policy}-{n}"
            with ProcessSet(self.log_dir / tag) as procs:
                running = None
                rep = 0
                try:
                    engines = start_engines(procs, n, self.flags, tag="engine")
                    running = start_system(spec, procs, engines, self.log_dir / tag / "run")
                    self.pin_system(running, engines)
                    for _ in range(2 * n):
                        probe(running.base_url)
                    for rep in range(self.repeats):
                        specs = scaling(self.profile, MODEL, n, rep)
                        self.log(f"scaling: dplb/{policy} on {n} engines, repeat {rep + 1}/{self.repeats} "
                                 f"({len(specs)} requests)")
                        wait_idle(engines.urls, 60)
                        before = scrape(engines.urls)
                        cpu0 = cpu_seconds(running.route_pids)
                        results, wall = send(running.base_url, specs, self.profile.scaling_concurrency_per_engine * n)
                        wait_idle(engines.urls, 60)
                        deltas = counter_delta(before, scrape(engines.urls))
                        row = make_row("dplb", policy, "scaling", n, results, wall, deltas,
                                       cpu_seconds(running.route_pids) - cpu0, rep)
                        self.rows.append(row)
                        self.log(f"  -> {row['output_tok_s']} tok/s, errors {row['errors']}")
                except BenchError as e:
                    self.log(f"scaling {n}: FAILED: {e}")
                    self.notes.append(f"scaling dplb/{policy} on {n} engines: {str(e).splitlines()[0]}")
                    for r in range(rep, self.repeats):
                        self.rows.append(self._failed_row(spec, "scaling", n,
                                                          self.profile.scaling_requests_per_engine * n, r))
                finally:
                    if running is not None:
                        stop_system(running, procs)


def goodput_systems(systems: list[SystemSpec], rows: list[dict[str, object]], workload: str,
                    skip: dict[str, str]) -> list[SystemSpec]:
    """Who gets the goodput search on ``workload``: every DPLB system not in ``skip`` and the
    :data:`GOODPUT_PEERS` peers with the lowest median TTFT p99 on ``workload``'s repeats (error-free
    systems first); all peers when none has rows yet."""
    from bench.stats import spread

    dplb = [s for s in systems if s.kind == "dplb" and s.label not in skip]
    peers = [s for s in systems if s.kind not in ("dplb", "direct")]

    def rank(s: SystemSpec) -> tuple[bool, float]:
        mine = [r for r in rows if (r["system"], r["policy"], r["workload"]) == (s.kind, s.policy, workload)]
        med = spread([r["ttft_p99_ms"] for r in mine]).median  # type: ignore[misc]
        errs = any(r["errors"] for r in mine)
        return (errs or med is None, float("inf") if med is None else float(med))

    if any(rank(s)[1] != float("inf") for s in peers):
        peers = sorted(peers, key=rank)[:GOODPUT_PEERS]
    return dplb + peers


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
                h.run_goodput(spec, w)
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
                h.run_goodput(spec, w)
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
