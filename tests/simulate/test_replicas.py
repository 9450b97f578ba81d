"""Router replicas in the simulator (``--replicas``, simulate/replicas.py) and the engines' KV-cache
events as the prefix truth (``--events-prefix``): the front alternates the replicas, each replica
has its own policy state and accounting, the accounting error is 0 with one replica, the events
keep a block set equal to the engine's cache, and the events lag the engine by one step; shared
load (``--share-load-ms``) reaches the other replicas' router lines after its delay, never echoes
back to its source, and makes the replicas count what one segment would."""
from __future__ import annotations

import json
import os
import random

import pytest

from dplb_trace.mooncake import TraceRequest
from router.accounting import RequestAccount
from router.config import Config
from router.kv_events import BlockSet
from router.scheduling import Scheduler
from sim_engine.config import EngineConfig
from sim_engine.kv_cache import KVCacheManager
from simulate import cluster as cl
from simulate.cli import main
from simulate.cluster import Simulation
from simulate.generators import generate
from simulate.replicas import RoundRobinFront, SharedLoad, apply_kv_events
from simulate.settings import OK, SimSettings
from simulate.virtual import private_segment, release_segment
from simulate.workload import router_text

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def no_segment_left():
    yield
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"dplb-sim-{os.getpid()}-")] == []


def test_round_robin_front_takes_replicas_in_turn():
    f = RoundRobinFront(3)
    assert [f.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ValueError):
        RoundRobinFront(0)


@pytest.mark.parametrize("admission", [False, True], ids=["admission_off", "admission_on"])
def test_each_replica_routes_every_rth_request_with_its_own_scheduler(monkeypatch, admission):
    who: list[int] = []
    real = Scheduler.lease

    # lease() records every dispatch on both paths: select() (binding on arrival) and the
    # admission queue's route_ticket(); below capacity the queue dispatches in arrival order
    def spy(self, *a, **kw):
        who.append(id(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Scheduler, "lease", spy)
    reqs = generate("agentic", 0, 30)
    cfg = Config.model_validate({"admission": {"enabled": admission}})
    res = Simulation(reqs, SimSettings(engines=[EngineConfig()] * 2, policy="cache_aware", replicas=3,
                                       router=cfg)).run()
    assert all(s == OK for s in res.status)
    assert len(set(who)) == 3
    assert who == [who[i % 3] for i in range(len(reqs))]
    assert res.replicas is not None and res.replicas["replicas"] == 3


def test_accounting_error_is_zero_with_one_replica_and_not_with_several():
    reqs = generate("docqa", 0, 120)
    eng = [EngineConfig()] * 2
    one = Simulation(reqs, SimSettings(engines=eng, policy="dplb", rate_scale=8.0)).run()
    assert one.replicas is not None and one.replicas["accounting_error"]["inflight"] == 0.0
    four = Simulation(reqs, SimSettings(engines=eng, policy="dplb", rate_scale=8.0, replicas=4)).run()
    assert four.replicas is not None and four.replicas["accounting_error"]["inflight"] > 0.0


def test_replicas_without_a_shared_index_lose_prefix_hits():
    """Sessions whose turns go round robin over 4 replicas: each replica's prefix index saw only
    some of a session's turns, so fewer turns find their history on the engine they are sent to."""
    reqs = generate("agentic", 0, 200)
    eng = [EngineConfig()] * 4
    hit = {}
    for r in (1, 4):
        res = Simulation(reqs, SimSettings(engines=eng, policy="cache_aware", rate_scale=4.0, replicas=r)).run()
        hit[r] = sum(res.cached_tokens) / sum(res.prompt_tokens)
    assert hit[4] < hit[1] - 0.02, hit


def _line(seg, k):
    ln = seg.router_line(k)
    return (ln["router_inflight"], ln["prefill_tokens"], ln["decode_reqs"], ln["decode_ctx_tokens"])


def test_shared_load_reaches_the_other_replicas_after_its_delay_and_never_echoes():
    segs = [private_segment(2) for _ in range(3)]
    try:
        share = SharedLoad(segs, 2, delay_ms=1.0)
        a = RequestAccount(segs[0], 1, prompt_tokens=500, uncached_tokens=300, now=0.0)
        b = RequestAccount(segs[2], 1, prompt_tokens=100, uncached_tokens=100, now=0.0)
        assert share.publish(0.0) == pytest.approx(0.001)   # a SHARE event is due then
        assert share.publish(0.0) is None                   # nothing new, one event scheduled
        share.deliver(0.0005)   # not due yet: each replica sees only its own request
        assert [_line(s, 1) for s in segs] == [(1, 300, 0, 0), (0, 0, 0, 0), (1, 100, 0, 0)]
        share.deliver(0.001)
        assert [_line(s, 1) for s in segs] == [(2, 400, 0, 0)] * 3
        share.publish(0.001)    # what was delivered is not published again (no echo)
        assert share.next_due() is None
        a.first_token(now=0.002)
        share.publish(0.002)
        share.deliver(0.003)
        assert [_line(s, 1) for s in segs] == [(2, 100, 1, 500)] * 3
        a.finish(now=0.004)
        b.finish(now=0.004)
        share.publish(0.004)
        share.deliver(0.005)
        assert [_line(s, k) for s in segs for k in (0, 1)] == [(0, 0, 0, 0)] * 6
        with pytest.raises(ValueError):
            SharedLoad(segs, 2, delay_ms=-1.0)
    finally:
        for s in segs:
            release_segment(s)


def test_shared_placements_reach_the_other_replicas_after_the_delay():
    segs = [private_segment(2) for _ in range(3)]
    try:
        share = SharedLoad(segs, 2, delay_ms=1.0)
        got: list[tuple[int, int, list[int], float]] = []
        share.place(0.0, 0, 1, [7, 8])   # no receiver yet: nothing queued
        assert share.next_due() is None
        share.place_into = lambda r, slot, keys, now: got.append((r, slot, keys, now))
        share.place(0.0, 1, 0, [5, 6])
        assert share.publish(0.0) == pytest.approx(0.001)
        share.deliver(0.0005)
        assert got == []
        share.deliver(0.001)
        assert got == [(0, 0, [5, 6], pytest.approx(0.001)), (2, 0, [5, 6], pytest.approx(0.001))]
        assert share.next_due() is None
    finally:
        for s in segs:
            release_segment(s)


def test_shared_load_counts_every_replicas_requests_and_shortens_ttft():
    """docqa's long prompts near capacity over 4 replicas: without sharing each replica misses the
    others' prefill queued since its scrape (accounting error > 0); with the replicas' lines
    shared at once, every replica counts what one segment would (error 0), and the requests wait
    less for their first token."""
    reqs = generate("docqa", 0, 150)
    eng = [EngineConfig()] * 4
    # the admission queue off: near capacity it may answer some requests 429 (docs/admission.md),
    # and this test compares the same requests' accounting and TTFT with and without sharing
    cfg = Config.model_validate({"admission": {"enabled": False}})
    got = {}
    for share in (None, 0.0):
        res = Simulation(reqs, SimSettings(engines=eng, policy="dplb", rate_scale=11.3, replicas=4,
                                           events_prefix=True, share_load_ms=share, router=cfg)).run()
        assert all(s == OK for s in res.status)
        assert res.replicas is not None
        got[share] = (res.replicas["accounting_error"]["inflight"], sum(t for t in res.ttft if t is not None))
    assert got[None][0] > 0.005 and got[0.0][0] == 0.0, got
    assert got[0.0][1] < 0.9 * got[None][1], got


def test_kv_events_keep_a_block_set_equal_to_the_engine_cache():
    """Random allocation, caching, freeing, withdrawal and resets: after each operation the block
    set built from the events holds exactly the hashes the cache holds."""
    rng = random.Random(7)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    kv.events = []
    bs = BlockSet()
    held: list[list[int]] = []
    next_hash = 1
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            got = kv.allocate(rng.randint(1, 6))
            if got is not None:
                for b in got:
                    if rng.random() < 0.7:
                        kv.cache_block(b, next_hash, None, ["w"] * 4)
                        next_hash += 1
                held.append(got)
        elif op < 0.85 and held:
            kv.free(held.pop(rng.randrange(len(held))))
        elif op < 0.95 and held:
            blocks = held[rng.randrange(len(held))]
            kv.uncache_block(blocks[rng.randrange(len(blocks))])
        else:
            kv.reset_prefix_cache()
        apply_kv_events(kv, bs)
        assert set(bs.blocks) == set(kv.cached)
    assert kv.evictions > 0


@pytest.mark.parametrize("pending_s", [0.0, 30.0], ids=["events alone", "with pending placements"])
def test_events_prefix_sees_the_engine_a_step_late(pending_s):
    """The oracle scenario of test_goodput (one engine, a shared 4,096-token prefix, evicted by
    request 2): with the engines' events alone as the index, request 1 (same instant as request 0)
    sees nothing yet (request 0's blocks are published when its step ends); with the replica's
    placements not yet stored (``events_pending_s``) it sees request 0's placement. Request 3 sees
    the eviction either way, as the oracle does (the placement was stored, then evicted)."""
    seen: list[dict[int, int]] = []
    real_match = cl.OracleIndex.match

    def spy(self, hashes):
        out = real_match(self, hashes)
        seen.append(out)
        return out

    shared = tuple(range(8))
    reqs = [TraceRequest(0, 0.0, 4096 + 300, 4, (*shared, 100)),
            TraceRequest(1, 0.0, 4096 + 200, 4, (*shared, 101)),
            TraceRequest(2, 100_000.0, 4780, 4, tuple(range(200, 210))),
            TraceRequest(3, 200_000.0, 4096 + 250, 4, (*shared, 102)),
            TraceRequest(4, 201_000.0, 4096 + 250, 4, (*shared, 103))]
    eng = [EngineConfig(num_gpu_blocks=300)]
    mp = pytest.MonkeyPatch()
    mp.setattr(cl.OracleIndex, "match", spy)
    try:
        res = Simulation(reqs, SimSettings(engines=eng, policy="dplb", events_prefix=True,
                                           events_pending_s=pending_s)).run()
    finally:
        mp.undo()
    assert res.status == [OK] * 5
    assert seen[0] == {} and seen[2] == {} and seen[3] == {}
    # the engine's prompt: the words plus 3 template tokens; 4,096 tokens = 256 blocks shared
    assert seen[1] == ({0: round(len(router_text(reqs[1])) * 4096 / (4096 + 200 + 3))} if pending_s else {})
    # request 4, 1 s after request 3 (whose steps have ended): request 3's blocks are known
    assert seen[4] == {0: round(len(router_text(reqs[4])) * 4096 / (4096 + 250 + 3))}


def test_cli_replicas_flag(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--workload", "docqa", "--requests", "40", "--engines", "2", "--policy", "dplb", "--replicas", "2",
               "--events-prefix", "--progress", "off", "--json-out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "2 router replicas (round robin); accounting error" in text
    row = json.loads(out.read_text())[0]
    assert row["replicas"]["replicas"] == 2 and row["settings"]["replicas"] == 2
    assert row["settings"]["events_prefix"] is True
    rc = main(["--workload", "docqa", "--requests", "40", "--engines", "2", "--policy", "dplb", "--replicas", "2",
               "--share-load-ms", "1", "--progress", "off", "--json-out", str(out)])
    assert rc == 0
    capsys.readouterr()
    row = json.loads(out.read_text())[0]
    assert row["settings"]["share_load_ms"] == 1.0 and row["replicas"]["shared_changes"] > 0
    assert main(["--workload", "docqa", "--requests", "5", "--replicas", "2", "--share-load-ms", "-1"]) == 2
    assert "--share-load-ms -1.0: must be >= 0" in capsys.readouterr().err
    assert main(["--workload", "docqa", "--requests", "5", "--replicas", "0"]) == 2
    assert "--replicas 0: must be >= 1" in capsys.readouterr().err
