"""router.ledger: a router process's share of the router lines, given back exactly once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from router.ledger import (
    AccountedSegment,
    Ledger,
    process_start,
    read_rows,
    shares_dir,
    sweep_dead,
)
from tests.helpers import unique_shm_name


@pytest.fixture
def seg():
    from dplb_shm import Segment

    s = Segment.create(unique_shm_name(), num_slots=4)
    try:
        yield s
    finally:
        s.close()
        s.unlink()


def _line(seg, slot):
    ln = seg.router_line(slot)
    return (ln["router_inflight"], ln["prefill_tokens"], ln["decode_reqs"], ln["decode_ctx_tokens"])


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_accounted_segment_writes_both_and_close_gives_back_what_is_left(seg, tmp_path):
    led = Ledger(str(tmp_path), seg.num_slots)
    acc = AccountedSegment(seg, led)
    assert acc.router_inflight_add(2, 3) == 3 and acc.prefill_add(2, 500) == 500
    assert acc.decode_add(1, 2, 70) == (2, 70)
    seg.router_inflight_add(2, 1)                 # another router process's request
    assert led.share(2) == {"router_inflight": 3, "prefill_tokens": 500, "decode_reqs": 0, "decode_ctx_tokens": 0}
    assert _line(seg, 2) == (4, 500, 0, 0)
    led.close(seg)
    assert _line(seg, 2) == (1, 0, 0, 0) and _line(seg, 1) == (0, 0, 0, 0)   # only its own share left
    assert not os.path.exists(led.path)
    led.close(seg)                                # idempotent


def test_sweep_gives_back_a_dead_processes_share_once_and_leaves_live_ones(seg, tmp_path):
    state = str(tmp_path)
    # a ledger as a killed process leaves it: same format, a pid that no longer runs
    dead = Ledger(state, seg.num_slots)
    acc = AccountedSegment(seg, dead)
    acc.router_inflight_add(0, 5)
    acc.prefill_add(0, 1000)
    acc.decode_add(3, 1, 40)
    dead.close()                                  # no seg: the file stays, as after a kill -9
    pid = _dead_pid()
    dead_path = os.path.join(shares_dir(state), f"{pid}-{dead.start}.ledger")
    os.rename(dead.path, dead_path)
    live = Ledger(state, seg.num_slots)           # this process: never swept by itself
    AccountedSegment(seg, live).router_inflight_add(0, 2)
    assert read_rows(dead_path) is not None
    assert _line(seg, 0) == (7, 1000, 0, 0)
    swept = sweep_dead(seg, state)
    assert [p for p, _ in swept] == [pid] and swept[0][1]["router_inflight"] == 5
    assert _line(seg, 0) == (2, 0, 0, 0) and _line(seg, 3) == (0, 0, 0, 0)
    assert not os.path.exists(dead_path) and os.path.exists(live.path)
    assert sweep_dead(seg, state) == []           # never twice
    live.close(seg)


def test_a_reused_pid_is_not_taken_for_the_dead_process(seg, tmp_path):
    """The ledger is keyed by pid and start time: a live process with the dead one's pid (here:
    this test's parent, with a start time that is not the ledger's) does not protect it."""
    state = str(tmp_path)
    led = Ledger(state, seg.num_slots)
    AccountedSegment(seg, led).router_inflight_add(1, 4)
    led.close()
    ppid = os.getppid()
    start = process_start(ppid)
    assert start is not None
    os.rename(led.path, os.path.join(shares_dir(state), f"{ppid}-{start + 1}.ledger"))
    assert [p for p, _ in sweep_dead(seg, state)] == [ppid] and _line(seg, 1) == (0, 0, 0, 0)


def test_a_sweep_never_drives_a_counter_below_zero(seg, tmp_path):
    state = str(tmp_path)
    led = Ledger(state, seg.num_slots)
    AccountedSegment(seg, led).router_inflight_add(0, 3)
    seg.router_inflight_add(0, -3)                # e.g. a first router zeroed the line meanwhile
    led.close()
    os.rename(led.path, os.path.join(shares_dir(state), f"{_dead_pid()}-{led.start}.ledger"))
    sweep_dead(seg, state)
    assert seg.router_inflight_get(0) == 0


def test_process_start_of_no_process_is_none():
    assert process_start(_dead_pid()) is None
    assert process_start(os.getpid()) is not None
