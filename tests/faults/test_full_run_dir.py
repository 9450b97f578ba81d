"""A full file system under the run dir kept a dead agent from coming back: the launcher's log
header write and the agent's pid-file write raised ENOSPC. Now logging degrades and serving does
not: the child starts, the engine is recorded when it can be. ``/dev/full`` stands in for a full
file system (every write fails with ENOSPC)."""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

from launcher.children import start_child
from worker_agent.adapters import SimAdapter
from worker_agent.config import parse_args

pytestmark = [pytest.mark.faults]


def test_a_child_starts_when_its_log_cannot_be_written(tmp_path):
    log, ran = tmp_path / "agent-0.log", tmp_path / "ran"
    os.symlink("/dev/full", log)
    c = start_child("worker 0", [sys.executable, "-c", f"open({str(ran)!r}, 'w').write('yes')"], log,
                    dict(os.environ))   # before: ENOSPC from the log's header line, no child at all
    assert c.wait(30) == 0 and ran.read_text() == "yes"


def test_the_engines_pid_file_on_a_full_disk_is_a_warning_not_a_failure(tmp_path, caplog):
    run_dir = str(tmp_path)
    a = SimAdapter(parse_args(["--worker-id", "2", "--shm", "dplb-x", "--uds", f"{run_dir}/agent-2.sock",
                               "--engine", "sim", "--run-dir", run_dir]))
    os.symlink("/dev/full", a.pid_path + ".tmp")
    caplog.set_level(logging.WARNING, logger="worker_agent.engine")
    a._write_pid_file(os.getpid())                   # ENOSPC inside: logged, not raised
    assert not Path(a.pid_path).exists()
    assert any("cannot record the engine's pid" in r.getMessage() for r in caplog.records)
    os.symlink("/nonexistent-dir/engine-2.log", a.log_path)   # the engine log cannot be opened
    fd = a._open_log()                               # /dev/null instead
    try:
        assert os.path.realpath(f"/proc/self/fd/{fd}") == "/dev/null"
    finally:
        os.close(fd)
