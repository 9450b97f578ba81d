"""dplb-shm-dump and dplb-shm CLIs: table, JSON, watch, discovery, layout mismatch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dplb_shm import LAYOUT_VERSION, Segment, WorkerState, discover, dump
from tests.helpers import ROOT


def _run(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", *args], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _fill(seg):
    w = seg.writer(1)
    w.claim(1, pid=4242, endpoint="/tmp/dplb-d/agent-1.sock", gpu_ids=[0, 1], model="sim")
    w.publish(state=WorkerState.READY, engine_pid=4343, num_running=3, num_waiting=2, kv_cache_usage=0.42,
              gpu_mem_used_bytes=7 * 10 ** 9, gpu_mem_total_bytes=80 * 10 ** 9)
    w.inflight_add(4)
    w.record_latency(ttft_ms=120.0, tpot_ms=15.0, e2e_ms=900.0)
    seg.writer(6).claim(6, endpoint="127.0.0.1:8006")


def test_json_shape(segment, shm_name):
    _fill(segment)
    r = _run("dplb_shm.dump", "--shm", shm_name, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["version"] == LAYOUT_VERSION and doc["num_slots"] == 16
    assert [w["worker_id"] for w in doc["workers"]] == [1, 6]
    w = doc["workers"][0]
    for key in ("worker_id", "state", "heartbeat_age_ms", "inflight", "num_running", "num_waiting",
                "kv_cache_usage", "gpu_mem_used_bytes", "gpu_mem_total_bytes", "ttft_ms", "tpot_ms"):
        assert key in w
    assert (w["state"], w["inflight"], w["num_running"], w["num_waiting"]) == ("ready", 4, 3, 2)
    assert w["kv_cache_usage"] == 0.42 and w["ttft_ms"] == 120.0 and w["tpot_ms"] == 15.0
    assert w["gpu_mem_total_bytes"] == 80 * 10 ** 9 and w["endpoint"] == "/tmp/dplb-d/agent-1.sock"
    assert (w["pid"], w["agent_pid"], w["engine_pid"], w["model"]) == (4242, 4242, 4343, "sim")
    assert doc["workers"][1]["state"] == "starting"
    r = _run("dplb_shm.dump", "--shm", shm_name, "--json", "--all")
    assert len(json.loads(r.stdout)["workers"]) == 16


def test_table(segment, shm_name):
    _fill(segment)
    r = _run("dplb_shm.dump", "--shm", shm_name)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert shm_name in lines[0] and lines[1].split()[:5] == ["id", "state", "agent_pid", "engine_pid", "model"]
    assert lines[2].split()[:7] == ["1", "ready", "4242", "4343", "sim", lines[2].split()[5], "3"]
    assert "42.0" in lines[2] and "/tmp/dplb-d/agent-1.sock" in lines[2]
    assert lines[3].split()[:5] == ["6", "starting", str(os.getpid()), "-", "-"] and len(lines) == 4


def test_watch_redraws(segment, shm_name):
    _fill(segment)
    p = subprocess.Popen([sys.executable, "-m", "dplb_shm.dump", "--shm", shm_name, "--watch", "0.05", "--json"],
                         cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        docs = [json.loads(p.stdout.readline()) for _ in range(3)]
        segment.writer(1).publish(num_running=99)
        for _ in range(200):
            doc = json.loads(p.stdout.readline())
            if doc["workers"][0]["num_running"] == 99:
                break
        else:
            pytest.fail("watch never showed the new state")
        assert all(d["workers"][0]["worker_id"] == 1 for d in docs)
    finally:
        p.kill()
        p.wait(10)


def test_wrong_version_exit_2_one_line_naming_both(shm_name):
    seg = Segment.create(shm_name, num_slots=2)
    seg.close()
    with open(f"/dev/shm/{shm_name}", "r+b") as f:
        f.seek(8)
        f.write((LAYOUT_VERSION + 1).to_bytes(4, "little"))
    r = _run("dplb_shm.dump", "--shm", shm_name)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert "\n" not in err
    assert f"version {LAYOUT_VERSION + 1}" in err and f"version {LAYOUT_VERSION}" in err


def test_wrong_magic_exit_2(shm_name):
    with open(f"/dev/shm/{shm_name}", "wb") as f:
        f.write(b"X" * 4096)
    r = _run("dplb_shm.dump", "--shm", shm_name)
    assert r.returncode == 2 and "magic" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_segment_exit_1(shm_name):
    r = _run("dplb_shm.dump", "--shm", shm_name)
    assert r.returncode == 1 and "no segment" in r.stderr


def test_discovery_finds_segments_by_magic(tmp_path, segment, shm_name):
    with open(f"/dev/shm/{shm_name}", "rb") as f:
        seg_bytes = f.read(64)
    (tmp_path / "dplb-a").write_bytes(seg_bytes)
    (tmp_path / "other").write_bytes(b"\0" * 64)
    (tmp_path / "tiny").write_bytes(b"DP")
    found = discover.list_segments(str(tmp_path))
    assert [(i.name, i.version, i.num_slots, i.compatible) for i in found] == [("dplb-a", LAYOUT_VERSION, 16, True)]


def test_auto_discovery_uses_the_only_segment(segment, shm_name, monkeypatch, capsys):
    _fill(segment)
    monkeypatch.setattr(dump, "list_segments",
                        lambda: [discover.SegmentInfo(shm_name, LAYOUT_VERSION, 16, 0)])
    assert dump.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == shm_name


def test_auto_discovery_lists_several_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(dump, "list_segments", lambda: [discover.SegmentInfo("dplb-1", 1, 4, 0),
                                                        discover.SegmentInfo("dplb-2", 1, 4, 0)])
    with pytest.raises(SystemExit) as ei:
        dump.main([])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "dplb-1" in err and "dplb-2" in err


def test_dplb_shm_cli_create_list_unlink(shm_name):
    r = _run("dplb_shm", "create", "--name", shm_name, "--slots", "64")
    assert r.returncode == 0, r.stderr
    assert oct(os.stat(f"/dev/shm/{shm_name}").st_mode & 0o777) == "0o600"
    assert _run("dplb_shm", "create", "--name", shm_name).returncode == 1
    assert _run("dplb_shm", "create", "--name", shm_name, "--replace").returncode == 0
    r = _run("dplb_shm", "list")
    assert any(line.startswith(shm_name + "\t") and "slots=64" in line for line in r.stdout.splitlines())
    assert _run("dplb_shm", "unlink", "--name", shm_name).returncode == 0
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    assert _run("dplb_shm", "unlink", "--name", shm_name).returncode == 1
    assert _run("dplb_shm", "unlink", "--name", shm_name, "--missing-ok").returncode == 0
