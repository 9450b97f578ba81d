"""The goodput search of :mod:`bench.run`: per workload of :data:`GOODPUT`, the highest rate
multiplier a system serves within the workload's SLO, each step on fresh engines and a fresh
system (:func:`run_goodput`), for DPLB and the peers that did best on the workload's repeats
(:func:`goodput_systems`).
"""
from __future__ import annotations

from dataclasses import replace

from bench.engines import start_engines
from bench.errors import BenchError
from bench.harness import Harness, measure, with_load_format
from bench.loadgen import RequestSpec
from bench.procs import ProcessSet
from bench.systems import MODEL, SystemSpec, probe, start_system, stop_system
from bench.workloads import WORKLOADS, mooncake

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


def goodput_specs(h: Harness, workload: str, mult: float) -> list[RequestSpec]:
    field_name = GOODPUT[workload][0]
    p = replace(h.profile, **{field_name: getattr(h.profile, field_name) * mult})
    if workload == "a_mooncake":  # a window of its own, after the repeats' windows
        return mooncake(p, MODEL, rep=h.repeats, n=h.profile.goodput_requests)
    return WORKLOADS[workload].build(p, MODEL, h.repeats)

def goodput_step(h: Harness, spec: SystemSpec, workload: str, mult: float) -> tuple[bool, dict[str, object]]:
    """One rate of the search on fresh engines and a fresh ``spec``: ``(meets the SLO, row)``."""
    engine_set = WORKLOADS[workload].engines
    flags, slow = h.sets[engine_set]
    flags = with_load_format(flags, [spec])
    specs = goodput_specs(h, workload, mult)
    tag = f"goodput-{spec.label.replace('/', '-')}-{workload}-{mult}"
    _, slo_ttft, slo_tpot, _, _ = GOODPUT[workload]
    with ProcessSet(h.log_dir / tag) as procs:
        running = None
        try:
            engines = start_engines(procs, len(slow), flags, slow, tag="engine")
            running = start_system(spec, procs, engines, h.log_dir / tag / "run")
            h.pin_system(running, engines)
            for _ in range(2 * engines.n):
                probe(running.base_url)
            m = measure(running, engines.urls, specs, None, WORKLOADS[workload].mode)
        finally:
            if running is not None:
                stop_system(running, procs)
    row = h.record(spec, workload, m, keep=False)
    ts = flags.time_scale
    ttft, tpot = row["ttft_p99_ms"], row["tpot_p99_ms"]
    ok = (row["errors"] == 0 and ttft is not None and tpot is not None
          and ttft * ts / 1000.0 <= slo_ttft and tpot * ts / 1000.0 <= slo_tpot)  # type: ignore[operator]
    h.log(f"  goodput {spec.label}/{workload} ×{mult}: ttft p99 {ttft} ms, tpot p99 {tpot} ms (wall, "
             f"time scale {ts}) -> {'meets' if ok else 'misses'} the SLO")
    return ok, row

def run_goodput(h: Harness, spec: SystemSpec, workload: str) -> dict[str, object]:
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
            ok, row = goodput_step(h, spec, workload, mult)
            steps.append([mult, ok, row["ttft_p99_ms"], row["tpot_p99_ms"]])
            if not ok:
                if k == 0:
                    for low in down:
                        ok, row = goodput_step(h, spec, workload, low)
                        steps.append([low, ok, row["ttft_p99_ms"], row["tpot_p99_ms"]])
                        if ok:
                            best, best_rate = low, row["req_s"]  # type: ignore[assignment]
                            break
                break
            best, best_rate = mult, row["req_s"]  # type: ignore[assignment]
    except BenchError as e:
        h.log(f"goodput {spec.label}/{workload}: FAILED: {e}")
        h.notes.append(f"goodput {spec.label}/{workload}: {str(e).splitlines()[0]}")
    out: dict[str, object] = {"system": spec.kind, "policy": spec.policy, "workload": workload,
                              "goodput_mult": best, "goodput_req_s": best_rate, "steps": steps}
    h.goodput.append(out)
    return out


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
