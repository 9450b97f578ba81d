"""Metric parsing on real /metrics texts from vLLM and SGLang (tests/fixtures/)."""
from __future__ import annotations

import pytest

from tests.helpers import ROOT
from worker_agent.metrics import (
    SGLANG,
    VLLM,
    EngineMetrics,
    parse_engine_metrics,
    parse_gauges,
)

FIX = ROOT / "tests" / "fixtures"


def read(name: str) -> str:
    return (FIX / name).read_text()


def test_sglang_docs_sample():
    m = parse_engine_metrics(read("sglang_metrics.txt"), SGLANG)
    assert m == EngineMetrics(num_running=162, num_waiting=2826, kv_cache_usage=pytest.approx(0.28),
                              totals=(("ttft", pytest.approx(2351897.9474117756), 11008.0),))


def test_latency_histogram_totals_feed_the_windows():
    """Issue 14: the agent no longer sees requests; the engine's own TTFT / inter-token / e2e
    histograms (cumulative sum and count) and finished-request counter are what it has."""
    m = parse_engine_metrics(read("vllm_cpu_0.32_metrics.txt"), VLLM)
    t = {k: (s, n) for k, s, n in m.totals}
    assert t["ttft"] == (pytest.approx(7.261603832244873), 5.0)
    assert t["tpot"] == (pytest.approx(4.740798654999253), 620.0)
    assert t["e2e"][1] == 3.0 and t["finished"][0] == 3.0


def test_vllm_010_engine_label():
    m = parse_engine_metrics(read("vllm_v010_metrics.txt"), VLLM)
    assert m.num_running is None and m.num_waiting is None      # not in that published excerpt
    assert m.kv_cache_usage == pytest.approx(9.75010481363281e-06)


def test_new_kv_name_wins_over_deprecated_one():
    # vLLM 0.10-0.11 export both names; the deprecated one must not be read when the new one exists
    text = ("# TYPE vllm:gpu_cache_usage_perc gauge\n"
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n')
    assert parse_engine_metrics(text, VLLM).kv_cache_usage == pytest.approx(0.5)


def test_vllm_v0_falls_back_to_gpu_cache_usage():
    m = parse_engine_metrics(read("vllm_v07_metrics.txt"), VLLM)
    assert m == EngineMetrics(num_running=0, num_waiting=0, kv_cache_usage=0.0)


def test_vllm_data_parallel_engines_sum_counts_and_max_usage():
    # one API server in front of two DP engines labels each sample with its engine rank
    text = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 5.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""
    m = parse_engine_metrics(text, VLLM)
    assert (m.num_running, m.num_waiting) == (7, 7)
    assert m.kv_cache_usage == pytest.approx(0.75)


def test_sglang_tp_ranks_take_max_not_sum():
    text = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 8.0
sglang:num_running_reqs{model_name="m",tp_rank="1"} 8.0
"""
    assert parse_engine_metrics(text, SGLANG).num_running == 8


def test_missing_families_are_none_and_other_engine_names_ignored():
    m = parse_engine_metrics(read("sglang_metrics.txt"), VLLM)
    assert m.empty
    assert parse_engine_metrics("", VLLM).empty


def test_usage_clamped_and_nan_ignored():
    text = "vllm:kv_cache_usage_perc 1.7\nvllm:num_requests_running NaN\n"
    m = parse_engine_metrics(text, VLLM)
    assert m.kv_cache_usage == 1.0
    assert m.num_running is None


def test_malformed_line_raises_value_error():
    with pytest.raises(ValueError):
        parse_engine_metrics('vllm:num_requests_running{engine="0" 3\n', VLLM)


def test_parse_gauges_keeps_labels():
    out = parse_gauges(read("vllm_cpu_0.32_metrics.txt"), ["vllm:num_requests_running"])
    assert out == {"vllm:num_requests_running": [({"engine": "0", "model_name": "tiny-llama"}, 2.0)]}


def test_vllm_032_cpu_capture_ignores_waiting_by_reason():
    # a page captured from a real vLLM 0.32 (CPU) by `make test-vllm`: 2 running, 2 waiting;
    # vllm:num_requests_waiting_by_reason shares the prefix and must not be added in
    m = parse_engine_metrics(read("vllm_cpu_0.32_metrics.txt"), VLLM)
    assert (m.num_running, m.num_waiting) == (2, 2)
    assert m.kv_cache_usage == pytest.approx(0.0001220740379039853)


@pytest.mark.parametrize("fixture", ["vllm_cpu_0.32_metrics.txt", "vllm_v010_metrics.txt", "vllm_v07_metrics.txt",
                                     "sglang_metrics.txt"])
def test_sample_values_agree_with_the_reference_parser_on_real_pages(fixture):
    """The fast path (labels cut, values read by float) gives the values prometheus_client's
    parser gives for every sample name on real pages, in order."""
    from prometheus_client.parser import text_string_to_metric_families

    from worker_agent.metrics import sample_values

    text = read(fixture)
    ref: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            ref.setdefault(s.name, []).append(float(s.value))
    assert ref
    got = sample_values(text, tuple(ref))
    assert got.keys() == ref.keys()
    for name, vals in ref.items():
        assert got[name] == pytest.approx(vals, nan_ok=True), name


def test_sample_values_handle_braces_and_quotes_inside_label_values():
    from worker_agent.metrics import sample_values

    text = ('m{a="x}y",b="q\\"{z"} 2.5\n'
            'm{c=""} +Inf\n'
            'm_other{a="1"} 9\n'
            'm 3 1700000000000\n')
    assert sample_values(text, ("m",)) == {"m": [2.5, float("inf"), 3.0]}
