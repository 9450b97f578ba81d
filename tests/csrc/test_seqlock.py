"""Seqlock: a writer process hammering one slot never lets a reader see a torn slot."""
from __future__ import annotations

import sys
import time

from tests.helpers import ROOT, wait_until

HAMMER = """
import sys, itertools
from dplb_shm import Segment
seg = Segment.attach(sys.argv[1])
w = seg.writer(int(sys.argv[2]))
for v in itertools.count(1):
    w.fill_pattern(v)
"""


def test_writer_process_never_tears_a_million_reads(segment, shm_name, procs):
    slot = 5
    p = procs.start([sys.executable, "-c", HAMMER, shm_name, str(slot)], cwd=str(ROOT))
    wait_until(lambda: segment.read_slot(slot).num_running > 1000 or p.poll() is not None, timeout=60,
               what="hammer writer started")
    assert p.poll() is None, "writer process died"
    total_reads = 0
    distinct = 0
    # a million reads, or as many as 90 s allow: on a loaded machine a reader spins (and yields)
    # while the writer is descheduled inside a write, and 250,000 reads can take a minute
    t_end = time.monotonic() + 90
    while (total_reads < 1_000_000 or distinct < 100) and time.monotonic() < t_end:
        torn, _retries, d = segment.check_reads(slot, 50_000)
        assert torn == 0, f"{torn} torn reads after {total_reads} clean ones"
        total_reads += 50_000
        distinct += d
    assert p.poll() is None, "writer process died"
    assert total_reads >= 100_000
    # the writer really changed the slot while we read (not a quiet slot read a million times)
    assert distinct >= 100, distinct


def test_unlocked_reads_do_tear(segment, shm_name, procs):
    """Control: the same check without the seqlock does see torn slots, so the checker has teeth."""
    slot = 9
    p = procs.start([sys.executable, "-c", HAMMER, shm_name, str(slot)], cwd=str(ROOT))
    wait_until(lambda: segment.read_slot(slot).num_running > 1000 or p.poll() is not None, timeout=60,
               what="hammer writer started")
    torn = 0
    t_end = time.monotonic() + 30
    while torn == 0 and time.monotonic() < t_end:
        torn, _, _ = segment.check_reads(slot, 200_000, locked=False)
    assert torn > 0


def test_python_snapshots_are_consistent_while_writer_runs(segment, shm_name, procs):
    slot = 2
    p = procs.start([sys.executable, "-c", HAMMER, shm_name, str(slot)], cwd=str(ROOT))
    wait_until(lambda: segment.read_slot(slot).num_running > 1000 or p.poll() is not None, timeout=60,
               what="hammer writer started")
    seen = set()
    for _ in range(20_000):
        s = segment.read_slot(slot)
        v = s.num_running
        assert (s.num_waiting, s.inflight, s.pid, s.engine_completed, s.engine_failed, s.queued_prompt_tokens,
                s.engine_pid) == (v,) * 7
        assert s.kv_cache_usage == s.ttft_ms == s.e2e_p99_ms == float(v)
        assert s.prompt_len_hist == [v] * 32
        assert s.endpoint == chr(65 + v % 26) * 128 and s.model == chr(65 + v % 26) * 120
        seen.add(v)
    assert p.poll() is None
    assert len(seen) > 10


def test_router_atomics_do_not_disturb_seqlock(segment):
    w = segment.writer(1)
    w.claim(1)
    seq = segment.read_slot(1).seq
    for _ in range(1000):
        segment.router_inflight_add(1, 1)
        segment.dispatched_add(1)
    s = segment.read_slot(1)
    assert s.seq == seq and s.router_inflight == 1000 and s.dispatched == 1000


def test_writer_killed_mid_write_is_skipped_then_repaired(segment, shm_name):
    """A writer SIGKILLed inside a write leaves the sequence odd: the kernel skips that slot (it
    does not stall the router), snapshots show it ``stale`` (a torn copy), and the restarted agent's
    claim repairs it."""
    import mmap

    from dplb_shm import ScoringParams, WorkerState, layout

    for i in (0, 1):
        w = segment.writer(i)
        w.claim(i, endpoint=f"/tmp/dplb-k/{i}.sock")
        w.set_state(WorkerState.READY)
    off = layout.slot_offset(0) + layout.Slot.seq.offset
    with open(f"/dev/shm/{shm_name}", "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        try:
            seq = int.from_bytes(mm[off:off + 8], "little")
            mm[off:off + 8] = (seq + 1).to_bytes(8, "little")  # odd: "inside a write" forever
        finally:
            mm.close()
    assert {segment.pick(ScoringParams(heartbeat_timeout_ms=600_000.0), 10) for _ in range(50)} == {1}
    assert segment.read_slot(0).stale
    w = segment.writer(0)          # the restarted agent
    w.claim(0, endpoint="/tmp/dplb-k/0.sock")
    w.set_state(WorkerState.READY)
    s = segment.read_slot(0)
    assert s.state == WorkerState.READY and s.seq % 2 == 0 and s.seq > seq
    assert {segment.pick(ScoringParams(heartbeat_timeout_ms=600_000.0), 10) for _ in range(200)} == {0, 1}


def test_the_pattern_check_holds_past_the_32_bit_range(segment):
    """A hammer that ran minutes (a busy machine: the reader's batches slow, the writer goes on)
    passed 2**31 writes; the 32-bit fields wrapped and the check called every read torn."""
    w = segment.writer(3)
    for v in (1, 2**31 - 1, 2**31 + 5, 2**40 + 7):
        w.fill_pattern(v)
        torn, _retries, distinct = segment.check_reads(3, 1_000)
        assert (torn, distinct) == (0, 1), v
