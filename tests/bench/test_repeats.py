"""Issue 17: conversations from block prefixes, repeats folded into median and spread, the
summary's verdicts (no difference where ranges overlap), and per-repeat workload windows."""
from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from bench.report import best_peer, difference, paired_difference, summary_lines
from bench.stats import ROW_KEYS, Spread, ratio_interval, spread, summarize
from bench.workloads import QUICK, mooncake
from bench.workloads import sessions as session_workload
from dplb_trace.mooncake import TraceRequest, sessions


def _req(i: int, blocks: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index=i, timestamp_ms=float(i), input_length=len(blocks) * 512, output_length=4,
                        hash_ids=blocks)


def test_sessions_follow_the_longest_shared_prefix_not_the_common_first_block():
    reqs = [
        _req(0, (0, 1, 2)),        # conversation A, turn 1
        _req(1, (0, 5, 6)),        # B: shares only block 0 (everyone's system prompt) with A
        _req(2, (0, 1, 3, 4)),     # A, turn 2: the partial last block 2 became 3 once the answer was added
        _req(3, (0, 5, 6, 7, 8)),  # B, turn 2
        _req(4, (9,)),             # C: one block, nothing to share
        _req(5, (0, 1, 3, 4, 10)), # A, turn 3
    ]
    assert sessions(reqs) == [0, 1, 0, 1, 2, 0]


def test_spread_and_ratio_interval():
    a, b = spread([3.0, 1.0, 2.0]), spread([4.0, None, 8.0, 6.0])
    assert (a.median, a.lo, a.hi, a.n) == (2.0, 1.0, 3.0, 3)
    assert (b.median, b.lo, b.hi, b.n) == (6.0, 4.0, 8.0, 3)
    r, lo, hi = ratio_interval(a, b)
    assert r == pytest.approx(1 / 3) and lo == pytest.approx(1 / 8) and hi == pytest.approx(3 / 4)
    assert spread([]).median is None and ratio_interval(a, spread([])) == (None, None, None)


def test_difference_only_when_ranges_do_not_overlap():
    low, high, mid = Spread(2.0, 1.0, 3.0, 3), Spread(6.0, 4.0, 8.0, 3), Spread(3.5, 2.5, 5.0, 3)
    assert difference(low, high) == "DPLB better"
    assert difference(high, low) == "peer better"
    assert difference(low, mid) == "no difference" and difference(mid, high) == "no difference"
    assert difference(high, low, lower_is_better=False) == "DPLB better"


def _row(system, policy, workload, rep, ttft_p99, errors=0):
    r = dict.fromkeys(ROW_KEYS)
    r.update(system=system, policy=policy, workload=workload, workers=4, repeat=rep, requests=500, errors=errors,
             ttft_p50_ms=ttft_p99 / 4, ttft_p99_ms=ttft_p99, tpot_p99_ms=30.0, e2e_p50_ms=100.0, output_tok_s=1.0,
             prefix_hit_rate=0.3, max_share=0.3, min_share=0.2, router_cpu_s_per_1k=10.0)
    return r


def test_summary_picks_the_best_error_free_peer_and_says_no_difference_on_overlap():
    rows = [_row("dplb", "dplb", "a_mooncake", k, v) for k, v in enumerate((700.0, 800.0, 750.0))]
    rows += [_row("smg", "least_load", "a_mooncake", k, v) for k, v in enumerate((900.0, 1000.0, 950.0))]
    # vllm is faster but dropped requests in one repeat: not "best"
    rows += [_row("vllm", "cache_aware", "a_mooncake", k, v, errors=int(k == 1)) for k, v in enumerate((500.0,) * 3)]
    rows += [_row("dplb", "dplb", "b_shared_prefix", k, v) for k, v in enumerate((100.0, 300.0, 200.0))]
    rows += [_row("sglang", "cache_aware", "b_shared_prefix", k, v) for k, v in enumerate((150.0, 250.0, 200.0))]
    sm = summarize(rows)
    assert best_peer(sm, "a_mooncake", "ttft_p99_ms")[:2] == ("smg", "least_load")
    text = "\n".join(summary_lines(rows, []))
    a = next(line for line in text.splitlines() if line.startswith("| a_mooncake | TTFT p99"))
    assert "750.0 [700.0–800.0]" in a and "smg/least_load 950.0 [900.0–1000.0]" in a
    assert "DPLB better" in a and a.endswith("issue 13): met |")
    b = next(line for line in text.splitlines() if line.startswith("| b_shared_prefix | TTFT p99"))
    assert "no difference" in b


def test_overlapping_ranges_are_compared_repeat_by_repeat_on_the_same_input():
    """Windows differ in difficulty: DPLB 1844/1821/2424 against 2359/2924/3008 overlap as ranges
    (2424 > 2359) but DPLB is lower on every window: a paired difference. One repeat the other way
    round and there is none."""
    rows = [_row("dplb", "dplb", "a_mooncake", k, v) for k, v in enumerate((1844.0, 1821.0, 2424.0))]
    rows += [_row("sglang", "cache_aware", "a_mooncake", k, v) for k, v in enumerate((2359.0, 2924.0, 3008.0))]
    a = next(x for x in summary_lines(rows, []) if x.startswith("| a_mooncake | TTFT p99"))
    assert "per repeat 0.78, 0.62, 0.81" in a and "DPLB better (paired 3/3)" in a and a.endswith("issue 13): met |")
    rows[1] = _row("dplb", "dplb", "a_mooncake", 1, 3000.0)
    a = next(x for x in summary_lines(rows, []) if x.startswith("| a_mooncake | TTFT p99"))
    assert "| no difference |" in a and a.endswith("**not met** |")
    assert paired_difference([1.1, 1.3]) == "peer better (paired 2/2)"
    assert paired_difference([0.5]) == "no difference"  # one repeat is not a pattern


def test_goodput_line_compares_multipliers():
    rows = [_row("dplb", "dplb", "a_mooncake", 0, 1.0)]
    gp = [{"system": "dplb", "policy": "dplb", "workload": "a_mooncake", "goodput_mult": 1.5, "goodput_req_s": 3.0,
           "steps": []},
          {"system": "smg", "policy": "cache_aware", "workload": "a_mooncake", "goodput_mult": 2.0,
           "goodput_req_s": 4.0, "steps": []}]
    line = next(x for x in summary_lines(rows, gp) if "goodput" in x)
    assert "| 1.50 | smg/cache_aware 2.00 | 0.75 | peer better" in line and line.endswith("**not met** |")


def test_repeats_take_their_own_trace_window_and_name_the_conversation():
    p = replace(QUICK, mooncake_requests=20, session_requests=20, mooncake_start=100, mooncake_stride=50)
    a0, a1 = mooncake(p, "m", 0), mooncake(p, "m", 1)
    assert len(a0) == len(a1) == 20 and a0[0].at == 0.0 and a1[0].at == 0.0
    assert [s.body for s in a0] != [s.body for s in a1]
    assert orjson.loads(a0[0].body)["user"].startswith("conv-0-")
    s0 = session_workload(p, "m", 0)
    assert [s.body for s in s0] == [s.body for s in a0]  # the same window, sent closed-loop
    firsts = {}
    for s in s0:
        firsts.setdefault(s.session, s)
        assert (s.think == 0.0) == (firsts[s.session] is s)


def test_goodput_goes_to_dplb_and_the_two_best_error_free_peers():
    from bench.goodput_search import goodput_systems
    from bench.systems import SystemSpec

    systems = [SystemSpec("dplb", "dplb"), SystemSpec("dplb", "kv_cost"), SystemSpec("sglang", "cache_aware"),
               SystemSpec("vllm", "cache_aware"), SystemSpec("smg", "least_load"), SystemSpec("direct", "none")]
    rows = [_row("sglang", "cache_aware", "a_mooncake", k, 900.0) for k in range(3)]
    rows += [_row("vllm", "cache_aware", "a_mooncake", k, 500.0, errors=int(k == 2)) for k in range(3)]
    rows += [_row("smg", "least_load", "a_mooncake", k, 950.0) for k in range(3)]
    got = [s.label for s in goodput_systems(systems, rows, "a_mooncake", {"dplb/kv_cost": "a_mooncake"})]
    assert got == ["dplb/dplb", "sglang/cache_aware", "smg/least_load"]
    # before any peer has rows, every peer is searched
    assert len(goodput_systems(systems, [], "a_mooncake", {})) == 5


def test_core_plan_and_pinning_every_thread_of_a_tree():
    import os
    import subprocess
    import sys

    from bench.procs import core_plan, pin

    assert not core_plan(False).active
    allowed = os.sched_getaffinity(0)
    plan = core_plan(True)
    if len(allowed) < 2:
        assert not plan.active
        return
    assert plan.active and plan.router | plan.rest == frozenset(allowed) and not plan.router & plan.rest
    code = ("import threading, time\n"
            "ts = [threading.Thread(target=time.sleep, args=(30,)) for _ in range(3)]\n"
            "[t.start() for t in ts]; print('up', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        n = pin([child.pid], plan.router)
        assert n >= 4  # the main thread and the three sleepers
        for tid in os.listdir(f"/proc/{child.pid}/task"):
            assert os.sched_getaffinity(int(tid)) == set(plan.router)
    finally:
        child.kill()
        child.wait()
    assert pin([child.pid], plan.router) == 0  # gone: nothing pinned, no error


def test_a_later_goodput_search_replaces_the_summary_lines_and_its_section(tmp_path):
    from bench.report import update_goodput, write_all

    rows = [_row("dplb", "dplb", "a_mooncake", k, 700.0 + k) for k in range(3)]
    rows += [_row("sglang", "cache_aware", "a_mooncake", k, 900.0 + k) for k in range(3)]
    first = [{"system": "dplb", "policy": "dplb", "workload": "a_mooncake", "goodput_mult": 0.5, "goodput_req_s": 1.0,
              "steps": [[1.0, False, 1.0, 1.0], [0.5, True, 1.0, 1.0]]},
             {"system": "sglang", "policy": "cache_aware", "workload": "a_mooncake", "goodput_mult": 1.0,
              "goodput_req_s": 2.0, "steps": [[1.0, True, 1.0, 1.0]]}]
    slo = {"a_mooncake": {"scaled": "mooncake_load", "ttft_p99_s": 10.0, "tpot_p99_s": 0.2, "ladder": [1.0],
                          "down": [0.5]}}
    write_all(tmp_path, rows, {"command": "python -m bench.run", "goodput_slo": slo}, [], {}, {}, {}, first)
    assert "| 0.50 | sglang/cache_aware 1.00 | 0.50 | peer better" in (tmp_path / "latest.md").read_text()
    second = [dict(first[0], goodput_mult=2.0, steps=[[1.0, True, 1.0, 1.0], [2.0, True, 1.0, 1.0]]), first[1]]
    update_goodput(tmp_path, second, dict(slo, a_mooncake=dict(slo["a_mooncake"], tpot_p99_s=0.5)), "second search")
    md = (tmp_path / "latest.md").read_text()
    assert "| 2.00 | sglang/cache_aware 1.00 | 2.00 | DPLB better" in md and "peer better" not in md
    assert md.count("## Goodput at an SLO") == 1 and "TPOT p99 ≤ 0.5 s" in md and "TPOT p99 ≤ 0.2 s" not in md
    assert md.count("| workload | figure |") == 1 and md.rstrip().endswith("- second search")
    assert "## Per workload" in md and "## All rows" in md
    assert orjson.loads((tmp_path / "goodput.json").read_bytes())[0]["goodput_mult"] == 2.0
