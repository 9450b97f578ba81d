"""Time and per-request accounting passed into the router (what ``dplb-simulate`` relies on).

The routing clock reaches the kernel and the registry's liveness check; the :class:`Lease` marks
dispatch, first token and end exactly once, for the live proxy and the simulator alike.
"""
from __future__ import annotations

import random

import pytest

from dplb_shm import ScoringParams, Segment, WorkerState
from router.config import POLICIES, Config, RoutingPolicy
from router.policies import RequestInfo, build_policy
from router.scheduling import Lease, Scheduler
from router.workers import Registry
from tests.helpers import unique_shm_name

T0 = 50_000_000_000  # virtual ns


@pytest.fixture
def vseg():
    """A 3-slot segment whose writers run on a virtual clock at T0; unlinked at teardown."""
    name = unique_shm_name()
    seg = Segment.create(name, num_slots=3)
    try:
        writers = []
        for i in range(3):
            w = seg.writer(i)
            w.now_override_ns = T0
            w.claim(i, endpoint=f"/tmp/vsock-{i}.sock", max_num_seqs=256)
            w.set_state(WorkerState.READY)
            writers.append(w)
        yield seg, writers
    finally:
        seg.close()
        seg.unlink()


def test_dplb_policy_reads_the_routing_clock(vseg):
    seg, writers = vseg
    now = [T0]
    rp = RoutingPolicy()
    params = ScoringParams(heartbeat_timeout_ms=1000)
    pol = build_policy("dplb", rp, kernel=seg, params=params, rng=random.Random(1), clock=lambda: now[0])
    snaps = seg.snapshot()
    assert pol.choose(snaps, RequestInfo(text="", prompt_len=5)).reason == "score"
    # 2 s of virtual time later every heartbeat is stale: the kernel sees nobody (fallback)
    now[0] = T0 + 2_000_000_000
    assert pol.choose(snaps, RequestInfo(text="", prompt_len=5)).reason == "fallback"
    writers[2].now_override_ns = now[0]
    writers[2].heartbeat()
    d = pol.choose(snaps, RequestInfo(text="", prompt_len=5))
    assert (d.worker_id, d.reason) == (2, "score")


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_takes_rng_and_clock(vseg, name):
    seg, _ = vseg
    pol = build_policy(name, RoutingPolicy(), kernel=seg, params=ScoringParams(), rng=random.Random(0),
                       clock=lambda: T0)
    assert pol.name == name
    d = pol.choose(seg.snapshot(), RequestInfo(text="hello " * 40, prompt_len=40))
    assert d.worker_id in (0, 1, 2)


def test_registry_judges_heartbeats_on_its_clock(vseg):
    seg, writers = vseg
    now = [T0 + 500_000_000]
    reg = Registry(seg, Config(), clock=lambda: now[0])
    reg.sync(seg.snapshot())
    assert sorted(s.worker_id for s in reg.candidates(None, set(), "fresh")) == [0, 1, 2]
    assert len(reg.candidates(None, set(), "cached")) == 3
    now[0] = T0 + 1_500_000_000           # 1.5 s after the last heartbeat (timeout 1 s)
    writers[1].now_override_ns = now[0]
    writers[1].heartbeat()
    assert [s.worker_id for s in reg.candidates(None, set(), "fresh")] == [1]


def test_lease_moments_once_each(vseg):
    seg, _ = vseg
    now = [T0]
    reg = Registry(seg, Config(), clock=lambda: now[0])
    reg.sync(seg.snapshot())
    sched = Scheduler(reg, build_policy("round_robin", RoutingPolicy(), rng=random.Random(0)), seg,
                      clock=lambda: now[0])
    info = RequestInfo(prompt_len=3)
    lease, d = sched.select(info)
    wid = d.worker_id
    assert isinstance(lease, Lease) and lease.req is info and lease.dispatched_ns == T0
    assert (seg.router_inflight_get(wid), seg.read_slot(wid).dispatched) == (1, 1)
    assert not lease.first_token_seen and lease.ttft_ns is None
    now[0] += 250_000_000
    assert lease.first_token() is True
    assert lease.ttft_ns == 250_000_000
    assert lease.first_token() is False
    assert lease.release() is True and lease.release() is False
    assert seg.router_inflight_get(wid) == 0 and reg.handles[wid].local_inflight == 0
    # released without a first token (error, disconnect): the moment passes at the end
    lease2, _ = sched.select(RequestInfo(prompt_len=3))
    assert lease2.release() is True
    assert lease2.first_token_seen and lease2.first_token() is False and lease2.ttft_ns is None
    # the live default clock is CLOCK_MONOTONIC
    import time
    t = time.monotonic_ns()
    live = Lease(reg.handles[wid], seg)
    assert t <= live.dispatched_ns <= time.monotonic_ns()
    live.release()
