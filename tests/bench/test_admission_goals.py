"""bench/admission_goals.py: the cells' and variants' parsing, the judging of issue 45's four goals
on hand-made figures (each threshold from both sides), and one tiny cell run end to end through
the real simulator and the cache."""
from __future__ import annotations

import json

import pytest

from bench import admission_goals as ag


def _fig(att=0.99, p50=0.2, p99=1.0, goodput=10.0, high=None, light=None, shed=0) -> dict:
    return {"attainment": att, "p50": p50, "p99": p99, "goodput": goodput, "shed": shed, "queued": 0,
            "high": high, "light": light}


def _below(on: dict, off: dict) -> dict:
    return {"on@0.8": on, "off@0.8": off, "on@1": on, "off@1": off}


def test_cells_parse_and_scale_with_engines():
    c = ag.parse_cell("agentic e8 s1")
    assert (c.workload, c.engines, c.seed) == ("agentic", 8, 1)
    assert c.capacity == pytest.approx(20.0)
    args = c.args(1.5, "on")
    assert args[args.index("--rate-scale") + 1] == "30.0000"
    assert args[args.index("--admission") + 1] == "on"
    for bad in ("agentic e4", "chat e4 s0", "agentic 4 s0", "agentic e4 sX"):
        with pytest.raises(ValueError):
            ag.parse_cell(bad)
    assert len(ag.full_cells()) == 2 * len(ag.WORKLOADS) * 4
    assert [ag.parse_cell(n).name for n in ag.DEFAULT_CELLS] == list(ag.DEFAULT_CELLS)


def test_runs_cover_each_goal_and_docqa_gets_its_second_peak_run():
    keys = {r.key for r in ag.runs_for(ag.parse_cell("docqa e4 s0"), "b")}
    assert keys == {"off@1", "off@1.5", "on@1.5", "on@2", "on@3"}
    keys = {r.key for r in ag.runs_for(ag.parse_cell("agentic e4 s0"), "abcd")}
    assert keys == {"off@0.8", "on@0.8", "off@1", "on@1", "on@1.5", "on@2", "on@3", "class@2", "tenant@2"}
    cls = next(r for r in ag.runs_for(ag.parse_cell("A e4 s0"), "c"))
    args = cls.args(("--config", "x.yaml"))
    assert "--priority-mix" in args and args[-2:] == ["--config", "x.yaml"]


def test_variant_takes_out_tree_and_keeps_the_rest(tmp_path):
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "a.py").write_text("x = 1\n")
    v = ag.parse_variant(f"other=--tree {tmp_path} --config c.yaml", tmp_path / "cache")
    assert v.tree == tmp_path and v.extra == ("--config", "c.yaml")
    code = v.code
    (tmp_path / "router" / "a.py").write_text("x = 2\n")
    assert ag.source_hash(tmp_path) != code          # a source change is a new cache key
    # keyed by the files a simulation runs: a change elsewhere keeps the key, one there changes it
    mods = ["router/a.py"]
    (tmp_path / "router" / "live.py").write_text("y = 1\n")
    key = ag.source_hash(tmp_path, mods)
    (tmp_path / "router" / "live.py").write_text("y = 2\n")
    assert ag.source_hash(tmp_path, mods) == key
    (tmp_path / "router" / "a.py").write_text("x = 3\n")
    assert ag.source_hash(tmp_path, mods) != key
    for bad in ("noequals", "=--config x", "x=--tree"):
        with pytest.raises(ValueError):
            ag.parse_variant(bad, tmp_path)


def test_goal_a_is_two_percent_either_way():
    off = _fig(att=0.90, p50=0.200, p99=1.00)
    assert ag.judge(ag.parse_cell("A e4 s0"), _below(_fig(att=0.90, p50=0.204, p99=1.02), off))["a"].ok
    for worse in (_fig(att=0.87, p50=0.2, p99=1.0), _fig(att=0.9, p50=0.205, p99=1.0),
                  _fig(att=0.9, p50=0.2, p99=1.03)):
        assert ag.judge(ag.parse_cell("A e4 s0"), _below(worse, off))["a"].ok is False
    # better attainment does not buy a slower TTFT (the goal is "within 2 % of admission off")
    assert ag.judge(ag.parse_cell("A e4 s0"), _below(_fig(att=0.99, p50=0.3), off))["a"].ok is False


def test_goal_b_against_the_peak_and_docqa_takes_the_larger_off_point():
    runs = {"off@1": _fig(goodput=10.0), "on@1.5": _fig(goodput=9.0), "on@2": _fig(goodput=12.0),
            "on@3": _fig(goodput=9.5)}
    v = ag.judge(ag.parse_cell("agentic e4 s0"), runs)["b"]
    assert v.ok and "peak 10.00" in v.text
    runs["on@3"] = _fig(goodput=8.99)
    assert ag.judge(ag.parse_cell("agentic e4 s0"), runs)["b"].ok is False
    runs["on@3"] = _fig(goodput=9.5)
    runs["off@1.5"] = _fig(goodput=11.0)       # only docqa's peak reads it
    assert ag.judge(ag.parse_cell("agentic e4 s0"), runs)["b"].ok
    assert ag.judge(ag.parse_cell("docqa e4 s0"), runs)["b"].ok is False      # 9.0 / 11.0 < 0.9


def test_goals_c_and_d_thresholds_and_missing_runs():
    cell = ag.parse_cell("agentic e4 s0")
    assert ag.judge(cell, {"class@2": _fig(high=0.99)})["c"].ok
    assert ag.judge(cell, {"class@2": _fig(high=0.989)})["c"].ok is False
    assert ag.judge(cell, {"tenant@2": _fig(light=0.95)})["d"].ok
    assert ag.judge(cell, {"tenant@2": _fig(light=0.949)})["d"].ok is False
    v = ag.judge(cell, {})
    assert all(v[g].ok is None for g in "abcd")


def test_figures_read_a_simulator_row():
    row = {"slo_attainment": {"attainment": 0.9}, "ttft_s": {"p50": 0.1, "p99": 2.0},
           "admission": {"goodput_rps": 5.0, "shed": 3, "queued": 7,
                         "by_class": {"0": {"attainment": 0.5}, "1": {"attainment": 0.98}},
                         "by_tenant": {"heavy": {"attainment": 0.4}, "light": {"attainment": 0.97}}}}
    f = ag.figures(row)
    assert (f["attainment"], f["p50"], f["p99"], f["goodput"], f["shed"], f["high"], f["light"]) == \
        (0.9, 0.1, 2.0, 5.0, 3, 0.98, 0.97)


def test_a_tiny_cell_end_to_end_through_the_simulator_and_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(ag.WORKLOADS, "tiny", (("--workload", "agentic", "--requests", "40"), 10.0))
    cache = tmp_path / "cache"
    argv = ["--variant", "plain=", "--cells", "tiny e4 s0", "--goals", "c,d", "--cache", str(cache),
            "--jobs", "1", "--quiet", "--out", str(tmp_path / "v.json")]
    assert ag.main(argv) == 0
    out = capsys.readouterr().out
    assert "(c) high class" in out and "| tiny e4 s0 |" in out and "| c | " in out
    cached = sorted(cache.glob("*.json"))
    assert len(cached) == 2                         # class@2 and tenant@2
    stamps = [p.stat().st_mtime_ns for p in cached]
    verdicts = json.loads((tmp_path / "v.json").read_text())["tiny e4 s0 / plain"]
    assert verdicts["c"]["ok"] is not None and verdicts["d"]["ok"] is not None
    # the second harness reads the cache: same verdicts, no run rewritten
    assert ag.main(argv) == 0
    assert [p.stat().st_mtime_ns for p in sorted(cache.glob("*.json"))] == stamps
    assert json.loads((tmp_path / "v.json").read_text())["tiny e4 s0 / plain"] == verdicts
    assert ag.main(["--variant", "plain=", "--goals", "e", "--cache", str(cache)]) == 2
    assert ag.main([*argv, "--off-from", "nosuch"]) == 2


def test_the_probe_finds_the_admission_rule_and_not_the_live_proxy():
    mods = ag.simulator_modules(ag.REPO, ag.sys.executable)
    assert mods is not None
    assert "router/admission_rule.py" in mods and "simulate/cluster.py" in mods
    assert "router/proxy.py" not in mods and not any(m.startswith(".venv") for m in mods)


def test_the_probe_covers_the_trace_workloads_loader_and_data(tmp_path):
    """The conversation windows (A, B) run dplb_trace's loader and read the trace, which the
    generated workloads never touch: a change to either must be a new cache key."""
    mods = ag.simulator_modules(ag.REPO, ag.sys.executable)
    assert mods is not None
    trace = "dplb_trace/data/mooncake/conversation_trace.jsonl"
    assert "dplb_trace/mooncake.py" in mods and trace in mods and "simulate/generators.py" in mods
    for rel in ("dplb_trace/mooncake.py", trace):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    key = ag.source_hash(tmp_path, mods)
    for rel in ("dplb_trace/mooncake.py", trace):
        before = (tmp_path / rel).read_text()
        (tmp_path / rel).write_text(before + "y = 2\n")
        assert ag.source_hash(tmp_path, mods) != key
        (tmp_path / rel).write_text(before)
    assert ag.source_hash(tmp_path, mods) == key
