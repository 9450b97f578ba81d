"""latest.json / latest.md / plots from synthetic rows: exact keys, goals checked honestly."""
from __future__ import annotations

import json

import pytest

from bench.peers import peer_command
from bench.report import best, goals, scaling_efficiency, write_all
from bench.stats import ROW_KEYS


def row(system, policy, workload, ttft_p99, tok_s, hit=0.5, errors=0, e2e_p50=10.0, workers=4, mx=0.3, mn=0.2):
    r = dict.fromkeys(ROW_KEYS)
    r.update(system=system, policy=policy, workload=workload, workers=workers, repeat=0, requests=100, errors=errors,
             ttft_p50_ms=ttft_p99 / 2, ttft_p90_ms=ttft_p99 * 0.9, ttft_p99_ms=ttft_p99, e2e_p50_ms=e2e_p50,
             e2e_p99_ms=e2e_p50 * 2, output_tok_s=tok_s, req_s=10.0, prefix_hit_rate=hit, max_share=mx,
             min_share=mn, router_cpu_s_per_1k=1.0)
    return r


ROWS = [
    row("dplb", "dplb", "a_mooncake", 700.0, 1200.0, hit=0.6),
    row("dplb", "round_robin", "a_mooncake", 1500.0, 1000.0, hit=0.2),
    row("sglang", "cache_aware", "a_mooncake", 1000.0, 1000.0, hit=0.55),
    row("vllm", "cache_aware", "a_mooncake", 900.0, 1000.0, hit=0.5, errors=3),
    row("dplb", "dplb", "b_shared_prefix", 950.0, 1000.0),
    row("sglang", "cache_aware", "b_shared_prefix", 1000.0, 1000.0),
    row("dplb", "dplb", "e_burst", 1.0, 1.0, mx=0.26, mn=0.24),
    row("sglang", "round_robin", "e_burst", 1.0, 1.0, mx=0.25, mn=0.25),
    row("direct", "none", "f_overhead", 1.0, 1.0, e2e_p50=5.0, workers=1),
    row("dplb", "dplb", "f_overhead", 1.0, 1.0, e2e_p50=5.4),
    row("sglang", "round_robin", "f_overhead", 1.0, 1.0, e2e_p50=5.3),
    row("dplb", "dplb", "scaling", 1.0, 100.0, workers=1),
    row("dplb", "dplb", "scaling", 1.0, 780.0, workers=8),
    row("dplb", "round_robin", "scaling", 1.0, 100.0, workers=1),
    row("dplb", "round_robin", "scaling", 1.0, 700.0, workers=8),
]


def test_best_prefers_error_free_then_lowest_p99():
    assert best(ROWS, "a_mooncake", dplb=False)["system"] == "sglang"  # vllm is faster but dropped requests
    assert best(ROWS, "a_mooncake", dplb=True)["policy"] == "dplb"


def test_goals_report_met_and_unmet():
    text = "\n".join(goals(ROWS))
    a_line = next(line for line in text.splitlines() if line.startswith("| a_mooncake | TTFT p99"))
    # vllm dropped requests, so sglang is the best peer; one repeat each: ranges are points
    assert "sglang/cache_aware 1000.0" in a_line and "| 0.70 [0.70–0.70] | DPLB better |" in a_line
    assert a_line.endswith("met |") and "not met" not in a_line
    b_line = next(line for line in text.splitlines() if line.startswith("| b_shared_prefix | TTFT p99"))
    assert "DPLB better" in b_line
    f_line = next(line for line in text.splitlines() if line.startswith("| f_overhead | added p50"))
    assert "| 0.400 | sglang/round_robin 0.300 |" in f_line and f_line.endswith("**not met** |")
    assert "| scaling | efficiency at 8 engines, dplb/dplb | 0.975 |" in text and "0.97: met" in text


def test_a_worker_left_idle_in_the_burst_is_shown_not_hidden():
    rows = [row("dplb", "dplb", "e_burst", 1.0, 1.0, mx=0.5, mn=0.0)]
    text = "\n".join(goals(rows))
    assert "| e_burst | max/min share | inf" in text and text.rstrip().endswith("**not met** |")


def test_scaling_efficiency():
    eff = scaling_efficiency(ROWS)
    assert eff[1] == (100.0, 1.0)
    assert eff[8][1] == pytest.approx(0.975)
    assert scaling_efficiency(ROWS, "round_robin")[8][1] == pytest.approx(0.875)


def test_write_all_files(tmp_path):
    write_all(tmp_path, ROWS, {"command": "python -m bench.run --quick", "run_id": "x"}, ["a note"],
              {"dplb/dplb": [0.1, 0.2, 0.3], "sglang/cache_aware": [0.2, 0.4]},
              {"dplb/dplb": [0.26, 0.24, 0.25, 0.25]}, {("dplb/dplb", "f_overhead"): [0.5]})
    data = json.loads((tmp_path / "latest.json").read_text())
    assert len(data) == len(ROWS) and all(tuple(r) == ROW_KEYS for r in data)
    md = (tmp_path / "latest.md").read_text()
    assert "python -m bench.run --quick" in md and "a note" in md and "## Machine" in md
    assert "sglang-router" in md and "## Summary" in md and "## Per workload" in md
    for png in ("ttft_cdf_a.png", "share_e.png", "scaling.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_all_rejects_bad_rows(tmp_path):
    with pytest.raises(ValueError):
        write_all(tmp_path, [{"system": "x"}], {}, [], {}, {}, {})


def test_peer_commands_are_loopback_and_quiet():
    for name, level in (("sglang", "warn"), ("vllm", "warning")):
        cmd = peer_command(name, "cache_aware", 1111, 2222, ["http://127.0.0.1:1", "http://127.0.0.1:2"])
        s = " ".join(cmd)
        assert "--host 127.0.0.1" in s and "--prometheus-host 127.0.0.1" in s
        assert f"--log-level {level}" in s and "--policy cache_aware" in s
        assert "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2" in s
