"""Row arithmetic of the harness: percentiles, shares, hit rate, CPU per 1k requests."""
from __future__ import annotations

import pytest

from bench.loadgen import Result
from bench.stats import ROW_KEYS, make_row, percentile, shares


def _ok(ttft: float, e2e: float, toks: int) -> Result:
    return Result(True, 200, 0.0, ttft, e2e, toks, None, "")


def _err() -> Result:
    return Result(False, 500, 0.0, None, None, 0, None, "", "HTTP 500")


@pytest.mark.parametrize("values,q,expected", [
    ([1.0], 99, 1.0),
    ([1.0, 2.0], 50, 1.5),
    ([0.0, 10.0, 20.0, 30.0, 40.0], 90, 36.0),
    ([5.0, 1.0, 3.0], 0, 1.0),
    ([5.0, 1.0, 3.0], 100, 5.0),
    ([], 50, None),
])
def test_percentile_linear_interpolation(values, q, expected):
    assert percentile(values, q) == expected


def test_percentile_rejects_out_of_range_q():
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_shares_of_finished_requests():
    assert shares([30, 10, 40, 20]) == (0.4, 0.1)
    assert shares([0, 0]) == (None, None)


def test_row_has_exact_keys_and_figures():
    results = [_ok(0.1, 1.0, 10), _ok(0.2, 2.0, 20), _ok(0.3, 3.0, 30), _err()]
    deltas = [
        {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 25.0,
         "vllm:request_success_total": 2.0, "vllm:generation_tokens_total": 30.0, "vllm:prompt_tokens_total": 1.0},
        {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 75.0,
         "vllm:request_success_total": 1.0, "vllm:generation_tokens_total": 30.0, "vllm:prompt_tokens_total": 1.0},
    ]
    row = make_row("dplb", "dplb", "b_shared_prefix", 2, results, 2.0, deltas, 0.5)
    assert tuple(row) == ROW_KEYS
    assert row["requests"] == 4 and row["errors"] == 1
    assert row["ttft_p50_ms"] == pytest.approx(200.0)
    assert row["e2e_p99_ms"] == pytest.approx(2980.0)
    assert row["output_tok_s"] == pytest.approx(30.0)   # 60 tokens / 2 s
    assert row["req_s"] == pytest.approx(1.5)
    assert row["prefix_hit_rate"] == pytest.approx(0.5)
    assert row["max_share"] == pytest.approx(0.6667, abs=1e-4)
    assert row["min_share"] == pytest.approx(0.3333, abs=1e-4)
    assert row["router_cpu_s_per_1k"] == pytest.approx(125.0)  # 0.5 s * 1000 / 4 requests


def test_row_without_router_or_counters():
    row = make_row("direct", "none", "f_overhead", 1, [_ok(0.01, 0.01, 1)], 1.0, None, None)
    assert row["router_cpu_s_per_1k"] is None
    assert row["prefix_hit_rate"] is None and row["max_share"] is None
