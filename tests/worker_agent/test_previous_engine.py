"""An agent started in a dead agent's place re-attaches to the engine the dead one started when it
still runs at the same address (the engine outlives its agent); an engine it cannot re-attach is
stopped before a fresh one starts, so the two never share the worker's socket or GPU; a pid the
file names that another process reuses now is left alone."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

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


def _stream(endpoint: str, out: dict) -> None:
    """One streamed completion straight to the engine: its text pieces and finish reason in ``out``."""
    import orjson

    from tests.worker_agent.conftest import endpoint_client

    pieces, finish = [], None
    with endpoint_client(endpoint, timeout=120) as c, c.stream(
            "POST", "/v1/completions", json={"model": "sim-llama-3.1-8b", "prompt": "a b c", "max_tokens": 150,
                                             "stream": True, "ignore_eos": True}) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = orjson.loads(line[6:])["choices"][0]
                pieces.append(ch.get("text", ""))
                finish = ch.get("finish_reason") or finish
    out.update(pieces=len(pieces), finish=finish)


def test_an_agent_killed_by_sigkill_leaves_its_engine_serving_and_the_next_agent_reattaches(start_agent, segment,
                                                                                            run_dir):
    """kill -9 of an agent sent its engine SIGTERM (``PR_SET_PDEATHSIG``): the stream it served ended
    ``finish_reason: "abort"`` after a few tokens and the new agent started a fresh engine. Now the
    engine keeps serving and the next agent re-attaches to it (same engine pid)."""
    import signal
    import threading

    a = start_agent(0, interval_ms=50, engine_args=["--base-step-ms", "20"])
    s0 = segment.read_slot(0)
    engine = s0.engine_pid
    assert engine > 0
    with open(os.path.join(run_dir, "engine-0.pid")) as f:
        assert f.read().split()[2] == f"unix:{s0.endpoint}"      # pid, start time, address
    out: dict = {}
    t = threading.Thread(target=_stream, args=(s0.endpoint, out), daemon=True)
    try:
        t.start()
        wait_until(lambda: segment.read_slot(0).num_running >= 1 or not t.is_alive(), timeout=30,
                   what="the stream running on the engine")
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(10)
        time.sleep(0.5)
        assert psutil.pid_exists(engine) and psutil.Process(engine).status() != psutil.STATUS_ZOMBIE
        b = start_agent(0, interval_ms=50, engine_args=["--base-step-ms", "20"], wait_ready=False)
        wait_until(lambda: (segment.read_slot(0).pid, segment.read_slot(0).state.name) == (b.proc.pid, "READY")
                   or b.proc.poll() is not None, timeout=60, what="the new agent READY")
        s1 = segment.read_slot(0)
        assert (s1.pid, s1.engine_pid, s1.state.name) == (b.proc.pid, engine, "READY")
        assert (s1.agent_restarts, s1.restarts) == (1, 0)   # an agent restart, not an engine's
        assert f"re-attaching to engine sim (pid {engine})" in b.log_text()
        t.join(120)
        assert out.get("status") == 200 and out.get("finish") == "length" and out.get("pieces", 0) >= 150, out
    finally:
        with contextlib.suppress(OSError):
            os.killpg(engine, signal.SIGKILL)


def test_an_engine_recorded_at_another_address_is_not_reattached(procs, run_dir):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        a = _adapter(run_dir)
        with open(a.pid_path, "w") as f:
            f.write(f"{other.pid} {psutil.Process(other.pid).create_time()!r} unix:/elsewhere/engine-2.sock\n")
        assert a.previous_engine() is not None and not a.adopt_previous() and not a.adopted
        with open(a.pid_path, "w") as f:
            f.write(f"{other.pid} {psutil.Process(other.pid).create_time()!r} unix:{a.socket_path}\n")
        assert a.adopt_previous() and a.engine_pid == other.pid
        other.kill()
        other.wait(5)
        assert a.engine_pid == 0 and asyncio.run(asyncio.wait_for(a.wait_exit(), 10)) is None
    finally:
        if other.poll() is None:
            other.kill()
        other.wait(5)
