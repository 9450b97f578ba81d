"""Capacity planning: the highest arrival rate a policy serves within an SLO, and the fewest engines.

Goodput (DistServe, Zhong et al. OSDI'24; the figure used to rank policies from issue 12 on): the
highest request rate at which the SLO still holds. In an open-loop replay every policy that keeps up
serves the same tokens/s, so tokens/s alone cannot rank policies; goodput can.

* :func:`find_capacity`: the rate, as a multiple ``x`` of the trace's own rate (arrival times
  divided by ``x``), by bracketing (×2 / ÷2 from ``start``) then geometric bisection until
  ``hi / lo <= 1 + tolerance``. ``x`` passes when TTFT p99 ≤ ``slo.ttft_p99_s`` and (if given)
  TPOT p99 ≤ ``slo.tpot_p99_s``, with no request left unserved by an early stop. Requests/s =
  ``x`` × the trace's own rate (requests / span of the window's arrivals). A failing run stops as
  soon as the SLO is certainly missed (more than 1 % of the requests above the bound), so the
  overloaded probes are cheap.
* SLO attainment (``attainment=(slo, q)``, DistServe's goodput and ``vllm bench serve
  --goodput``'s): ``x`` passes when at least a share ``q`` of the window's requests meets the
  per-request SLO (:class:`simulate.settings.AttainmentSLO`; a rejected or unfinished request
  misses). A probe stops early once more than ``(1 − q)`` of the requests have certainly missed.
* :func:`rate_sweep`: every policy at one fixed grid of rates (``--rate-grid``), complete runs:
  the misses at each rate, their sum, and the *sustained* capacity at each Q, the highest grid
  rate at and below which every grid rate attains Q. Near capacity a bursty window's attainment
  is not monotone in the rate (a burst that lands in one engine's long prefill at one rate misses
  that engine at the next), so one bisection's answer depends on which rates it happened to
  probe; the summed misses over a band of rates ranks policies by the whole band instead.
* :func:`min_engines`: the fewest engines (copies of the configured engine list, cycled) whose run
  at the given rate meets the SLO: doubling, then integer bisection.

Monotone-safe: attainment and p99 are monotone in the rate only up to simulated noise near the
boundary, so the search keeps a bracket, ``lo`` (a probe that passed) below ``hi`` (one that
failed), and only ever probes inside it. The answer is therefore a rate that passed, with no
failing probe at or below it and a failing one within a factor ``1 + tolerance`` above it; on a
monotone figure it is within ``[x*/(1 + tolerance), x*]`` of the true threshold ``x*``. Every probe
is reported.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from dplb_trace.mooncake import TraceRequest
from sim_engine.config import EngineConfig
from simulate.settings import SLO, AttainmentSLO, Figures, SimSettings
from simulate.stats import attains, meets

RunFn = Callable[[SimSettings], Figures]


def trace_rate(reqs: Sequence[TraceRequest]) -> float | None:
    """The window's own arrival rate, requests per second (None for a single instant)."""
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0
    return len(reqs) / span if span > 0 else None


Attainment = tuple[AttainmentSLO, float]


def _probe_row(x: float, fig: Figures, ok: bool) -> Figures:
    att = fig.get("slo_attainment")
    return {"x": round(x, 6), "ok": ok, "ttft_p99_s": fig["ttft_s"]["p99"], "tpot_p99_s": fig["tpot_s"]["p99"],
            "attainment": None if att is None else att["attainment"], "aborted_early": fig["aborted_early"]}


def _judge(slo: SLO, attainment: Attainment | None) -> tuple[Callable[[Figures], bool], Figures]:
    """The pass rule of a probe and the settings that stop a failing probe early."""
    if attainment is None:
        return (lambda fig: meets(fig, slo.ttft_p99_s, slo.tpot_p99_s)), {"abort_on": slo, "abort_below": None}
    q = attainment[1]
    if not 0 < q <= 1:
        raise ValueError(f"attainment target must be in (0, 1] (got {q})")
    return (lambda fig: attains(fig, q)), {"abort_on": None, "abort_below": attainment}


def _slo_json(slo: SLO, attainment: Attainment | None) -> Figures:
    if attainment is None:
        return {"ttft_p99_s": slo.ttft_p99_s, "tpot_p99_s": slo.tpot_p99_s}
    return {"attainment": attainment[1], **attainment[0].as_dict()}


def find_capacity(run: RunFn, base: SimSettings, slo: SLO, rate: float | None, start: float = 1.0,
                  tolerance: float = 0.05, max_scale: float = 1024.0,
                  on_probe: Callable[[float, bool], None] | None = None,
                  known: dict[float, Figures] | None = None,
                  attainment: Attainment | None = None) -> Figures:
    """Highest rate multiple within ``slo`` (see the module docstring), or, with ``attainment =
    (slo, q)``, the highest at which a share ``q`` of the requests meets that per-request SLO
    (``slo`` is then ignored). ``run(settings)`` returns the figures of one run
    (:func:`simulate.stats.summarize`). Returns ``capacity_rate_scale`` (None when even
    ``1/max_scale`` fails), ``capacity_requests_per_s``, ``bound`` (``"found"``, ``"above"``: still
    passing at ``max_scale``, ``"below"``), ``slo``, ``tolerance``, ``probes`` and ``figures`` of the
    best passing run. ``known``: figures of complete runs already made, by rate multiple (not run
    again). Raises ValueError for ``tolerance <= 0`` or ``q`` outside (0, 1]."""
    if tolerance <= 0:
        raise ValueError("tolerance must be > 0")
    passes, abort = _judge(slo, attainment)
    probes: list[Figures] = []
    best: Figures | None = None
    cache: dict[float, bool] = {}

    def ok_at(x: float) -> bool:
        nonlocal best
        if x in cache:
            return cache[x]
        # a complete run at this rate (the table's) decides as well as an SLO-bounded one
        fig = (known or {}).get(x) or run(replace(base, rate_scale=x, **abort))
        ok = passes(fig)
        probes.append(_probe_row(x, fig, ok))
        if on_probe is not None:
            on_probe(x, ok)
        if ok and (best is None or x > best["_x"]):
            best = {**fig, "_x": x}
        cache[x] = ok
        return ok

    x = start
    if ok_at(x):
        lo, hi = x, None
        while lo < max_scale:
            x = min(lo * 2, max_scale)
            if ok_at(x):
                lo = x
            else:
                hi = x
                break
        bound = "above" if hi is None else "found"
    else:
        lo, hi = None, x
        while hi > 1.0 / max_scale:
            x = hi / 2
            if ok_at(x):
                lo = x
                break
            hi = x
        bound = "below" if lo is None else "found"
    if lo is not None and hi is not None:
        while hi / lo > 1 + tolerance:
            mid = math.sqrt(lo * hi)
            if ok_at(mid):
                lo = mid
            else:
                hi = mid
    figures = None
    if best is not None:
        figures = {k: v for k, v in best.items() if k not in ("_x", "load_over_time")}
    return {
        "capacity_rate_scale": None if lo is None else round(lo, 4),
        "capacity_requests_per_s": None if lo is None or rate is None else round(lo * rate, 4),
        "bound": bound,
        "slo": _slo_json(slo, attainment),
        "tolerance": tolerance,
        "trace_requests_per_s": None if rate is None else round(rate, 6),
        "probes": probes,
        "figures": figures,
    }


def rate_sweep(run: RunFn, base: SimSettings, factors: Sequence[float], rate: float | None,
               targets: Sequence[float], known: dict[float, Figures] | None = None) -> Figures:
    """Complete runs at rate multiples ``base.rate_scale × f`` for each ``f`` of ``factors`` (sorted
    ascending, duplicates dropped; each > 0), judged by each run's ``slo_attainment``.

    Returns ``points`` (per rate: ``x``, ``requests_per_s`` (None when ``rate`` is), ``attainment``,
    ``missed`` = requests − met, and ``missed_by`` cause), ``missed_total`` (Σ missed: the figure
    to rank policies by over the band), and ``sustained``: per Q of ``targets`` (key ``f"{q:g}"``),
    the highest ``x`` such that every grid point at or below it attains ``q`` (None when the lowest
    does not), with ``bound`` ``"above"`` when every point attains it. ``known``: figures of
    complete runs already made, by rate multiple. Raises ValueError on an empty grid, a factor
    that is not > 0, or a Q outside (0, 1]."""
    grid = sorted(set(factors))
    if not grid or grid[0] <= 0:
        raise ValueError(f"rate grid {list(factors)}: needs factors > 0")
    for q in targets:
        if not 0 < q <= 1:
            raise ValueError(f"attainment target must be in (0, 1] (got {q})")
    points: list[Figures] = []
    for f in grid:
        x = base.rate_scale * f
        fig = (known or {}).get(x) or run(replace(base, rate_scale=x, abort_on=None, abort_below=None))
        att = fig["slo_attainment"]
        points.append({"x": round(x, 6), "requests_per_s": None if rate is None else round(x * rate, 4),
                       "attainment": att["attainment"], "missed": att["requests"] - att["met"],
                       "missed_by": att.get("missed"), "_fig": fig})
    sustained: dict[str, Figures] = {}
    for q in targets:
        best: float | None = None
        bound = "above"
        for pt in points:
            if not attains(pt["_fig"], q):
                bound = "found" if best is not None else "below"
                break
            best = pt["x"]
        sustained[f"{q:g}"] = {"capacity_rate_scale": best, "bound": bound,
                               "capacity_requests_per_s": None if best is None or rate is None
                               else round(best * rate, 4)}
    for pt in points:
        del pt["_fig"]
    return {"factors": grid, "base_rate_scale": base.rate_scale, "points": points,
            "missed_total": sum(pt["missed"] for pt in points), "sustained": sustained}


def engines_of(base: Sequence[EngineConfig], n: int) -> list[EngineConfig]:
    """``n`` engines: the configured list cycled (so a heterogeneous pattern repeats)."""
    return [replace(base[k % len(base)]) for k in range(n)]


def min_engines(run: RunFn, base: SimSettings, slo: SLO, max_engines: int = 64,
                on_probe: Callable[[int, bool], None] | None = None,
                attainment: Attainment | None = None) -> Figures:
    """Fewest engines meeting ``slo`` (or, with ``attainment = (slo, q)``, that SLO-attainment
    target) at ``base.rate_scale`` (see the module docstring). Returns ``min_engines`` (None when
    ``max_engines`` do not suffice), ``slo`` and the probes."""
    passes, abort = _judge(slo, attainment)
    slo_json = _slo_json(slo, attainment)
    pattern = list(base.engines)
    probes: list[Figures] = []
    cache: dict[int, bool] = {}

    def ok_at(n: int) -> bool:
        if n in cache:
            return cache[n]
        fig = run(replace(base, engines=engines_of(pattern, n), **abort))
        ok = passes(fig)
        row = _probe_row(0.0, fig, ok)
        del row["x"]
        probes.append({"engines": n, **row})
        if on_probe is not None:
            on_probe(n, ok)
        cache[n] = ok
        return ok

    lo, hi = 0, 1       # lo fails (0 engines serve nothing), hi is the candidate
    while not ok_at(hi):
        lo = hi
        if hi >= max_engines:
            return {"min_engines": None, "max_engines": max_engines, "rate_scale": base.rate_scale,
                    "slo": slo_json, "probes": probes}
        hi = min(hi * 2, max_engines)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok_at(mid):
            hi = mid
        else:
            lo = mid
    return {"min_engines": hi, "max_engines": max_engines, "rate_scale": base.rate_scale,
            "slo": slo_json, "probes": probes}
