"""The TPOT-SLO term live: the router's book sees a stream in flight through real agents and
simulated engines, with the tokens it has streamed so far (slow: real processes).

Setting (margins worked out so that load on the machine cannot flip a verdict): engines whose
steps take about 100 ms, a TPOT bound of 0.5 s, a seed prefill rate of 1,000 tokens/s (nothing
is learned from 1 prompt token) and 1,024-token prefill chunks. A victim streaming 60 tokens has
about 0.5 × 59 − 59 × 0.1 ≈ 23.6 s of slack; a 40,000-token prompt would add min(40,000, left ×
1,024) / 1,000 s to its remaining steps: ≥ 49 s while ≥ 49 steps are left (pushed over), ≤ 6 s
once ≤ 6 are (not). So ``/dplb/route`` counts the stream as a victim early and not late — late
only if the router reads its streamed tokens as they pass (without them it would count 0 of 60
streamed, 59 steps left, and still price it)."""
from __future__ import annotations

import httpx
import pytest

from tests.helpers import sim_agents_and_router, wait_until

pytestmark = pytest.mark.slow
SIM_MODEL = "sim-llama-3.1-8b"
OUT = 60


@pytest.fixture(scope="module")
def slow2():
    """2 agents (sim engines, ~100 ms steps) + a dplb router with the TPOT-SLO term; yields its URL."""
    cfg = {"routing_policy": {"policy": "dplb", "slo_tpot_s": 0.5, "w_slo_miss": 1.0,
                              "prefill_tokens_per_s": 1000, "step_tokens": 1024}}
    with sim_agents_and_router(2, ["--base-step-ms", "100"], cfg, prefix="dplb-slo-") as (base, _):
        yield base


def _victims(base: str) -> dict[int, int]:
    long_prompt = {"model": SIM_MODEL, "max_tokens": 16,
                   "messages": [{"role": "user", "content": " ".join(f"w{i % 997}" for i in range(60_000))}]}
    d = httpx.post(base + "/dplb/route", json=long_prompt, timeout=30).json()
    assert min(s["uncached_tokens"] for s in d["scores"]) >= 40_000, d["scores"]
    return {s["worker_id"]: s["slo_victims"] for s in d["scores"]}


def test_a_stream_is_a_victim_early_and_not_once_it_is_nearly_done(slow2):
    base = slow2
    assert _victims(base) == {0: 0, 1: 0}
    body = {"model": SIM_MODEL, "max_tokens": OUT, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "count slowly"}]}
    early = late = None
    events = 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as r:
        wid = int(r.headers["x-dplb-worker-id"])
        for line in r.iter_lines():
            if not line.startswith("data: {") or '"content"' not in line:
                continue
            events += 1
            if events == 2 and early is None:
                early = _victims(base)
            if events == OUT - 6 and late is None:
                late = _victims(base)
    assert early == {wid: 1, 1 - wid: 0}, early
    assert late == {0: 0, 1: 0}, late
    assert events >= OUT - 1
    wait_until(lambda: _victims(base) == {0: 0, 1: 0}, 10, what="the finished stream to leave the book")
