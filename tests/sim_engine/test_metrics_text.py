"""The hand-written /metrics text parses with prometheus_client's parser into vLLM's families."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore
from sim_engine.metrics import MetricsRenderer
from sim_engine.request import SimRequest


def test_exposition_parses_and_matches_engine_stats():
    core = EngineCore(EngineConfig(num_gpu_blocks=30, model='we"ird\\name'))
    now = 0.0
    for i in range(6):
        core.add_request(SimRequest(f"r{i}", [f"r{i}w{j}" for j in range(100)], 40, 16), now)
    core.abort("r5", now)
    while core.has_work():
        _, d = core.step(now)
        now += d
    fams = {
        f.name: f
        for f in text_string_to_metric_families(MetricsRenderer(core, 'we"ird\\name').render().decode())
    }
    types = {n: f.type for n, f in fams.items()}
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    assert types["vllm:num_preemptions"] == "counter"
    assert types["vllm:time_to_first_token_seconds"] == "histogram"
    s = core.stats

    def value(name: str, **labels: str) -> float:
        got = [
            x.value
            for fam in fams.values()
            for x in fam.samples
            if x.name == name and all(x.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(got) == 1, (name, labels)
        return got[0]

    assert value("vllm:num_preemptions_total") == s.num_preemptions > 0
    assert value("vllm:generation_tokens_total") == s.generation_tokens == 5 * 40
    assert value("vllm:request_success_total", finished_reason="abort") == 1
    assert value("vllm:request_success_total", finished_reason="length") == 5
    sample = fams["vllm:num_requests_running"].samples[0]
    assert sample.labels == {"engine": "0", "model_name": 'we"ird\\name'}
    for name, h in (
        ("vllm:time_to_first_token_seconds", s.ttft),
        ("vllm:inter_token_latency_seconds", s.itl),
    ):
        buckets = [x for x in fams[name].samples if x.name == name + "_bucket"]
        values = [b.value for b in buckets]
        assert values == sorted(values) and buckets[-1].labels["le"] == "+Inf"
        assert values[-1] == h.count == value(name + "_count")
        assert abs(value(name + "_sum") - h.sum) < 1e-9
    assert value("vllm:time_to_first_token_seconds_count") == 5


def test_chunk_writer_equals_orjson_of_the_dict():
    import orjson

    from sim_engine.api import chunk_writer

    base = {"id": 'id"\\x', "object": "text_completion", "created": 7, "model": "m\u00e9"}
    w = chunk_writer(base, "text")
    for idx, text, fr in ((0, " a", None), (12, ' q"uote\\', "stop"), (1, "", "abort")):
        want = {
            **base,
            "choices": [
                {"index": idx, "text": text, "logprobs": None, "finish_reason": fr, "stop_reason": None}
            ],
        }
        assert w(idx, text, fr) == b"data: " + orjson.dumps(want) + b"\n\n"
    chat = {**base, "object": "chat.completion.chunk"}
    w = chunk_writer(chat, "chat")
    want = {
        **chat,
        "choices": [{"index": 2, "delta": {"content": " z"}, "logprobs": None, "finish_reason": None}],
    }
    assert w(2, " z", None) == b"data: " + orjson.dumps(want) + b"\n\n"


def test_latencies_are_wall_clock_seconds_under_a_time_scale():
    """Issue 32, "two latencies for one thing": under ``--time-scale 10`` the dump and
    /dplb/status showed TTFT 1.3-2.6 s where the client saw 0.15 s. The exposition reports the
    modelled seconds divided by the time scale: each bucket counts the same requests, its bound
    and the sum are wall-clock."""
    core = EngineCore(EngineConfig(num_gpu_blocks=30))
    for v in (0.05, 0.5, 2.0):
        core.stats.ttft.observe(v)
    name = "vllm:time_to_first_token_seconds"

    def samples(scale: float) -> dict[tuple[str, str], float]:
        fam = next(f for f in text_string_to_metric_families(MetricsRenderer(core, "m", scale).render().decode())
                   if f.name == name)
        return {(x.name, x.labels.get("le", "")): x.value for x in fam.samples}

    sim, wall = samples(1.0), samples(10.0)
    assert abs(wall[(name + "_sum", "")] - 0.255) < 1e-9 and abs(sim[(name + "_sum", "")] - 2.55) < 1e-9
    sim_b = sorted((float(le), v) for (n, le), v in sim.items() if n.endswith("_bucket") and le != "+Inf")
    wall_b = sorted((float(le), v) for (n, le), v in wall.items() if n.endswith("_bucket") and le != "+Inf")
    assert [v for _, v in sim_b] == [v for _, v in wall_b]                      # same counts per bucket
    assert all(abs(w - s / 10.0) < 1e-12 for (s, _), (w, _) in zip(sim_b, wall_b, strict=True))
