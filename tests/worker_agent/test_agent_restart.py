"""Engine restarts by the agent (issue 15): backoff, bounded count per window, admin restart.

Each test starts one agent with a real sim engine (fixtures in tests/worker_agent/conftest.py);
every process is killed and the segment unlinked at teardown. Waits are generous (a busy 2-core
machine starts a sim engine in one to several seconds); nothing asserts a tight time.
"""
from __future__ import annotations

import os
import signal
import time

import psutil

from tests.worker_agent.conftest import endpoint_client, slot_wait
from worker_agent.agent import RestartPolicy

MODEL = "sim-llama-3.1-8b"


def engine_pid(agent_pid: int) -> int:
    for c in psutil.Process(agent_pid).children():
        if "sim_engine" in " ".join(c.cmdline()):
            return c.pid
    raise LookupError("no engine")


def test_restart_policy_backs_off_exponentially_and_gives_up_past_the_window_budget():
    now = [0.0]
    p = RestartPolicy(max_restarts=3, window_s=100.0, backoff_s=1.0, backoff_max_s=3.0, clock=lambda: now[0])
    assert [p.failure(), p.failure(), p.failure()] == [1.0, 2.0, 3.0]    # doubled, capped at 3
    assert p.failure() is None                                          # 4th within 100 s: give up
    now[0] = 250.0                                                      # the old failures left the window
    assert p.failures_in_window() == 0 and p.failure() == 1.0
    p.reset()
    assert p.failures_in_window() == 0
    assert RestartPolicy(max_restarts=0).failure() is None              # restarts disabled


def test_killed_engine_is_restarted_after_backoff_and_serves_again(start_agent, segment):
    a = start_agent(0, "--restart-backoff", "0.5", interval_ms=50)
    old = engine_pid(a.proc.pid)
    ready = segment.read_slot(0)
    assert (ready.engine_pid, ready.agent_pid) == (old, a.proc.pid)     # the engine's pid, not only the agent's
    os.kill(old, signal.SIGKILL)
    dead = slot_wait(segment, 0, lambda s: s.state.name == "DEAD", 10, "slot DEAD")
    assert dead.engine_pid == 0                                       # no engine runs
    assert dead.state_reason.name == "ENGINE_EXITED" and dead.last_exit_code == -signal.SIGKILL
    assert dead.num_running == 0 and dead.kv_cache_usage == -1.0     # the dead engine's figures are gone
    s = slot_wait(segment, 0, lambda s: s.state.name == "READY", 60, "READY again after the restart")
    assert s.restarts == 1 and s.state_reason.name == "NONE" and s.last_exit_code == -9
    assert s.pid == a.proc.pid                                        # same agent, same slot
    assert engine_pid(a.proc.pid) != old and s.engine_pid == engine_pid(a.proc.pid)
    with endpoint_client(s.endpoint) as c:    # the engine itself, at the address the slot names
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "a b c", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"]
    log = a.log_text()
    assert "exited unexpectedly with code -9 (killed by SIGKILL (-9)" in log and "restarting engine" in log
    assert "last lines" in log                                        # the engine log's tail is in the agent log


def test_engine_that_keeps_failing_stays_dead_gave_up_until_admin_restart(start_agent, segment):
    a = start_agent(1, "--restart-max", "2", "--restart-backoff", "0.1", engine_args=["--no-such-flag"],
                    wait_ready=False, interval_ms=50)
    s = slot_wait(segment, 1, lambda s: s.state.name == "DEAD" and s.state_reason.name == "GAVE_UP", 60,
                  "DEAD, gave up")
    assert s.restarts == 2 and s.last_exit_code == 2 and s.next_restart_ns == 0
    time.sleep(0.5)
    assert segment.read_slot(1).restarts == 2                         # no further attempt on its own
    assert "giving up" in a.log_text()
    with a.client() as c:
        r = c.post("/dplb/restart")
        assert r.status_code == 202 and r.json()["restarting"] is True
    # the operator's restart runs the engine again (it fails again, with a fresh budget)
    slot_wait(segment, 1, lambda s: s.restarts >= 3, 30, "admin restart attempted")


def test_admin_restart_of_a_healthy_engine_comes_back_ready_with_a_new_engine(start_agent, segment):
    a = start_agent(2, interval_ms=50)
    old = engine_pid(a.proc.pid)
    with a.client() as c:
        r = c.post("/dplb/restart")
        assert r.status_code == 202 and r.json()["state"] == "ready"
    slot_wait(segment, 2, lambda s: s.restarts == 1, 30, "restart counted")
    s = slot_wait(segment, 2, lambda s: s.state.name == "READY", 60, "READY after the admin restart")
    assert s.restarts == 1 and s.last_exit_code == 0                  # not a crash
    assert engine_pid(a.proc.pid) != old
    assert not psutil.pid_exists(old) or psutil.Process(old).status() == psutil.STATUS_ZOMBIE
