"""Tie-breaking spreads load: no slot-0 bias, and a router's own dispatches move the next pick."""
from __future__ import annotations

import collections

from dplb_shm import ScoringParams, Segment, WorkerState

# heartbeats are not under test here: a generous timeout keeps a busy machine from making the
# workers stale between set-up and picks
PARAMS = ScoringParams(heartbeat_timeout_ms=600_000.0)


def _idle_workers(seg: Segment, ids) -> None:
    for i in ids:
        w = seg.writer(i)
        w.claim(i, endpoint=f"/tmp/dplb-spread/{i}.sock", max_num_seqs=256)
        w.set_state(WorkerState.READY)


def test_identical_idle_workers_share_1000_picks(segment):
    ids = list(range(8))
    _idle_workers(segment, ids)
    params = PARAMS
    counts = collections.Counter(segment.pick(params, 512) for _ in range(1000))
    assert set(counts) == set(ids), counts
    # Binomial(1000, 1/8): mean 125, sd 10.5; 125 +- 55 is beyond 5 sd
    for i in ids:
        assert 70 <= counts[i] <= 180, counts
    assert counts[0] < 180


def test_spread_includes_high_slots_with_gaps(segment):
    ids = [3, 9, 15]
    _idle_workers(segment, ids)
    counts = collections.Counter(segment.pick(PARAMS, 0) for _ in range(1000))
    assert set(counts) == set(ids)
    assert min(counts.values()) > 250, counts


def test_two_mappings_do_not_draw_the_same_ties(segment, shm_name):
    """Every attached process seeds its own generator: two routers do not march in lock-step."""
    _idle_workers(segment, range(8))
    other = Segment.attach(shm_name)
    try:
        a = [segment.pick(PARAMS, 1) for _ in range(64)]
        b = [other.pick(PARAMS, 1) for _ in range(64)]
    finally:
        other.close()
    assert a != b


def test_seed_makes_picks_reproducible(segment):
    _idle_workers(segment, range(8))
    segment.seed(42)
    a = [segment.pick(PARAMS, 1) for _ in range(50)]
    segment.seed(42)
    b = [segment.pick(PARAMS, 1) for _ in range(50)]
    assert a == b and len(set(a)) > 1


def test_counting_own_dispatches_spreads_a_burst(segment):
    """A burst between two state refreshes: the router bumps router_inflight on every dispatch,
    so 16 picks over 8 idle workers land exactly twice on each."""
    _idle_workers(segment, range(8))
    got = collections.Counter()
    for _ in range(16):
        c = segment.pick(PARAMS, 100)
        segment.router_inflight_add(c, 1)
        got[c] += 1
    assert dict(got) == {i: 2 for i in range(8)}


def test_forked_child_does_not_repeat_the_parents_ties(segment):
    """uvicorn/gunicorn-style: attach, then fork; each child must draw its own tie-breaks."""
    import multiprocessing

    _idle_workers(segment, range(8))
    segment.seed(7)
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()

    def child():
        q.put([segment.pick(PARAMS, 1) for _ in range(64)])

    p = ctx.Process(target=child)
    p.start()
    try:
        theirs = q.get(timeout=60)
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()
    ours = [segment.pick(PARAMS, 1) for _ in range(64)]
    assert theirs != ours
    segment.seed(7)
    assert [segment.pick(PARAMS, 1) for _ in range(64)] == ours
