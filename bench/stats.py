"""Turning raw client results and engine counters into one table row.

Row keys (issue 7's, plus ``repeat`` and TPOT from issue 17): ``system, policy, workload, workers,
repeat, requests, errors, ttft_p50_ms, ttft_p90_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms,
e2e_p50_ms, e2e_p99_ms, output_tok_s, req_s, prefix_hit_rate, max_share, min_share,
router_cpu_s_per_1k``. One row is one run of one workload; :func:`summarize` folds the repeats.

Definitions:

- TPOT of one streamed request = (e2e − TTFT) / (output tokens − 1), over requests with at least
  two output tokens (the client-side time per output token after the first, vLLM's
  ``benchmark_serving`` definition);
- percentiles: linear interpolation between closest ranks (numpy's default, ``method="linear"``),
  over successful requests only;
- ``output_tok_s`` = successful output tokens / wall seconds (first send → last completion);
  ``req_s`` = successful requests / wall seconds;
- ``prefix_hit_rate`` = Σ Δ``vllm:prefix_cache_hits_total`` / Σ Δ``vllm:prefix_cache_queries_total``
  over all engines (tokens, vLLM's definition), ``None`` when no query was counted;
- ``max_share``/``min_share`` = largest/smallest fraction of Δ``vllm:request_success_total`` that one
  engine served (so the same counter decides the share for DPLB and for the peers);
- ``router_cpu_s_per_1k`` = Δ CPU seconds of the routing processes × 1000 / requests sent
  (``None`` for the direct run, which has no router).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bench.loadgen import Result
from dplb_trace.stats import percentile

ROW_KEYS = ("system", "policy", "workload", "workers", "repeat", "requests", "errors", "ttft_p50_ms",
            "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tok_s", "req_s", "prefix_hit_rate",
            "max_share", "min_share", "router_cpu_s_per_1k")
#: the figures :func:`summarize` folds over repeats
FIGURES = ("errors", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms",
           "e2e_p99_ms", "output_tok_s", "req_s", "prefix_hit_rate", "max_share", "min_share", "router_cpu_s_per_1k")


def shares(per_engine_done: Sequence[float]) -> tuple[float | None, float | None]:
    """(max, min) fraction of the finished requests one engine served; ``(None, None)`` if none."""
    total = sum(per_engine_done)
    if total <= 0:
        return None, None
    fr = [x / total for x in per_engine_done]
    return max(fr), min(fr)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


def make_row(system: str, policy: str, workload: str, workers: int, results: Sequence[Result], wall_s: float,
             engine_deltas: Sequence[dict[str, float]] | None, router_cpu_s: float | None,
             repeat: int = 0) -> dict[str, object]:
    """One table row (keys :data:`ROW_KEYS`, in that order) from a workload's raw figures.

    ``engine_deltas``: per-engine counter differences (:func:`bench.engines.counter_delta`), or
    ``None`` when unavailable; ``router_cpu_s``: CPU seconds the routing processes used during the
    workload, ``None`` when there is no router; ``repeat``: which run of the workload (0-based).
    """
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.e2e is not None and r.ttft is not None and r.output_tokens > 1]
    out_tok = sum(r.output_tokens for r in ok)
    n = len(results)
    hit_rate = max_share = min_share = None
    if engine_deltas:
        q = sum(d["vllm:prefix_cache_queries_total"] for d in engine_deltas)
        h = sum(d["vllm:prefix_cache_hits_total"] for d in engine_deltas)
        hit_rate = (h / q) if q > 0 else None
        max_share, min_share = shares([d["vllm:request_success_total"] for d in engine_deltas])
    row = {
        "system": system, "policy": policy, "workload": workload, "workers": workers, "repeat": repeat,
        "requests": n, "errors": n - len(ok),
        "ttft_p50_ms": _ms(percentile(ttft, 50)), "ttft_p90_ms": _ms(percentile(ttft, 90)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)), "tpot_p99_ms": _ms(percentile(tpot, 99)),
        "e2e_p50_ms": _ms(percentile(e2e, 50)), "e2e_p99_ms": _ms(percentile(e2e, 99)),
        "output_tok_s": _r(out_tok / wall_s if wall_s > 0 else None, 2),
        "req_s": _r(len(ok) / wall_s if wall_s > 0 else None, 3),
        "prefix_hit_rate": _r(hit_rate), "max_share": _r(max_share), "min_share": _r(min_share),
        "router_cpu_s_per_1k": _r(router_cpu_s * 1000.0 / n if (router_cpu_s is not None and n) else None, 3),
    }
    assert tuple(row) == ROW_KEYS
    return row


@dataclass(frozen=True)
class Spread:
    """A figure over the repeats of one workload: ``median``, ``lo`` (min) and ``hi`` (max), ``n``
    values. ``None`` fields when no repeat gave a value."""

    median: float | None
    lo: float | None
    hi: float | None
    n: int

    def overlaps(self, other: Spread) -> bool:
        """True when the two [min, max] ranges share a point (or either is empty): "no difference"."""
        if None in (self.lo, self.hi, other.lo, other.hi):
            return True
        return not (self.hi < other.lo or other.hi < self.lo)  # type: ignore[operator]


def spread(values: Sequence[float | None]) -> Spread:
    """Median and min–max of the non-``None`` ``values`` (the repeats of one figure)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return Spread(None, None, None, 0)
    return Spread(statistics.median(xs), xs[0], xs[-1], len(xs))


def ratio_interval(a: Spread, b: Spread) -> tuple[float | None, float | None, float | None]:
    """``a / b``: (ratio of medians, lowest ratio lo_a/hi_b, highest ratio hi_a/lo_b); ``None``s when
    a value is missing or a denominator is 0. Min–max of each side is the interval."""
    if None in (a.median, a.lo, a.hi, b.median, b.lo, b.hi) or not b.median or not b.lo or not b.hi:
        return None, None, None
    return a.median / b.median, a.lo / b.hi, a.hi / b.lo  # type: ignore[operator]


def summarize(rows: Sequence[dict[str, object]], keys: Sequence[str] = FIGURES) -> dict[tuple, dict[str, Spread]]:
    """Fold the repeats: ``{(system, policy, workload, workers): {figure: Spread}}`` over ``rows``.

    A repeat with errors still counts (its figures are over its successful requests); the
    ``errors`` figure is summed into the spread like any other so a failing repeat shows.
    """
    groups: dict[tuple, list[dict[str, object]]] = {}
    for r in rows:
        groups.setdefault((r["system"], r["policy"], r["workload"], r["workers"]), []).append(r)
    return {k: {f: spread([r.get(f) for r in g]) for f in keys} for k, g in groups.items()}  # type: ignore[misc]
