"""Time passed into the router (what ``dplb-simulate`` relies on): the routing clock reaches the
kernel policies' heartbeat check and the registry's liveness check."""
from __future__ import annotations

import random

import pytest

from dplb_shm import Segment, WorkerState
from router.config import POLICIES, Config, RoutingPolicy
from router.policies import RequestInfo, build_policy
from router.scheduling import Scheduler
from router.state import scoring_params, ttft_params
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


@pytest.mark.parametrize("name", ["dplb", "weighted"])
def test_kernel_policies_read_the_routing_clock(vseg, name):
    seg, writers = vseg
    now = [T0]
    cfg = Config()
    pol = build_policy(name, cfg.routing_policy, kernel=seg, params=scoring_params(cfg), ttft_params=ttft_params(cfg),
                       rng=random.Random(1), clock=lambda: now[0])
    snaps = seg.snapshot()
    assert pol.choose(snaps, RequestInfo(text="", prompt_len=5)).reason != "fallback"
    # 2 s of virtual time later every heartbeat is stale: the kernel sees nobody
    now[0] = T0 + 2_000_000_000
    assert pol.choose(snaps, RequestInfo(text="", prompt_len=5)).reason == "fallback"
    writers[2].now_override_ns = now[0]
    writers[2].heartbeat()
    d = pol.choose(snaps, RequestInfo(text="", prompt_len=5))
    assert d.worker_id == 2 and d.reason != "fallback"


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_builds_with_rng_and_clock(vseg, name):
    seg, _ = vseg
    cfg = Config()
    pol = build_policy(name, RoutingPolicy(), kernel=seg, params=scoring_params(cfg), ttft_params=ttft_params(cfg),
                       rng=random.Random(0), clock=lambda: T0)
    assert pol.name == name
    d = pol.choose(seg.snapshot(), RequestInfo(text="hello " * 40, prompt_len=40))
    assert d.worker_id in (0, 1, 2)


def test_registry_judges_heartbeats_on_its_clock(vseg):
    seg, writers = vseg
    now = [T0 + 500_000_000]
    reg = Registry(seg, Config(), clock=lambda: now[0])
    reg.sync(seg.snapshot())
    sched = Scheduler(reg, build_policy("round_robin", RoutingPolicy()), seg)
    assert sorted(s.worker_id for s in sched.candidates(None, set(), "fresh")) == [0, 1, 2]
    assert len(sched.candidates(None, set(), "cached")) == 3
    now[0] = T0 + 1_500_000_000           # 1.5 s after the last heartbeat (timeout 1 s)
    writers[1].now_override_ns = now[0]
    writers[1].heartbeat()
    assert [s.worker_id for s in sched.candidates(None, set(), "fresh")] == [1]
    # without a clock, liveness is the age the snapshot computed on CLOCK_MONOTONIC: virtual
    # heartbeats (near 0 on that clock) are stale
    reg2 = Registry(seg, Config())
    assert Scheduler(reg2, build_policy("round_robin", RoutingPolicy()), seg).live(seg.read_slot(1)) is False
