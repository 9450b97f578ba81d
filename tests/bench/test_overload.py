"""bench/overload.py's workload and figures: classes drawn at the asked share and sent in both
routers' spellings, arrivals at the asked rate, the simulator's SLO applied in simulated seconds,
a 429 counted as shed and as a miss."""
from __future__ import annotations

import orjson

from bench.loadgen import Result
from bench.overload import figures, met_slo, specs_for
from dplb_trace.mooncake import load_trace


def _res(ok: bool, status: int, ttft: float | None, e2e: float | None, tokens: int, tag: str) -> Result:
    return Result(ok, status, 0.0, ttft, e2e, tokens, "0", tag)


def test_specs_carry_the_class_in_both_headers_at_the_asked_share_and_rate():
    reqs = load_trace(limit=400, start=2000)
    specs = specs_for(reqs, rate_scale=2.0, time_scale=1.0, high_share=0.3, seed=1, spread_ms=0.0, max_tokens_cap=16)
    assert specs == specs_for(reqs, 2.0, 1.0, 0.3, 1, 0.0, 16)           # seeded
    high = [s for s in specs if s.tag.startswith("1:")]
    assert 0.22 <= len(high) / len(specs) <= 0.38
    for s in specs:
        h = dict(s.headers)
        cls = s.tag.split(":")[0]
        assert h["x-dplb-priority"] == cls
        assert h["x-smg-priority"] == {"1": "interactive", "0": "bulk"}[cls]
        assert orjson.loads(s.body)["max_tokens"] <= 16
    # twice the trace's rate: the last request leaves at half its trace offset
    span_s = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0
    assert abs(specs[-1].at - span_s / 2.0) < 1e-6
    # a spread moves arrivals later by less than its width (at rate 1)
    spread = specs_for(reqs, 1.0, 1.0, 0.3, 1, 3000.0, 16)
    plain = specs_for(reqs, 1.0, 1.0, 0.3, 1, 0.0, 16)
    assert all(0.0 <= a.at - b.at < 3.0 for a, b in zip(spread, plain, strict=True))
    assert any(a.at != b.at for a, b in zip(spread, plain, strict=True))


def test_slo_in_simulated_seconds_and_429s_are_misses():
    # 2k prompt tokens: TTFT bound 1.2 s; TPOT bound 0.1 s
    assert met_slo(_res(True, 200, 1.1, 1.1 + 9 * 0.09, 10, "1:2000"), time_scale=1.0)
    assert not met_slo(_res(True, 200, 1.3, 1.4, 2, "1:2000"), time_scale=1.0)
    assert not met_slo(_res(True, 200, 0.5, 0.5 + 9 * 0.11, 10, "0:2000"), time_scale=1.0)
    # at --time-scale 10 a wall second is ten simulated ones
    assert not met_slo(_res(True, 200, 0.2, 0.2, 1, "0:0"), time_scale=10.0)
    assert met_slo(_res(True, 200, 0.09, 0.09, 1, "0:0"), time_scale=10.0)
    rs = [_res(True, 200, 0.5, 0.6, 2, "1:0"), _res(False, 429, None, None, 0, "1:0"),
          _res(True, 200, 0.5, 0.6, 2, "0:0"), _res(False, 502, None, None, 0, "0:0")]
    f = figures(rs, wall_s=4.0, time_scale=1.0)
    assert (f["met"], f["shed_429"], f["errors_other"]) == (2, 1, 1)
    assert f["attainment_class1"] == 0.5 and f["attainment_class0"] == 0.5
    assert f["goodput_rps"] == 0.5
