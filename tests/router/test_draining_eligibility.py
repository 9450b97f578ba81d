"""A DRAINING worker is out of every policy's candidates: the scheduler's eligibility, not the
policy's (issue 27 item 6). The synced snapshots can be one health interval old, and the ``dplb``
policy's fallback (the kernel found nobody) picks from them: the scheduler confirms each pick on
the live slot, and answers 503 + ``Retry-After`` when every worker drains."""
from __future__ import annotations

import random

import pytest

from dplb_shm import TtftParams, WorkerState, now_ns
from router.config import load_config
from router.errors import NoEligibleWorker
from router.metrics import Metrics
from router.policies import DplbPolicy, PrefixIndex, RequestInfo, RoundRobinPolicy
from router.scheduling import Scheduler
from router.workers import Registry
from tests.helpers import ready_segment


@pytest.fixture
def seg():
    with ready_segment(4, now_ns(), endpoint="/tmp/dplb-de/{}.sock") as s:
        yield s


def scheduler(seg, policy_name: str) -> Scheduler:
    """A scheduler whose registry synced the segment now (every worker READY in its snapshots)."""
    cfg = load_config(None, {"routing_policy.policy": policy_name,
                             "health_check.heartbeat_timeout_ms": 60_000})
    reg = Registry(seg, cfg)
    reg.sync(seg.snapshot())
    pol = (DplbPolicy(seg, TtftParams(heartbeat_timeout_ms=1000.0), PrefixIndex(64), rng=random.Random(0))
           if policy_name == "dplb" else RoundRobinPolicy(rng=random.Random(0)))
    return Scheduler(reg, pol, seg, Metrics())


def drain(seg, *ids: int) -> None:
    """What an agent does at a stop: its slot turns DRAINING (the router has not synced since)."""
    for i in ids:
        seg.writer(i).set_state(WorkerState.DRAINING)


REQ = RequestInfo(text="hello there", prompt_len=2, stream=True)


@pytest.mark.parametrize("policy_name", ["dplb", "round_robin"])
def test_a_worker_that_began_draining_since_the_last_sync_gets_no_new_request(seg, policy_name):
    sch = scheduler(seg, policy_name)
    drain(seg, 0, 2)
    picked = set()
    for _ in range(40):
        lease, _d = sch.select(REQ)
        picked.add(lease.handle.worker_id)
        lease.release()
    assert picked <= {1, 3} and picked


@pytest.mark.parametrize("policy_name", ["dplb", "round_robin"])
def test_every_worker_draining_is_503_with_retry_after_naming_them(seg, policy_name):
    sch = scheduler(seg, policy_name)
    drain(seg, 0, 1, 2, 3)
    with pytest.raises(NoEligibleWorker) as e:
        sch.select(REQ)
    assert e.value.status == 503 and e.value.headers == {"retry-after": "1"}
    assert e.value.reason == "none_eligible"
    sch.registry.sync(seg.snapshot())      # once synced, the message says why per worker
    with pytest.raises(NoEligibleWorker) as e:
        sch.select(REQ)
    assert "worker 0: draining" in str(e.value) and "worker 3: draining" in str(e.value)
    for i in range(4):
        assert seg.router_line(i)["dispatched"] == 0 and seg.router_line(i)["router_inflight"] == 0


def test_dplb_fallback_takes_only_a_worker_that_is_still_ready(seg):
    """The kernel finds nobody (worker 3's heartbeat is stale, the others drain): the fallback may
    still route to the READY worker 3 (rather than refuse service), never to a draining one."""
    sch = scheduler(seg, "dplb")
    seg.writer(3).publish(heartbeat_ns=now_ns() - 5_000_000_000)   # 5 s: stale for the kernel (1 s)
    drain(seg, 0, 1, 2)
    for _ in range(20):
        lease, d = sch.select(REQ)
        assert lease.handle.worker_id == 3 and d.reason == "fallback"
        lease.release()
