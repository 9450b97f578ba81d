"""Workloads are deterministic and have the shapes issue 7 asks for."""
from __future__ import annotations

import itertools
from dataclasses import replace

import orjson
import pytest

from bench.errors import WorkloadError
from bench.workloads import (
    FULL,
    QUICK,
    WORKLOADS,
    burst,
    heterogeneous,
    mixed_lengths,
    mooncake,
    overhead,
    scaling,
    shared_prefix,
)

SMALL = replace(QUICK, mooncake_requests=30, gsp_num_groups=3, gsp_prompts_per_group=4, gsp_system_prompt_len=64,
                gsp_question_len=8, mixed_requests=10, hetero_requests=10, burst_requests=20, overhead_requests=15,
                scaling_requests_per_engine=3)


def _msgs(spec):
    return orjson.loads(spec.body)["messages"]


def test_same_bytes_every_time():
    for w in WORKLOADS.values():
        a, b = w.build(SMALL, "m"), w.build(SMALL, "m")
        assert [(s.at, s.body) for s in a] == [(s.at, s.body) for s in b], w.name


def test_mooncake_follows_trace_and_keeps_prefix():
    specs = mooncake(SMALL, "m")
    assert len(specs) == 30
    assert specs == sorted(specs, key=lambda s: s.at)
    assert specs[-1].at > 0
    body = orjson.loads(specs[0].body)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    # every request of the trace starts with block 0: same first 512 words
    p0, p1 = (_msgs(s)[0]["content"].split() for s in specs[:2])
    assert p0[:512] == p1[:512]
    assert p0[512:600] != p1[512:600]


def test_shared_prefix_groups():
    specs = shared_prefix(SMALL, "m")
    assert len(specs) == 12
    systems = {_msgs(s)[0]["content"] for s in specs}
    assert len(systems) == 3
    assert all(len(t.split()) == 64 for t in systems)
    questions = [_msgs(s)[1]["content"] for s in specs]
    assert len(set(questions)) == 12
    tags = [s.tag for s in specs]
    assert tags != sorted(tags)  # shuffled across groups, not group after group
    assert all(b.at >= a.at for a, b in itertools.pairwise(specs))


def test_mixed_lengths_interleave_short_and_long():
    specs = mixed_lengths(SMALL, "m")
    lens = [len(_msgs(s)[0]["content"].split()) for s in specs]
    assert lens == [128, 4096] * 5


def test_heterogeneous_lengths_in_range():
    lens = [len(_msgs(s)[0]["content"].split()) for s in heterogeneous(SMALL, "m")]
    assert all(256 <= n <= 2048 for n in lens) and len(set(lens)) > 1


def test_burst_all_at_zero_and_unique():
    specs = burst(SMALL, "m")
    assert len(specs) == 20 and all(s.at == 0.0 for s in specs)
    assert len({_msgs(s)[0]["content"] for s in specs}) == 20


def test_overhead_tiny_non_streaming():
    specs = overhead(SMALL, "m")
    body = orjson.loads(specs[0].body)
    assert body["stream"] is False and body["max_tokens"] == 1 and "stream_options" not in body
    assert len(body["messages"][0]["content"].split()) == 8
    assert WORKLOADS["f_overhead"].closed and not WORKLOADS["a_mooncake"].closed


def test_scaling_grows_with_engines():
    assert len(scaling(SMALL, "m", 4)) == 4 * len(scaling(SMALL, "m", 1))


def test_only_d_runs_on_heterogeneous_engines():
    assert [w.name for w in WORKLOADS.values() if w.engines == "hetero"] == ["d_heterogeneous"]
    assert [w.name for w in WORKLOADS.values() if w.engines == "fast"] == ["f_overhead"]


def test_burst_is_200_in_both_profiles():
    assert FULL.burst_requests == QUICK.burst_requests == 200


def test_bad_parameters_raise():
    with pytest.raises(WorkloadError):
        mixed_lengths(replace(SMALL, mixed_rate=0.0), "m")


def test_mooncake_rate_is_the_trace_rate_in_simulated_time():
    from dplb_trace.mooncake import load_trace
    trace = load_trace(limit=30, start=SMALL.mooncake_start)
    t0 = trace[0].timestamp_ms
    for load, ts in ((1.0, 0.5), (2.0, 0.25), (1.0, 4.0)):
        specs = mooncake(replace(SMALL, mooncake_load=load, trace_time_scale=ts), "m")
        assert [s.at for s in specs] == pytest.approx([(r.timestamp_ms - t0) / 1000.0 / (load * ts) for r in trace])
