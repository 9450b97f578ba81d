"""The side-by-side harness of :mod:`bench.run`: the engine sets every system gets, one workload
sent and measured (client results, engine counters, routing CPU), and :class:`Harness`, which
starts engines and a system, runs the workloads with repeats, turns what it measured into rows
(:func:`bench.stats.make_row`) and stops everything it started; the overhead run (f) interleaved
across systems and the scaling run. The goodput search is :mod:`bench.goodput_search`.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from bench.engines import EngineFlags, counter_delta, scrape, start_engines, wait_idle
from bench.errors import BenchError
from bench.loadgen import RequestSpec, Result, run_closed, run_open, run_sessions
from bench.procs import CorePlan, ProcessSet, cpu_seconds, pin
from bench.stats import make_row
from bench.systems import MODEL, SystemSpec, probe, start_system, stop_system
from bench.workloads import WORKLOADS, Profile, scaling

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
