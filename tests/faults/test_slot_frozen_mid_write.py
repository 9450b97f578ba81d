"""A slot whose writer stopped inside a write (its seqlock sequence left odd) wedges no reader.

The failure: an agent killed between the two stores of its seqlock write (or a stray write) left
its slot's sequence odd forever, and every full read of that slot spun a million times (with a
thousand yields) before giving up: an idle router's 200 ms health tick spent a third of a core on
it, and p90 latency grew. Now a read that finds the sequence odd at a yield point while the slot's
heartbeat is over 1 s old gives up at once: the snapshot says ``stale``, the worker is out of
routing, ``dplb-shm-dump`` says so, and the next claim of the slot repairs it. The checks count
spins (``Segment.read_spins``), not wall time.
"""
from __future__ import annotations

import random
import signal
import sys

from dplb_shm import ScoringParams, WorkerState
from dplb_shm.dump import render_json, render_table
from router.config import Config, RoutingPolicy
from router.policies import RequestInfo, build_policy
from router.scheduling import Scheduler
from router.state import scoring_params, ttft_params
from router.workers import Registry
from tests.helpers import ROOT, wait_until

# A worker agent's slot writer killed between its two stores: it claims slot 0, goes READY, makes
# the first store of a write (sequence + 1, odd) and is SIGKILLed before the second.
KILLED_MID_WRITE = """
import mmap, os, signal, sys
from dplb_shm import Segment, WorkerState, layout
seg = Segment.attach(sys.argv[1])
w = seg.writer(0)
w.claim(0, endpoint="/tmp/dplb-frozen/0.sock", model="m")
w.set_state(WorkerState.READY)
off = layout.slot_offset(0) + layout.Slot.seq.offset
with open("/dev/shm/" + sys.argv[1], "r+b") as f:
    mm = mmap.mmap(f.fileno(), 0)
    seq = int.from_bytes(mm[off:off + 8], "little")
    mm[off:off + 8] = (seq + 1).to_bytes(8, "little")
    os.kill(os.getpid(), signal.SIGKILL)
"""

#: spins one read of a stopped writer's slot may make: it gives up at its first yield point
YIELD_EVERY = 1024


def _frozen_slot(segment, shm_name, procs):
    """Slot 0 left mid-write by a killed writer, slot 1 a live READY worker; returns slot 1's writer."""
    live = segment.writer(1)
    live.claim(1, endpoint="/tmp/dplb-frozen/1.sock", model="m")
    live.set_state(WorkerState.READY)
    p = procs.start([sys.executable, "-c", KILLED_MID_WRITE, shm_name], cwd=str(ROOT))
    assert p.wait(timeout=120) == -signal.SIGKILL
    return live


def _cheap_stale_read(segment) -> bool:
    """One read of slot 0: stale, and given up at its first yield point?"""
    before = segment.read_spins
    return segment.read_slot(0).stale and segment.read_spins - before <= YIELD_EVERY


def test_writer_killed_between_its_stores_reads_stale_without_spinning(segment, shm_name, procs):
    live = _frozen_slot(segment, shm_name, procs)
    # for the first second (the heartbeat's age) a read waits its whole bound (a writer may be
    # preempted inside its copy) and reads stale when it runs out; after that it gives up at once
    assert segment.read_slot(0).stale
    wait_until(lambda: _cheap_stale_read(segment), timeout=60, what="slot 0 read as stale at once")
    before = segment.read_spins
    reads = [segment.read_slot(0) for _ in range(200)]
    spent = segment.read_spins - before
    assert all(s.stale and s.seq % 2 == 1 for s in reads)
    # the old read spun 10**6 times per call (2 * 10**8 here); now each gives up at its first yield point
    assert spent <= 200 * YIELD_EVERY, spent
    # the copy is still informative: the writer's endpoint, and the other slot reads normally
    assert reads[-1].endpoint == "/tmp/dplb-frozen/0.sock"
    live.heartbeat()
    s1 = segment.read_slot(1)
    assert not s1.stale and s1.state == WorkerState.READY
    # dplb-shm-dump says so, in the table and in the JSON
    table = render_table(segment)
    row0 = next(line for line in table.splitlines() if line.startswith("0 "))
    assert "stale(mid-write)" in row0
    assert b'"stale":true' in render_json(segment)


def test_frozen_worker_leaves_routing_and_its_restart_repairs_the_slot(segment, shm_name, procs):
    live = _frozen_slot(segment, shm_name, procs)
    wait_until(lambda: _cheap_stale_read(segment), timeout=60, what="slot 0 read as stale at once")
    cfg = Config()
    reg = Registry(segment, cfg)
    live.heartbeat()
    reg.refresh()
    assert set(reg.handles) == {0, 1}   # the frozen worker is listed, not forgotten
    sched = Scheduler(reg, build_policy("round_robin", RoutingPolicy()), segment)
    assert sched.routing_state(reg.handles[0]) == "stale"
    assert sched.routing_state(reg.handles[1]) == "eligible"
    assert {sched.decide(RequestInfo(text="", prompt_len=5))[0].worker_id for _ in range(20)} == {1}
    # the scoring kernel skips the slot too, at the default heartbeat timeout and at a long one
    for timeout_ms in (1000.0, 600_000.0):
        live.heartbeat()
        picks = {segment.pick(ScoringParams(heartbeat_timeout_ms=timeout_ms), 10) for _ in range(50)}
        assert picks == {1}, (timeout_ms, picks)
    pol = build_policy("dplb", cfg.routing_policy, kernel=segment, params=scoring_params(cfg),
                       ttft_params=ttft_params(cfg), rng=random.Random(1))
    live.heartbeat()
    assert {pol.choose(segment.snapshot(), RequestInfo(text="", prompt_len=5)).worker_id for _ in range(20)} == {1}
    # the restarted agent's claim repairs the sequence: the worker is back
    w = segment.writer(0)
    w.claim(0, endpoint="/tmp/dplb-frozen/0.sock", model="m")
    w.set_state(WorkerState.READY)
    s0 = segment.read_slot(0)
    assert not s0.stale and s0.seq % 2 == 0 and s0.state == WorkerState.READY
    live.heartbeat()
    reg.refresh()
    assert sched.routing_state(reg.handles[0]) == "eligible"
