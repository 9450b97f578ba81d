"""bench.ttft_check's arithmetic: histogram deltas and Prometheus-style bucket quantiles."""
from __future__ import annotations

from bench.ttft_check import bucket_quantile, compare, delta, ttft_histogram

PAGE = """# TYPE dplb_router_time_to_first_token_seconds histogram
dplb_router_time_to_first_token_seconds_bucket{le="0.1",route="/v1/chat/completions"} 2.0
dplb_router_time_to_first_token_seconds_bucket{le="0.5",route="/v1/chat/completions"} 6.0
dplb_router_time_to_first_token_seconds_bucket{le="1.0",route="/v1/chat/completions"} 10.0
dplb_router_time_to_first_token_seconds_bucket{le="+Inf",route="/v1/chat/completions"} 10.0
dplb_router_time_to_first_token_seconds_count{route="/v1/chat/completions"} 10.0
dplb_router_time_to_first_token_seconds_sum{route="/v1/chat/completions"} 4.0
dplb_router_time_to_first_token_seconds_count{route="/v1/completions"} 99.0
"""


def test_histogram_delta_and_quantiles():
    h = ttft_histogram(PAGE)
    assert h["count"] == 10 and h["sum"] == 4.0 and h["buckets"][-1] == (float("inf"), 10.0)
    d = delta(h, {"count": 2, "sum": 0.1, "buckets": [(0.1, 2.0), (0.5, 2.0), (1.0, 2.0), (float("inf"), 2.0)]})
    assert d["count"] == 8 and abs(d["sum"] - 3.9) < 1e-9
    # 8 new requests: 0 below 0.1 s, 4 in (0.1, 0.5], 4 in (0.5, 1.0]; the median sits at 0.5 s
    assert abs(bucket_quantile(0.5, d["buckets"]) - 0.5) < 1e-9
    assert abs(bucket_quantile(0.25, d["buckets"]) - 0.3) < 1e-9
    r = compare(d, {"mean": 500.0, "p50": 500.0, "p90": 900.0, "p99": 990.0})
    assert r["router_mean_ms"] == 487.5 and r["mean_diff_pct"] == -2.5 and r["p50_diff_pct"] == 0.0
