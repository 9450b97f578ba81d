"""dplb-simulate's command line: flags, errors that name the culprit, table, JSON, plots, capacity."""
from __future__ import annotations

import json
import os

import pytest

from simulate.cli import build_parser, engine_configs, main

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def no_segment_left():
    yield
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"dplb-sim-{os.getpid()}-")] == []


@pytest.mark.parametrize("argv,fragment", [
    (["--policy", "nope"], "unknown nope"),
    (["--policy", "dplb,dplb"], "named twice"),
    (["--engines", "0"], "--engines 0"),
    (["--engine-slowdown", "1,x"], "--engine-slowdown"),
    (["--engine-override", "9:--slowdown 2"], "--engine-override"),
    (["--engine-override", "1:--bogus 2"], "invalid engine flags"),
    (["--rate-scale", "0"], "--rate-scale"),
    (["--find-capacity", "--slo-attainment", "0"], "--slo-attainment 0"),   # alone it searches Q 0.99, 0.9
    (["--num-gpu-blocks", "0"], "num_gpu_blocks"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, fragment, capsys):
    assert main(["--requests", "5", "--progress", "off", *argv]) == 2
    assert fragment in capsys.readouterr().err


def test_malformed_trace_line_exits_2_naming_the_line(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5}\n')
    assert main(["--trace", str(p), "--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert f"{p}:2:" in err and "missing field" in err
    assert main(["--trace", str(tmp_path / "missing.jsonl"), "--progress", "off"]) == 2


def test_engine_flags_slowdown_pattern_and_overrides():
    ns = build_parser().parse_args(["--engines", "5", "--engine-slowdown", "1,3", "--num-gpu-blocks", "5000",
                                    "--engine-override", "4:--num-gpu-blocks 900 --max-num-seqs 8"])
    eng = engine_configs(ns)
    assert [e.slowdown for e in eng] == [1, 3, 1, 3, 1]
    assert [e.num_gpu_blocks for e in eng] == [5000, 5000, 5000, 5000, 900]
    assert eng[4].max_num_seqs == 8 and eng[4].slowdown == 1 and eng[0].max_num_seqs == 256


def test_table_json_plots_and_capacity(tmp_path, capsys):
    # admission on (as shipped once on by default): on this window (the trace's first 60 requests,
    # bursts of long cold prompts on 2 engines) the queue used to answer 16 of 60 with 429 at their
    # deadline even at x0.25, and a 429 counts as an infinite TTFT (simulate/stats.py), so no rate
    # met TTFT p99 <= 20 s; a burst's late requests are now served late (admission.late_backlog_s)
    out = tmp_path / "sim.json"
    plots = tmp_path / "plots"
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("routing_policy:\n  w_affinity: 0.5\n")
    rc = main(["--requests", "60", "--engines", "2", "--policy", "round_robin,dplb", "--max-tokens-cap", "64",
               "--config", str(cfg), "--json-out", str(out), "--plot-dir", str(plots), "--progress", "off",
               "--find-capacity", "--slo-ttft-p99", "20", "--capacity-tolerance", "0.2", "--admission", "on"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "round_robin" in text and "dplb" in text and "capacity within TTFT p99 <= 20.0 s" in text
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["round_robin", "dplb"]
    for r in rows:
        assert r["settings"]["routing_policy"]["w_affinity"] == 0.5
        assert r["settings"]["max_tokens_cap"] == 64
        cap = r["capacity"]
        assert cap["capacity_rate_scale"] is not None and cap["capacity_requests_per_s"] > 0
        assert cap["slo"] == {"ttft_p99_s": 20.0, "tpot_p99_s": None}
        for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s", "output_tokens_per_s", "prefix_hit_rate",
                    "preemptions", "per_engine", "load_over_time"):
            assert key in r
    assert sorted(p.name for p in plots.iterdir()) == ["queue_dplb.png", "queue_round_robin.png", "ttft_cdf.png"]
    assert all(p.stat().st_size > 5000 for p in plots.iterdir())


def _row(policy: str, peak: int) -> dict:
    return {"policy": policy, "served": 10, "rejected": 0, "ttft_s": {"p50": 0.1, "p90": 0.2, "p99": 0.3},
            "tpot_s": {"p50": 0.01, "p99": 0.02}, "e2e_s": {"p50": 1.0, "p99": 2.0}, "queue_s": {"p50": 0.0},
            "output_tokens_per_s": 100.0, "prefix_hit_rate": 0.5, "preemptions": 0,
            "per_engine": {"max_share": 0.3, "min_share": 0.2, "max_min_ratio": 1.5},
            "load_over_time": {"t_s": [0.0, 1.0, 2.0, 3.0], "queue": [[0, peak, 1, 0], [0, 1, 1, 0]]}}


def test_every_table_column_has_its_header():
    """The table's last two columns (the largest/smallest engine share, their ratio) read as one
    header ``share max/min`` over two columns, one of them without a header (issue 32): each
    column now has its own, every cell sits under it, and the legend says what they hold."""
    from simulate.report import COLUMNS, LEGEND, row_cells, table

    head, line = table([_row("dplb", 3)]).splitlines()
    pos = 0
    for (name, width), cell in zip(COLUMNS, row_cells(_row("dplb", 3)), strict=True):
        assert len(cell) <= width and len(name) <= width, (name, cell)
        assert head[pos:pos + width].strip() == name and line[pos:pos + width].strip() == cell
        pos += width + 1
    assert [name for name, _ in COLUMNS][-2:] == ["share max/min", "ratio"]
    assert "share max/min" in LEGEND and "ratio" in LEGEND


def test_queue_plots_share_one_scale(tmp_path, monkeypatch):
    """The per-policy queue plots used each their own y scale, hiding the difference they exist to
    show (issue 32): every figure now has the range of the largest queue of all policies."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from simulate.report import plot, queue_scale

    ylims: dict[str, tuple[float, float]] = {}
    real = Figure.savefig

    def record(self, path, *a, **kw):
        ylims[str(path).rsplit("/", 1)[-1]] = tuple(float(v) for v in self.axes[0].get_ylim())
        return real(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", record)
    rows = [_row("round_robin", 12), _row("dplb", 3)]
    assert queue_scale(rows) == (3.0, 12.0)
    written = plot(rows, {"round_robin": [0.1, 0.2], "dplb": [0.1]}, tmp_path)
    assert len(written) == 3
    assert ylims["queue_round_robin.png"] == ylims["queue_dplb.png"]
    assert ylims["queue_dplb.png"][1] >= 12.0   # dplb's own peak is 3: its own scale would stop near 3
