"""The supervisor's lifecycle with stand-in agents and router: ready banner, clean stop on SIGINT and
SIGTERM (engines included, segment unlinked), a failing worker stops the launch with its log."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, free_port, wait_until


def start(procs, run_dir: str, port: int, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    log = Path(run_dir) / "launcher.out"
    p = procs.start([sys.executable, "-m", "tests.launcher.run_fake_launch", "--port", str(port),
                     "--run-dir", os.path.join(run_dir, "rd"), "--start-timeout", "60", *args],
                    log=log, env=env, cwd=ROOT)
    return p, log


def banner_seen(log: Path) -> bool:
    return "DPLB ready" in log.read_text(errors="replace")


def engine_pids(run_dir: str, n: int) -> list[int]:
    return [int((Path(run_dir) / "rd" / f"engine-{k}.pid").read_text()) for k in range(n)]


def gone(pids: list[int]) -> bool:
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


@pytest.fixture
def port():
    port = free_port()
    yield port
    if os.path.exists(f"/dev/shm/dplb-{port}"):
        os.unlink(f"/dev/shm/dplb-{port}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ready_then_signal_stops_everything(procs, run_dir, port, sig):
    p, log = start(procs, run_dir, port, "--num-workers", "3", "--gpus", "0-5")
    wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
    out = log.read_text()
    assert p.poll() is None, out
    assert f"http://127.0.0.1:{port}/v1" in out and "curl -s" in out
    assert f"dplb-shm-dump --shm dplb-{port}" in out or f"dplb_shm.dump --shm dplb-{port}" in out
    assert "workers ready 3/3" in out
    assert os.path.exists(f"/dev/shm/dplb-{port}")
    engines = engine_pids(run_dir, 3)
    agents = [c.pid for c in psutil.Process(p.pid).children() if "fake_agent" in " ".join(c.cmdline())]
    for k in range(3):   # the operator learns which pid is the engine, which the agent (issue 32)
        line = next(x for x in out.splitlines() if x.startswith(f"dplb: worker {k}: READY, "))
        assert f"engine pid {engines[k]}, model fake-model" in line
        assert int(line.split("agent pid ")[1].split(",")[0]) in agents
    agent_logs = [(Path(run_dir) / "rd" / f"agent-{k}.log").read_text() for k in range(3)]
    for k, text in enumerate(agent_logs):  # 6 GPUs, 3 workers → tp 2, consecutive pairs
        assert f"CUDA_VISIBLE_DEVICES={2 * k},{2 * k + 1}" in text and "'--tp-size', '2'" in text
    tree = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    assert len(tree) >= 4  # 3 agents + router
    assert "policy dplb" in out                                      # the banner names the policy
    os.kill(p.pid, sig)
    assert p.wait(timeout=60) == 0
    assert log.read_text().rstrip().splitlines()[-1].startswith("dplb: stopped")   # a last line after the stop
    wait_until(lambda: gone(engines + tree), timeout=20, what="children and engines gone")
    assert not os.path.exists(f"/dev/shm/dplb-{port}")
    assert not list((Path(run_dir) / "rd").glob("*.sock"))


def test_a_stop_drains_the_workers_while_the_router_still_relays(procs, run_dir, port):
    """The agents get the stop first and alone: through their whole drain the router answers and
    their engines run (requests in flight finish), then everything stops."""
    import json

    p, log = start(procs, run_dir, port, "--num-workers", "2", env={"FAKE_DRAIN_S": "1.5"})
    wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
    assert p.poll() is None, log.read_text()
    engines = engine_pids(run_dir, 2)
    tree = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(timeout=60) == 0, log.read_text()
    for k in range(2):
        seen = json.loads((Path(run_dir) / "rd" / f"drain-{k}.json").read_text())
        assert seen == {"begin": {"router": True, "engine": True}, "end": {"router": True, "engine": True}}, seen
    assert "waiting for the workers to drain their requests and stop" in log.read_text()
    wait_until(lambda: gone(engines + tree), timeout=20, what="children and engines gone")
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_failing_worker_stops_launch_with_its_log(procs, run_dir, port):
    p, log = start(procs, run_dir, port, "--num-workers", "2", env={"FAKE_FAIL": "1"})
    assert p.wait(timeout=90) == 1
    out = log.read_text()
    assert "worker 1 exited with status 3" in out
    assert "CUDA out of memory (simulated)" in out  # the log's last lines are shown
    assert "DPLB ready" not in out
    assert not os.path.exists(f"/dev/shm/dplb-{port}")
    wait_until(lambda: gone(engine_pids(run_dir, 1)), timeout=20, what="worker 0's engine gone")


def test_worker_marked_dead_stops_launch_without_waiting_for_the_timeout(procs, run_dir, port):
    p, log = start(procs, run_dir, port, "--num-workers", "2", env={"FAKE_DEAD": "0"})
    assert p.wait(timeout=50) == 1  # well before the 60 s start timeout
    out = log.read_text()
    assert "worker 0 marked its slot DEAD" in out and "engine exited with status 1 (simulated)" in out
    assert "engine-0.log ---" in out and "No module named 'vllm' (simulated)" in out  # the engine's log too
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_start_timeout_names_the_pending_worker(procs, run_dir, port):
    p, log = start(procs, run_dir, port, "--num-workers", "2", "--start-timeout", "3", env={"FAKE_NEVER": "0"})
    assert p.wait(timeout=90) == 1
    out = log.read_text()
    assert "not ready after 3 s" in out and "worker 0 (STARTING)" in out and "worker 1" not in out.split("waiting for")[1].split("\n")[0]
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_worker_dying_after_ready_is_reported_and_launch_keeps_serving(procs, run_dir, port):
    p, log = start(procs, run_dir, port, "--num-workers", "2", env={"FAKE_DIE_AFTER_READY": "1"})
    wait_until(lambda: "worker 1 exited with status 4" in log.read_text(), timeout=90, what="death report")
    assert p.poll() is None and "crashing" in log.read_text()
    engines = engine_pids(run_dir, 2)  # worker 1's engine is an orphan now: still stopped at the end
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0
    wait_until(lambda: gone(engines), timeout=20, what="engines gone")
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_a_killed_agent_is_restarted_into_its_slot(procs, run_dir, port):
    """Issue 27 item 5: the launcher printed the death of an agent and nothing else; its slot kept
    READY with a heartbeat growing old. Now the slot is DEAD (agent_exited) until the restart, after
    the backoff a new agent claims the same slot, and each step is one line."""
    from dplb_shm import Segment, StateReason, WorkerState

    p, log = start(procs, run_dir, port, "--num-workers", "2", "--agent-restart-backoff", "2")
    wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
    assert p.poll() is None, log.read_text()
    seg = Segment.attach(f"dplb-{port}", readonly=True)
    try:
        old = seg.read_slot(1).pid
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "worker 1 killed by SIGKILL (-9); restarting its agent in 2.0s (restart 1 of at most 5" in log.read_text(),
                   timeout=30, what="death line")
        s = seg.read_slot(1)
        # the agent's status is the launcher's line, not the engine's field (its engine never exited)
        assert (s.state, s.state_reason, s.exit_code, s.pid) == (WorkerState.DEAD, StateReason.AGENT_EXITED, None, old)
        assert s.next_restart_ns > 0 and s.num_running == 0
        wait_until(lambda: "worker 1: agent restarted (restart 1, pid" in log.read_text(), timeout=30, what="restart")
        wait_until(lambda: seg.read_slot(1).state == WorkerState.READY, timeout=30, what="slot 1 READY again")
        s = seg.read_slot(1)
        assert s.pid != old and s.state_reason == StateReason.NONE
        wait_until(lambda: "worker 1: READY again after agent restart 1" in log.read_text(), timeout=10, what="back line")
        assert seg.read_slot(0).state == WorkerState.READY   # the other worker never noticed
    finally:
        seg.close()
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_an_agent_that_keeps_dying_is_given_up_on_and_the_rest_serves(procs, run_dir, port):
    from dplb_shm import Segment, StateReason, WorkerState

    p, log = start(procs, run_dir, port, "--num-workers", "2", "--agent-restart-max", "1",
                   "--agent-restart-backoff", "0.2", env={"FAKE_DIE_AFTER_READY": "1"})
    wait_until(lambda: "not restarted again" in log.read_text() or p.poll() is not None, timeout=90, what="give-up")
    out = log.read_text()
    assert p.poll() is None, out
    assert "worker 1 exited with status 4; restarting its agent in 0.2s (restart 1 of at most 1 within 600s;" in out
    assert "worker 1: agent restarted (restart 1, pid" in out
    assert ("worker 1 exited with status 4; its agent died 2 times within 600s (--agent-restart-max 1): not "
            "restarted again") in out
    assert out.count("agent restarted (restart") == 1
    seg = Segment.attach(f"dplb-{port}", readonly=True)
    try:
        s = seg.read_slot(1)
        # the agent's status 4 is the launcher's line, not the engine's exit status
        assert (s.state, s.state_reason, s.exit_code) == (WorkerState.DEAD, StateReason.GAVE_UP, None)
        assert seg.read_slot(0).state == WorkerState.READY
    finally:
        seg.close()
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0


def test_engine_restart_by_an_agent_is_printed(procs, run_dir, port):
    """The launcher printed nothing when an agent's engine crashed and came back (issue 15)."""
    p, log = start(procs, run_dir, port, "--num-workers", "2", env={"FAKE_RESTART_AFTER_READY": "1"})
    wait_until(lambda: "READY again after engine restart 1" in log.read_text(), timeout=90, what="restart report")
    out = log.read_text()
    assert "worker 1: engine killed by SIGKILL (-9) (engine_exited); its agent restarts it in" in out
    assert "worker 1: engine restart 1 (engine_exited)" in out and "engine-1.log" in out
    assert "READY again after engine restart 1, agent pid " in out
    assert f"engine pid {engine_pids(run_dir, 2)[1]}, model fake-model" in out
    assert "worker 0: engine" not in out
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0


def test_stale_segment_is_replaced(procs, run_dir, port):
    from dplb_shm import Segment

    stale = Segment.create(f"dplb-{port}", num_slots=4)
    stale.close()
    p, log = start(procs, run_dir, port, "--num-workers", "1")
    wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
    assert p.poll() is None, log.read_text()
    seg = Segment.attach(f"dplb-{port}")
    try:
        assert seg.num_slots == 64
    finally:
        seg.close()
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_killed_launcher_takes_router_and_agents_with_it(procs, run_dir, port):
    p, log = start(procs, run_dir, port, "--num-workers", "2")
    wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
    assert p.poll() is None, log.read_text()
    children = [c.pid for c in psutil.Process(p.pid).children()]  # router + 2 agents
    engines = engine_pids(run_dir, 2)
    try:
        assert len(children) == 3
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        wait_until(lambda: gone(children), timeout=30, what="router and agents gone after the launcher died")
    finally:
        for pid in engines:  # the stand-in agents do not stop their engines (real agents do)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_second_launch_on_the_same_port_is_refused_and_leaves_the_first_intact(procs, run_dir, port, host):
    # issue 27 item 3: the refused second launch used to remove the running stack's sockets, and
    # with --host ::1 it was not refused at all and replaced the live segment
    p, log = start(procs, run_dir, port, "--num-workers", "2")
    wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
    assert p.poll() is None, log.read_text()
    (Path(run_dir) / "rd" / "agent-9.sock").touch()   # stands for the running stack's agent sockets
    socks = sorted((Path(run_dir) / "rd").glob("*.sock"))
    seg_ino = os.stat(f"/dev/shm/dplb-{port}").st_ino
    second = subprocess.run([sys.executable, "-m", "tests.launcher.run_fake_launch", "--port", str(port),
                             "--host", host, "--run-dir", os.path.join(run_dir, "rd"), "--num-workers", "1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode == 2, second.stderr
    assert f"belongs to a running DPLB launch (pid {p.pid})" in second.stderr
    assert sorted((Path(run_dir) / "rd").glob("*.sock")) == socks
    assert os.stat(f"/dev/shm/dplb-{port}").st_ino == seg_ino
    assert p.poll() is None
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(timeout=60) == 0
    assert not os.path.exists(f"/dev/shm/dplb-{port}")
    assert not (Path(run_dir) / "rd" / "launch.lock").exists()   # the locks go with their launch


def test_no_router_starts_the_workers_only_and_still_drains_them(procs, run_dir, port):
    """``--no-router`` (the agents' container of a split deployment): the segment and the workers,
    no router, the port may be taken by a router elsewhere; a stop still drains every worker (a
    router in another container may be relaying) and unlinks the segment."""
    import json
    import socket

    with socket.socket() as taken:                # the router of the other container listens here
        taken.bind(("127.0.0.1", port))
        taken.listen()
        p, log = start(procs, run_dir, port, "--num-workers", "2", "--no-router", env={"FAKE_DRAIN_S": "0.5"})
        wait_until(lambda: banner_seen(log) or p.poll() is not None, timeout=90, what="ready banner")
        out = log.read_text()
        assert p.poll() is None, out
        assert "no router (--no-router)" in out and f"dplb-router --shm dplb-{port} --port {port}" in out
        assert "router:" not in out.split("DPLB ready")[0]     # progress lines name no router
        assert not (Path(run_dir) / "rd" / "router.log").exists()
        assert os.path.exists(f"/dev/shm/dplb-{port}")
        os.kill(p.pid, signal.SIGINT)
        assert p.wait(timeout=60) == 0, log.read_text()
    for k in range(2):   # drained alone first: its engine ran through the drain (not stopped with it)
        seen = json.loads((Path(run_dir) / "rd" / f"drain-{k}.json").read_text())
        assert seen["begin"]["engine"] and seen["end"]["engine"], seen
    assert not os.path.exists(f"/dev/shm/dplb-{port}")
