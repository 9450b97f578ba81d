"""The harness end to end on real sim engines: rows, cleanup, failures recorded (slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.harness import Harness, engine_sets
from bench.run import (
    FULL_SYSTEMS,
    QUICK_SYSTEMS,
    apply_overrides,
    parse_args,
    select,
)
from bench.stats import ROW_KEYS
from bench.systems import SystemSpec, all_systems
from bench.workloads import QUICK
from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def _started_pids(log_root: Path) -> list[int]:
    pids = []
    for f in log_root.rglob("pids.txt"):
        pids += [int(line.split()[0]) for line in f.read_text().splitlines() if line.strip()]
    return pids


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _dplb_segments(pid: int) -> set[str]:
    """Segments left by the harness running as ``pid`` (the harness names them dplb-bench-<pid>-...)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"dplb-bench-{pid}-")}


def test_direct_and_dplb_rows_and_cleanup(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench.run", "--systems", "direct,dplb/round_robin",
           "--workloads", "e_burst,f_overhead", "--no-scaling", "--out", str(out), "-q", "--repeats", "2",
           "--set", "burst_requests=24", "--set", "overhead_requests=40"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    rows = json.loads((out / "latest.json").read_text())
    assert all(tuple(row) == ROW_KEYS for row in rows)
    by = {(row["system"], row["workload"]): row for row in rows if row["repeat"] == 0}
    # direct runs only the overhead workload, on one engine; every workload twice (--repeats 2)
    assert set(by) == {("direct", "f_overhead"), ("dplb", "e_burst"), ("dplb", "f_overhead")}
    assert sorted((r["system"], r["workload"], r["repeat"]) for r in rows) == sorted(
        (s, w, k) for s, w in by for k in (0, 1))
    assert by[("direct", "f_overhead")]["router_cpu_s_per_1k"] is None
    burst = by[("dplb", "e_burst")]
    assert burst["requests"] == 24 and burst["errors"] == 0
    assert burst["output_tok_s"] > 0 and burst["ttft_p50_ms"] <= burst["ttft_p99_ms"] <= burst["e2e_p99_ms"]
    # round robin over 4 idle engines: 6 requests each, counted by the engines themselves
    assert burst["max_share"] == pytest.approx(0.25) and burst["min_share"] == pytest.approx(0.25)
    assert by[("dplb", "f_overhead")]["requests"] == 40 and by[("dplb", "f_overhead")]["errors"] == 0
    # measured for a routed system (None for direct); it may read 0: 40 tiny requests can cost the
    # router less than one clock tick (10 ms) of CPU, the resolution of /proc's cpu times
    cpu = by[("dplb", "f_overhead")]["router_cpu_s_per_1k"]
    assert isinstance(cpu, float) and cpu >= 0.0
    md = (out / "latest.md").read_text()
    assert "python -m bench.run --systems direct,dplb/round_robin" in md and "## Router overhead" in md and "(f) tiny non-streaming" in md
    assert (out / "share_e.png").exists()
    # everything it started is gone, and so is the segment
    pids = _started_pids(out / "tmp")
    assert len(pids) >= 4 + 4 + 1 + 4  # engines (x2 sets), agents, router
    assert [pid for pid in pids if _alive(pid)] == []
    assert _dplb_segments(p.pid) == set()


def test_a_system_that_cannot_start_becomes_failed_rows(tmp_path):
    profile = apply_overrides(QUICK, ["burst_requests=4"])
    h = Harness(profile, engine_sets(0.5, 1)["main"][0], tmp_path, tmp_path / "logs", verbose=False)
    h.run_group(SystemSpec("dplb", "no_such_policy"), ["e_burst"], "main")
    assert len(h.rows) == 1
    row = h.rows[0]
    assert row["requests"] == 4 and row["errors"] == 4 and row["ttft_p50_ms"] is None
    assert h.notes and "dplb/no_such_policy" in h.notes[0]
    assert [p for p in _started_pids(tmp_path / "logs") if _alive(p)] == []
    assert _dplb_segments(os.getpid()) == set()


def test_selection_flags():
    systems, workloads = select(parse_args(["--systems", "sglang/cache_aware,direct", "--workloads", "e_burst"]))
    assert [s.label for s in systems] == ["sglang/cache_aware", "direct"] and workloads == ["e_burst"]
    with pytest.raises(SystemExit):
        select(parse_args(["--systems", "nginx/round_robin"]))
    with pytest.raises(SystemExit):
        select(parse_args(["--workloads", "z_unknown"]))
    quick = [s.label for s in select(parse_args(["--quick"]))[0]]
    assert quick == list(QUICK_SYSTEMS) and "smg/least_load" in quick
    assert len(select(parse_args(["--quick", "--systems", "all"]))[0]) == len(all_systems())
    labels = [s.label for s in select(parse_args([]))[0]]
    assert labels == list(FULL_SYSTEMS)
    # DPLB's field policies run beside the Rust routers that ship the same idea
    assert {"dplb/least_load", "smg/least_load", "sglang/cache_aware", "smg/cache_aware", "dplb/kv_cost",
            "dplb/lmetric", "dplb/session"} <= set(labels)


def test_measured_add_accumulates_batches():
    from bench.harness import Measured
    from bench.loadgen import Result

    def res(n):
        return [Result(True, 200, 0.0, 0.01, 0.01, 1, None, "")] * n

    keys = ("vllm:request_success_total", "vllm:prefix_cache_hits_total")
    m = Measured(res(2), 1.0, [], 0.0, 0.0)
    m.add(Measured(res(3), 2.0, [dict.fromkeys(keys, 1.0), dict.fromkeys(keys, 2.0)], 0.5, 0.2))
    m.add(Measured(res(1), 0.5, [dict.fromkeys(keys, 1.0), dict.fromkeys(keys, 0.0)], 0.25, None))
    assert len(m.results) == 6 and m.wall == 3.5
    assert m.deltas == [dict.fromkeys(keys, 2.0), dict.fromkeys(keys, 2.0)]
    assert m.cpu == 0.75 and m.router_cpu == 0.2
    nothing = Measured([], 0.0, [], None, None)
    nothing.add(Measured(res(1), 1.0, [], 0.3, 0.3))
    assert nothing.cpu is None  # a system without a router never gets a routing CPU figure


def test_vllm_router_gets_its_load_shape_and_nobody_else_does():
    from bench.harness import with_load_format
    flags = engine_sets(0.5, 1)["main"][0]
    assert "--get-load-format" not in with_load_format(flags, [SystemSpec("sglang", "cache_aware")]).argv(0)
    argv = with_load_format(flags, [SystemSpec("dplb", "dplb"), SystemSpec("vllm", "power_of_two")]).argv(0)
    assert argv[argv.index("--get-load-format") + 1] == "vllm"
    assert argv[:2] == ["--time-scale", "0.5"]
