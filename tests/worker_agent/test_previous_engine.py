"""An agent started in a dead agent's place (issue 27 item 5) never shares its worker's socket or
GPU with the old engine: what still runs of the engine the pid file names is stopped first; a pid
the file names that another process reuses now is left alone."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import psutil

from tests.helpers import wait_until
from worker_agent.adapters import SimAdapter
from worker_agent.config import parse_args


def _adapter(run_dir: str) -> SimAdapter:
    return SimAdapter(parse_args(["--worker-id", "2", "--shm", "dplb-x", "--uds", f"{run_dir}/agent-2.sock",
                                  "--engine", "sim", "--run-dir", run_dir]))


def _gone(p: subprocess.Popen) -> bool:
    return p.poll() is not None


def test_the_engine_a_dead_agent_left_running_is_stopped_before_a_fresh_one(procs, run_dir):
    # the old engine: ignores SIGTERM for a while (a real engine freeing its GPU), in a session of its own
    code = "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); time.sleep(600)"
    old = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        a = _adapter(run_dir)
        a._write_pid_file(old.pid)
        assert a.previous_engine() is not None and a.previous_engine().pid == old.pid
        assert asyncio.run(a.stop_previous(timeout_s=0.5)) is True
        wait_until(lambda: _gone(old), timeout=10, what="the old engine gone (SIGKILL after the grace)")
        assert not os.path.exists(a.pid_path)
        assert asyncio.run(a.stop_previous()) is False        # nothing left: a no-op
    finally:
        if old.poll() is None:
            old.kill()
        old.wait(5)


def test_a_reused_pid_is_left_alone(procs, run_dir):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        a = _adapter(run_dir)
        with open(a.pid_path, "w") as f:   # the pid file's start time is not this process's
            f.write(f"{other.pid} {psutil.Process(other.pid).create_time() - 100.0!r}\n")
        assert a.previous_engine() is None
        assert asyncio.run(a.stop_previous()) is False
        assert other.poll() is None and not os.path.exists(a.pid_path)
    finally:
        other.kill()
        other.wait(5)
