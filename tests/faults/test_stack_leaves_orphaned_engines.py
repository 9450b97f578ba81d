"""The fault suite's stack left orphaned engines running (issue 46).

The failure: an engine outlives its agent by design (a killed agent's successor re-attaches to
it), so after a ``kill -9`` of an agent its engine is no longer a descendant of any process the
stack started; the stack's cleanup stopped its children's process groups and missed it (the old
"kill -9 of a whole worker" scenario leaked two sim engines that way). Now :meth:`Stack.close`
also stops the engines named in the run dir's ``engine-<K>.pid`` files, checked by pid and start
time as the agent checks them: a pid that now names another process is left alone.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from bench.faultsuite.cluster import Stack
from launcher.stack import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_the_stack_stops_the_engine_of_a_killed_agent_and_only_that():
    # a process that a stale pid file names with another start time: a reused pid, never touched
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    engine: psutil.Process | None = None
    try:
        with Stack() as st:
            a = st.agent(0, time_scale=1.0)
            engine = psutil.Process(a.engine_pid())
            with open(st.path("engine-7.pid"), "w") as f:
                f.write(f"{bystander.pid} {psutil.Process(bystander.pid).create_time() - 5:.3f}\n")
            os.kill(a.proc.pid, signal.SIGKILL)          # the agent alone: its engine lives on
            wait_for(lambda: a.proc.popen.poll() is not None, 30, "the agent dead")
            assert _alive(engine), "the engine must outlive its agent"
        wait_for(lambda: not _alive(engine), 30, f"the orphaned engine {engine.pid} stopped by the stack's cleanup")
        assert bystander.poll() is None, "a pid file naming another process (start time differs) must be left alone"
    finally:
        bystander.kill()
        bystander.wait()
        if engine is not None and _alive(engine):
            engine.kill()
