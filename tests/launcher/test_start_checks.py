"""Checks of the launcher's start-up in-process (issue 31): it refuses to start when /dev/shm cannot
hold the segment (a container's /dev/shm is 64 MB unless ``--shm-size`` says otherwise) with a
clear error naming ``--shm-size`` before the segment is created, instead of the SIGBUS tmpfs deals
the first write past its limit; and its waiting loop never asks for a negative sleep."""
from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from launcher import host, supervisor
from launcher.errors import UsageError
from launcher.gpus import GpuPlan
from launcher.host import check_shm_space, segment_bytes
from launcher.plan import LaunchPlan
from launcher.supervisor import Supervisor
from tests.helpers import free_port


def test_segment_bytes_is_the_size_of_a_created_segment(shm_name):
    """128 + num_slots x 1536 (csrc/dplb_shm.h), checked against what the extension creates."""
    from dplb_shm import Segment

    assert segment_bytes(64) == 128 + 64 * 1536 == 98_432
    seg = Segment.create(shm_name, num_slots=7)
    try:
        assert os.stat(f"/dev/shm/{shm_name}").st_size == segment_bytes(7)
    finally:
        seg.close()


def _statvfs(free_bytes: int, total_bytes: int = 64 * 1024):
    return lambda path: SimpleNamespace(f_bavail=free_bytes // 4096, f_frsize=4096, f_blocks=total_bytes // 4096)


def test_too_small_shm_is_a_usage_error_naming_shm_size(monkeypatch, tmp_path):
    monkeypatch.setattr(host.os, "statvfs", _statvfs(64 * 1024))
    with pytest.raises(UsageError) as ei:
        check_shm_space(tmp_path, "dplb-30000", 64)
    msg = str(ei.value)
    assert "--shm-size" in msg and "shm_size" in msg and "dplb-30000" in msg
    assert "64.0 KiB free" in msg and "96.1 KiB" in msg and "64 slots" in msg
    assert ei.value.exit_code == 2


def test_enough_shm_passes_and_a_stale_segment_of_the_name_counts_as_free(monkeypatch, tmp_path):
    monkeypatch.setattr(host.os, "statvfs", _statvfs(100 * 1024))
    check_shm_space(tmp_path, "dplb-30000", 64)          # 100 KiB >= 96.1 KiB
    monkeypatch.setattr(host.os, "statvfs", _statvfs(4096))
    stale = tmp_path / "dplb-30000"
    stale.write_bytes(b"\1" * segment_bytes(64))          # the launch unlinks it before creating its own
    check_shm_space(tmp_path, "dplb-30000", 64)
    with pytest.raises(UsageError):
        check_shm_space(tmp_path, "dplb-other", 64)


def test_unreadable_shm_dir_is_not_checked(tmp_path):
    check_shm_space(tmp_path / "missing", "dplb-30000", 64)


def test_launch_stops_before_creating_the_segment(monkeypatch, run_dir):
    """Supervisor.start raises the error and never calls ``create`` (nothing started, nothing left)."""
    created: list[str] = []

    class Seg:
        @staticmethod
        def create(name, num_slots, replace):
            created.append(name)
            raise AssertionError("the segment must not be created")

    monkeypatch.setattr(host.os, "statvfs", _statvfs(16 * 1024))
    monkeypatch.setattr(supervisor, "become_subreaper", lambda: None)
    port = free_port()
    cfg = LaunchPlan(num_workers=1, plan=GpuPlan(num_workers=1, groups=[[]], tp_size=0), engine="sim",
                       port=port, run_dir=Path(run_dir) / "rd", shm_name=f"dplb-{port}")
    sup = Supervisor(cfg, out=io.StringIO(), segment_api=Seg)
    try:
        with pytest.raises(UsageError, match="--shm-size"):
            sup.start()
        assert created == [] and sup.agents == [] and sup.router is None
    finally:
        sup.shutdown()
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_sleep_never_asks_for_a_negative_sleep(monkeypatch):
    """Regression (found by the container test, where the launch died with ``ValueError: sleep
    length must be non-negative`` on a busy machine): the clock passing ``end`` between the loop's
    reads made ``_sleep`` compute a negative length."""
    clock = iter([0.0, 0.2, 0.24, 0.3, 0.3, 0.3, 0.3])
    slept: list[float] = []
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: next(clock))

    def fake_sleep(s: float) -> None:
        if s < 0:
            raise ValueError("sleep length must be non-negative")
        slept.append(s)

    monkeypatch.setattr(supervisor.time, "sleep", fake_sleep)
    cfg = LaunchPlan(num_workers=1, plan=GpuPlan(num_workers=1, groups=[[]], tp_size=0), engine="sim")
    Supervisor(cfg, out=io.StringIO())._sleep(0.25)
    assert all(0 < s <= 0.05 for s in slept), slept
