"""A segment removed while the launch runs (issue 46, item 1: "the segment gone").

The failure: ``/dev/shm/dplb-<port>`` deleted under a running launch (a cleanup script, an
operator's ``rm``) left a killed agent never restarted and nothing said why. A removed POSIX shm
name cannot be linked again to the memory the router and the agents have mapped, and a new
segment under the name would split the router (reading the old memory) from new agents (writing
the new one), so the launcher does not restart that agent: it says so on one line, naming the
segment and what to do; the router and the other agents keep serving on the segment they have
mapped; the stop still ends cleanly (exit 0, the orphaned engine stopped)."""
from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

from tests.helpers import launched, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_removed_segment_is_explained_and_the_launch_keeps_serving():
    from dplb_shm import Segment

    seen: set[int] = set()
    with launched("--num-workers", "2", "--engine", "sim", "--time-scale", "4", "--agent-restart-backoff", "0.3",
                  prefix="dplb-t-segrm-", seen=seen) as L:
        seg = Segment.attach(L.shm, readonly=True)
        try:
            s0 = seg.read_slot(0)
            agent, engine = int(s0.pid), int(s0.engine_pid)
        finally:
            seg.close()
        seen.add(engine)
        os.unlink(f"/dev/shm/{L.shm}")
        os.kill(agent, signal.SIGKILL)
        wait_until(lambda: "its agent is not restarted: the segment" in L.out(), timeout=120,
                   what="the launcher's line about the removed segment")
        out = L.out()
        assert f"/dev/shm/{L.shm} was removed" in out and "start it again to recreate the segment" in out, out[-3000:]
        # the others serve on: the router routes around worker 0 (its agent is dead) to worker 1
        body = {"model": "sim-llama-3.1-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        answers = [httpx.post(f"http://127.0.0.1:{L.port}/v1/chat/completions", json=body, timeout=60)
                   for _ in range(6)]
        assert [r.status_code for r in answers] == [200] * 6, [r.text[:200] for r in answers]
        assert {r.headers.get("x-dplb-worker-id") for r in answers} == {"1"}
        # the stop is clean: exit 0, every engine stopped (the orphaned one too)
        os.kill(L.proc.pid, signal.SIGINT)
        assert L.proc.wait(120) == 0, L.logs()
        wait_until(lambda: not _alive(engine), timeout=60, what=f"worker 0's orphaned engine {engine} stopped")
