"""The TPOT-priced interference experiment (prototypes/tpot_interference.py): its formula, and that the
patched simulator runs and routes differently from plain dplb (in a subprocess: the patch is
process-wide)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prototypes.tpot_interference import (
    VICTIM_KNOWLEDGE,
    LearnedOutputs,
    slo_misses,
    tpot_penalty_s,
)

S = 8192.0
R = 30000.0


def test_a_short_output_victim_costs_far_more_than_a_long_one():
    long_victim = tpot_penalty_s(30000, R, [256], S)
    short_victim = tpot_penalty_s(30000, R, [4], S)
    # 256 tokens: the whole delay u/r spread over 255 steps = exactly the reference's
    assert long_victim == pytest.approx(30000 / R)
    # 4 tokens: three steps, each at most one 8,192-token chunk: 3·8192/(r·3) per token, × 255
    assert short_victim == pytest.approx(S / R * 255)
    assert short_victim > 50 * long_victim


def test_victims_add_up_and_one_token_outputs_have_no_tpot():
    assert tpot_penalty_s(30000, R, [256, 4, 1], S) == pytest.approx(
        tpot_penalty_s(30000, R, [256], S) + tpot_penalty_s(30000, R, [4], S))
    assert tpot_penalty_s(30000, R, [1, 0], S) == 0.0
    assert tpot_penalty_s(0, R, [4, 256], S) == 0.0


def test_only_whole_keeps_the_victims_whose_every_step_we_share():
    # u = 30,000 tokens covers 3 steps of 8,192 (4 output tokens) but not 255
    assert tpot_penalty_s(30000, R, [4, 256], S, only_whole=True) == pytest.approx(tpot_penalty_s(30000, R, [4], S))
    assert tpot_penalty_s(1000, R, [4], S, only_whole=True) == 0.0


@pytest.mark.parametrize(("rate", "step"), [(0.0, S), (R, 0.0), (-1.0, S)])
def test_a_rate_or_step_that_is_not_positive_is_refused(rate, step):
    with pytest.raises(ValueError, match="must be > 0"):
        tpot_penalty_s(1000, rate, [4], step)


def test_victim_knowledge_is_an_upper_bound_with_the_stated_slack():
    exact, pow2, x4 = VICTIM_KNOWLEDGE["exact"], VICTIM_KNOWLEDGE["pow2"], VICTIM_KNOWLEDGE["x4"]
    assert [pow2(o) for o in (1, 2, 3, 4, 5, 13, 256, 257)] == [1, 2, 4, 4, 8, 16, 256, 512]
    for o in range(1, 600):
        assert exact(o) == o
        assert o <= pow2(o) < 2 * o
        assert x4(o) == 4 * o
    # a looser bound can only lower the price: a victim thought longer feels our delay less
    assert tpot_penalty_s(30000, R, [x4(4)], S) < tpot_penalty_s(30000, R, [pow2(3)], S) <= tpot_penalty_s(30000, R, [3], S)


def _run(tmp_path, *flags: str) -> dict:
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    cmd = [sys.executable, "-m", "prototypes.tpot_interference", *flags, "--workload", "mixed", "--requests", "150",
           "--engines", "2", "--rate-scale", "4", "--seed", "0", "--policy", "dplb", "--progress", "off",
           "--json-out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())
    return row


def test_the_patched_simulator_serves_everything_and_routes_otherwise(tmp_path):
    plain = _run(tmp_path)
    priced = _run(tmp_path, "--w-tpot", "50")
    assert plain["served"] == priced["served"] == 150
    # a weight this large moves long prompts off the workers carrying short-output decodes
    assert plain["per_engine"]["requests"] != priced["per_engine"]["requests"]


def test_learned_outputs_price_a_victim_by_its_class_and_what_it_has_streamed():
    lo = LearnedOutputs(keep=3)
    assert LearnedOutputs.prompt_class(0) == LearnedOutputs.prompt_class(1) == 0
    assert LearnedOutputs.prompt_class(32768) == LearnedOutputs.prompt_class(65535) == 15
    # before anything finished in its class: the client's bound (pow2 of max_tokens), not the oracle
    assert lo.lengths(40000, 0, fallback=8) == [8]
    for o in (4, 7, 300, 6):   # keep=3: the 4 falls out
        lo.observe(40000, o)
    lo.observe(100, 500)       # another class: no influence
    assert lo.lengths(40000, 0, fallback=8) == [7, 300, 6]
    # a victim that has streamed 6 tokens is at least 7 long: the 6 is ruled out
    assert lo.lengths(40000, 6, fallback=8) == [7, 300]
    # longer than anything seen: doubled
    assert lo.lengths(40000, 400, fallback=8) == [802]
    got = lo.expected_penalty(30000, R, [(40000, 0, 6)], S)
    assert got == pytest.approx(sum(tpot_penalty_s(30000, R, [o], S) for o in (7, 300, 6)) / 3)
    capped = LearnedOutputs(keep=3, bound="pow2", capped=True)
    for o in (7, 300, 6):
        capped.observe(40000, o)
    # capped by the victim's own bound: pow2(6) = 8, so 300 counts as 8
    assert capped.expected_penalty(30000, R, [(40000, 0, 6)], S) == pytest.approx(
        sum(tpot_penalty_s(30000, R, [o], S) for o in (7, 8, 6)) / 3)
    with pytest.raises(ValueError, match="keep"):
        LearnedOutputs(keep=0)
    with pytest.raises(ValueError, match="bound"):
        LearnedOutputs(bound="exact")


def test_slo_misses_count_only_the_victims_our_prefill_pushes_over_the_bound():
    t = 0.1
    # 4 output tokens, 2 streamed in 0.02 s (mean step 0.02 s): 0.02 + 2·0.02 = 0.06 s of a 0.3 s
    # budget; our 30k tokens add min(30000, 2·8192)/r = 0.546 s -> pushed over
    assert slo_misses(30000, R, [(4, 2, 0.02)], S, t) == 1.0
    # the same victim under a prefill of 3,000 tokens: 0.1 s more, 0.16 s < 0.3 s -> not a miss
    assert slo_misses(3000, R, [(4, 2, 0.02)], S, t) == 0.0
    # 256 tokens at 0.01 s a step: 25.5 s of budget absorbs a 1 s prefill
    assert slo_misses(30000, R, [(256, 10, 0.09)], S, t) == 0.0
    # a victim already over its bound without us (mean step 0.2 s) is not ours to count
    assert slo_misses(30000, R, [(4, 2, 0.2)], S, t) == 0.0
    # one-token outputs have no TPOT; a queued victim (nothing streamed) with 3 tokens is pushed over
    assert slo_misses(30000, R, [(1, 0, 0.0), (3, 0, 0.0)], S, t) == 1.0
    with pytest.raises(ValueError):
        slo_misses(1, 0.0, [(4, 2, 0.0)], S, t)


def test_the_slo_miss_priced_simulator_serves_everything(tmp_path):
    row = _run(tmp_path, "--w-tpot", "1", "--tpot-slo-s", "0.1", "--victim-outputs", "pow2")
    assert row["served"] == 150 and row["rejected"] == 0
