"""The one owner of mirror slots (:class:`router.mirror.MirrorManager`, issue 27 item 7): a fetch that
returns after its slot was released writes nothing, a new leader adopts or releases a dead
leader's slots, a slot an agent took over is left to it."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import orjson
import pytest

from router.mirror import RECORD, MirrorManager
from tests.helpers import TimingOutTransport

A = "127.0.0.1:9101"
B = "127.0.0.1:9102"
STATE = orjson.dumps({"state": "ready", "model": "m", "num_running": 1, "num_waiting": 0})


class GatedTransport:
    """``get`` answers ``STATE`` once ``gate`` is set (set from the start unless told otherwise)."""

    def __init__(self, open_: bool = True) -> None:
        self.gate = asyncio.Event()
        if open_:
            self.gate.set()
        self.calls = 0

    async def get(self, endpoint: str, path: str, timeout: float, method: str = "GET") -> tuple[int, bytes]:
        self.calls += 1
        await self.gate.wait()
        return 200, STATE


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_fetch_that_returns_after_its_slot_was_released_writes_nothing(segment, tmp_path):
    """The leak of item 7: a state fetch out while a DELETE released the slot then published into
    it through its stale writer (a DEAD or READY slot that no one owned any more)."""
    async def run() -> None:
        t = GatedTransport(open_=False)
        m = MirrorManager(segment, t, str(tmp_path))
        m.wanted = {A: {"weight": 1.0}}
        assert m.leader()
        slot = m.slot_of(A)
        assert slot == 15 and segment.read_slot(15).control == A
        fetch = asyncio.ensure_future(m.refresh_one(A))
        await asyncio.sleep(0.01)
        assert t.calls == 1
        m.wanted = {}
        m.reconcile()                                   # the DELETE: released at once
        assert int(segment.read_slot(15).state) == 0
        t.gate.set()
        await fetch
        assert int(segment.read_slot(15).state) == 0    # the late answer wrote nothing
        assert m.read_record()["slots"] == {}
        m.close()

    asyncio.run(run())


def test_a_new_leader_adopts_a_dead_leaders_wanted_slots_and_releases_the_others(segment, tmp_path):
    old = dead_pid()
    for slot, ep in ((15, A), (14, B)):
        segment.writer(slot).claim(worker_id=slot, pid=old, endpoint=ep, control=ep)
    segment.writer(0).claim(worker_id=0, pid=old, endpoint="/run/e.sock", control="/run/a.sock")  # not a mirror
    (tmp_path / RECORD).write_bytes(orjson.dumps({"pid": old, "admin_version": 3, "errors": {},
                                                  "slots": {A: 15, B: 14}}))

    async def run() -> None:
        m = MirrorManager(segment, GatedTransport(), str(tmp_path))
        m.wanted = {A: {"weight": 1.0}}
        m.version = 4
        assert m.leader()
        assert segment.read_slot(15).pid == os.getpid() and segment.read_slot(15).control == A   # adopted
        assert int(segment.read_slot(14).state) == 0                                          # released
        assert segment.read_slot(0).pid == old and segment.read_slot(0).control == "/run/a.sock"  # untouched
        rec = m.read_record()
        assert rec == {"pid": os.getpid(), "admin_version": 4, "errors": {}, "slots": {A: 15}}
        await m.refresh()
        assert segment.read_slot(15).model == "m" and int(segment.read_slot(15).state) == 2
        m.close()
        assert int(segment.read_slot(15).state) == 0 and m.read_record()["slots"] == {}

    asyncio.run(run())


def test_a_mirror_slot_an_agent_claimed_is_left_to_it_and_the_mirror_moves(segment, tmp_path):
    async def run() -> None:
        m = MirrorManager(segment, GatedTransport(), str(tmp_path))
        m.wanted = {A: {"weight": 1.0}}
        assert m.leader() and m.slot_of(A) == 15
        segment.writer(15).claim(worker_id=15, pid=4242, endpoint="/run/e15.sock", control="/run/a15.sock")
        await m.refresh()                                # its owner mark is gone: writes nothing
        assert segment.read_slot(15).pid == 4242 and segment.read_slot(15).model == ""
        m.reconcile()
        assert m.slot_of(A) == 14 and segment.read_slot(14).control == A
        assert segment.read_slot(15).control == "/run/a15.sock"
        m.close()
        assert int(segment.read_slot(14).state) == 0 and segment.read_slot(15).pid == 4242

    asyncio.run(run())


def test_no_free_slot_is_recorded_as_the_reason(shm_name, tmp_path):
    from dplb_shm import Segment

    seg = Segment.create(shm_name, num_slots=2)
    try:
        for i in range(2):
            seg.writer(i).claim(worker_id=i, pid=os.getpid() + 1, endpoint=f"/run/e{i}.sock")
        m = MirrorManager(seg, GatedTransport(), str(tmp_path))
        m.wanted = {A: {}}
        assert m.leader()
        assert m.slot_of(A) is None and "no free slot" in m.errors[A]
        assert "no free slot" in m.read_record()["errors"][A]
        m.close()
    finally:
        seg.close()


@pytest.mark.parametrize(("stall_s", "dead"), [(0.0, True), (0.3, False)])
def test_a_state_fetch_timeout_marks_the_remote_worker_dead_only_when_this_process_was_not_starved(
        segment, tmp_path, stall_s, dead):
    """A timeout that ended far past its limit (0.3 s for 0.05 s) is this process's lateness, not the
    remote agent's: no verdict (:func:`router.mirror.starved_timeout`)."""
    m = MirrorManager(segment, TimingOutTransport(stall_s), str(tmp_path), timeout_s=0.05, max_failures=1)
    m.wanted = {A: {"weight": 1.0}}
    try:
        asyncio.run(m.tick())
        assert (segment.read_slot(m.slot_of(A)).state.name == "DEAD") is dead
        assert m.failures.get(A, 0) == (1 if dead else 0)
    finally:
        m.close()
