"""Figures of one simulated run (all times in seconds).

Definitions (the same as ``dplb-replay`` and ``bench/``, see :mod:`bench.stats`):

* percentiles: linear interpolation between closest ranks (numpy's default), over served requests;
* TTFT: arrival → first token; e2e: arrival → last token; TPOT: ``(e2e − TTFT) / (output tokens − 1)``
  for requests with at least 2 output tokens (vLLM's ``benchmark_serving``); queueing time: arrival →
  first scheduled by the engine (vLLM's ``request_queue_time``);
* ``output_tokens_per_s``: output tokens of served requests / (last completion − first arrival);
* ``prefix_hit_rate``: Σ prefix-cache hit tokens / Σ queried prompt tokens over all engines, counted
  at each request's first admission (vLLM's ``prefix_cache_hits`` / ``prefix_cache_queries``);
* ``preemptions``: Σ engine preemptions (by recompute);
* ``replicas``: the number of router replicas and their accounting error
  (:class:`simulate.replicas.AccountingError`: the requests each replica counts on each engine,
  its own plus the outside requests of its last scrape, against the requests there; 0 with one
  replica);
* per-engine share: served requests per engine / all served; ``max_min_ratio`` = max / min count
  (None when an engine served none);
* rejected: requests answered with an error, by HTTP status (400: longer than the context or the
  whole KV cache, as the engine answers; 503: no worker eligible);
* ``slo_attainment`` (:func:`slo_attainment`): the share of the window's requests that meet a
  per-request SLO (:class:`simulate.settings.AttainmentSLO`: TTFT ≤ base + per-1k × prompt tokens
  / 1000 and TPOT ≤ bound); the denominator is every request of the window, so a rejected request
  or one left unfinished by an early stop is a miss.
"""
from __future__ import annotations

from typing import cast

from dplb_trace.stats import percentile
from simulate.settings import OK, AttainmentSLO, Figures, RunResult


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def _pcts(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    return {f"p{q}": _r(percentile(values, q)) for q in qs}


def slo_attainment(res: RunResult, slo: AttainmentSLO) -> Figures:
    """The share of ``res``'s requests meeting ``slo`` (see :class:`~simulate.settings.AttainmentSLO`).

    Returns ``attainment`` (met / requests, rounded to 6 decimals), ``met``, ``requests`` and the
    misses by first cause:
    ``not_served`` (rejected or unfinished), ``ttft`` (served, TTFT over its bound), ``tpot``
    (TTFT within, TPOT over), plus ``slo`` and ``aborted_early`` (then the unfinished requests
    count as misses, so the share is a lower bound). ``misses``: one row per missed request, in
    window order: ``index`` (position in the window), ``cause`` (as above), ``worker``,
    ``prompt_tokens``, ``cached_tokens`` (its prefix-cache hit), ``output_tokens``, ``ttft_s`` and
    ``tpot_s`` (None where not measured) and ``ttft_limit_s``."""
    n = len(res.status)
    met = 0
    causes = {"not_served": 0, "ttft": 0, "tpot": 0}
    misses: list[Figures] = []
    for i, st in enumerate(res.status):
        ft, total, n_out = res.ttft[i], res.e2e[i], res.output_tokens[i]
        limit = slo.ttft_limit_s(res.prompt_tokens[i])
        tpot = (total - ft) / (n_out - 1) if ft is not None and total is not None and n_out > 1 else None
        if st != OK or ft is None or total is None:
            cause = "not_served"
        elif ft > limit:
            cause = "ttft"
        elif slo.tpot_s is not None and tpot is not None and tpot > slo.tpot_s:
            cause = "tpot"
        else:
            met += 1
            continue
        causes[cause] += 1
        misses.append({"index": i, "cause": cause, "worker": res.worker[i],
                       "prompt_tokens": res.prompt_tokens[i], "cached_tokens": res.cached_tokens[i],
                       "output_tokens": n_out, "ttft_s": _r(ft), "tpot_s": _r(tpot),
                       "ttft_limit_s": _r(limit)})
    return {"attainment": round(met / n, 6), "met": met, "requests": n, "missed": causes,
            "misses": misses, "slo": slo.as_dict(), "aborted_early": res.aborted}


def attains(fig: Figures, q: float) -> bool:
    """True when a run's ``slo_attainment`` share is at least ``q`` (an early-stopped run fails)."""
    att = fig.get("slo_attainment")
    if att is None or fig.get("aborted_early"):
        return False
    return bool(att["met"] / att["requests"] >= q)


def summarize(res: RunResult, n_engines: int, slo: AttainmentSLO | None = None) -> Figures:
    """The figures of ``res`` as a JSON-ready dict (see the module docstring for each one);
    ``slo``: the per-request SLO of the ``slo_attainment`` figure (default: the judging SLO's
    defaults, :class:`~simulate.settings.AttainmentSLO`)."""
    served = [i for i, s in enumerate(res.status) if s == OK]
    # a served request has all three times
    ttft = cast(list[float], [res.ttft[i] for i in served])
    e2e = cast(list[float], [res.e2e[i] for i in served])
    queue = cast(list[float], [res.queue[i] for i in served])
    tpot = [(e2e[j] - ttft[j]) / (res.output_tokens[i] - 1) for j, i in enumerate(served)
            if res.output_tokens[i] > 1]
    rejected: dict[str, int] = {}
    for s in res.status:
        if s not in (OK, 0):
            rejected[str(s)] = rejected.get(str(s), 0) + 1
    out_tokens = sum(res.output_tokens[i] for i in served)
    if served:
        t_end = max(res.arrival[i] + e2e[j] for j, i in enumerate(served))
        span = t_end - res.arrival[0]
    else:
        span = 0.0
    hits = sum(s["prefix_cache_hits"] for s in res.engine_stats)
    queries = sum(s["prefix_cache_queries"] for s in res.engine_stats)
    counts = [0] * n_engines
    for i in served:
        counts[res.worker[i]] += 1
    total = sum(counts)
    shares = [round(c / total, 4) for c in counts] if total else []
    return {
        "requests": len(res.status),
        "served": len(served),
        "rejected": sum(rejected.values()),
        "rejected_by_status": dict(sorted(rejected.items())),
        "aborted_early": res.aborted,
        "ttft_s": {**_pcts(ttft, (50, 90, 99)), "mean": _r(sum(ttft) / len(ttft)) if ttft else None},
        "tpot_s": _pcts(tpot, (50, 99)),
        "e2e_s": _pcts(e2e, (50, 99)),
        "queue_s": {**_pcts(queue, (50, 99)), "mean": _r(sum(queue) / len(queue)) if queue else None},
        "output_tokens": out_tokens,
        "duration_s": _r(span),
        "output_tokens_per_s": _r(out_tokens / span, 3) if span > 0 else None,
        "requests_per_s": _r(len(served) / span, 4) if span > 0 else None,
        "prefix_hit_rate": _r(hits / queries, 4) if queries else None,
        "preemptions": sum(s["preemptions"] for s in res.engine_stats),
        "slo_attainment": slo_attainment(res, slo if slo is not None else AttainmentSLO()),
        "per_engine": {
            "requests": counts,
            "share": shares if total else [None] * n_engines,
            "max_share": max(shares) if shares else None,
            "min_share": min(shares) if shares else None,
            "max_min_ratio": _r(max(counts) / min(counts), 4) if total and min(counts) > 0 else None,
            "busy_s": [_r(s["busy_time_s"], 3) for s in res.engine_stats],
            "preemptions": [s["preemptions"] for s in res.engine_stats],
            "prefix_hit_rate": [_r(s["prefix_cache_hits"] / s["prefix_cache_queries"], 4)
                                if s["prefix_cache_queries"] else None for s in res.engine_stats],
        },
        "replicas": res.replicas,
        "load_over_time": {"t_s": res.load["t"], "queue": res.load["queue"], "running": res.load["running"],
                           "kv_cache_usage": res.load["kv"]},
    }


def meets(fig: Figures, ttft_p99_s: float | None, tpot_p99_s: float | None) -> bool:
    """True when the run served something and its TTFT/TPOT p99 are within the given bounds.

    Requests the admission queue shed (HTTP 429) count as an infinite TTFT: the run fails the
    TTFT bound once they are enough to put the p99 over any bound (``shed >= n - floor((n-1)·0.99)``
    over served + shed, linear interpolation as in the percentiles), so shedding cannot pass an
    overloaded run."""
    if fig.get("aborted_early") or not fig["served"]:
        return False
    shed = fig.get("rejected_by_status", {}).get("429", 0)
    if ttft_p99_s is not None and shed:
        n = fig["served"] + shed
        if shed >= n - int((n - 1) * 0.99):
            return False
    if ttft_p99_s is not None:
        v = fig["ttft_s"]["p99"]
        if v is None or v > ttft_p99_s:
            return False
    if tpot_p99_s is not None:
        v = fig["tpot_s"]["p99"]
        if v is not None and v > tpot_p99_s:
            return False
    return True
