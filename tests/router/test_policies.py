"""Table-driven unit tests of every policy on plain snapshot objects (no segment, no network)."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from router.config import RoutingPolicy
from router.policies import (
    CacheAwarePolicy,
    KvCostPolicy,
    LeastLoadPolicy,
    LMetricPolicy,
    PowerOfTwoPolicy,
    PrefixIndex,
    RandomPolicy,
    RequestInfo,
    RoundRobinPolicy,
    SessionPolicy,
    ShortestQueuePolicy,
    WeightedPolicy,
    build_policy,
    pending,
    policy_names,
)
from router.policies.weighted import EXCLUDED


@dataclass
class S:
    """A plain snapshot with the attributes policies read."""

    worker_id: int
    num_running: int = 0
    num_waiting: int = 0
    inflight: int = 0
    router_inflight: int = 0
    kv_cache_usage: float = 0.0
    max_num_seqs: int = 256
    weight: float = 1.0
    prefill_tokens: int = 0
    decode_reqs: int = 0
    decode_ctx_tokens: int = 0
    prefill_rate: float = 0.0


def req(text: str = "", plen: int = 0) -> RequestInfo:
    return RequestInfo("/v1/chat/completions", None, False, text, plen or len(text.split()))


@pytest.mark.parametrize("snap,expected", [
    (S(0), 0),
    (S(0, num_running=3, num_waiting=2), 5),
    (S(0, num_running=1, inflight=4), 4),                      # agent saw more than the engine reports
    (S(0, num_running=2, inflight=2, router_inflight=5), 5),   # 3 dispatched, not yet seen by the agent
    (S(0, inflight=3, router_inflight=1), 3),                  # another router's requests: never negative
])
def test_pending_matches_kernel_formula(snap, expected):
    assert pending(snap) == expected


@pytest.mark.parametrize("loads,expected", [
    ([5, 1, 3], {1}),
    ([0, 0, 7], {0, 1}),
    ([9, 9, 9], {0, 1, 2}),
    ([4, 2, 2, 8], {1, 2}),
])
def test_shortest_queue(loads, expected):
    ws = [S(i, num_waiting=n) for i, n in enumerate(loads)]
    pol = ShortestQueuePolicy(rng=random.Random(1))
    got = {pol.choose(ws, req()).worker_id for _ in range(50)}
    assert got == expected  # every tied minimum is reachable, nothing else is


def test_shortest_queue_never_favours_worker_zero():
    ws = [S(i) for i in range(4)]
    pol = ShortestQueuePolicy(rng=random.Random(7))
    c = Counter(pol.choose(ws, req()).worker_id for _ in range(400))
    assert set(c) == {0, 1, 2, 3} and max(c.values()) < 160


@pytest.mark.parametrize("ids", [[0, 1, 2], [3, 5, 9, 11], [7]])
def test_round_robin_cycles_in_id_order(ids):
    ws = [S(i) for i in reversed(ids)]
    pol = RoundRobinPolicy(rng=random.Random(3))
    got = [pol.choose(ws, req()).worker_id for _ in range(len(ids) * 3)]
    start = ids.index(got[0])
    assert got == [ids[(start + k) % len(ids)] for k in range(len(got))]


def test_round_robin_explain_does_not_advance():
    ws = [S(0), S(1)]
    pol = RoundRobinPolicy(rng=random.Random(3))
    dry = pol.choose(ws, req(), explain=True)
    assert pol.choose(ws, req()).worker_id == dry.worker_id
    assert len(dry.scores) == 2


@pytest.mark.parametrize("weights,expected_share", [
    ([1.0, 1.0], [0.5, 0.5]),
    ([3.0, 1.0], [0.75, 0.25]),
    ([1.0, 0.0], [1.0, 0.0]),
])
def test_random_is_weighted(weights, expected_share):
    ws = [S(i, weight=w) for i, w in enumerate(weights)]
    pol = RandomPolicy(rng=random.Random(11))
    n = 4000
    c = Counter(pol.choose(ws, req()).worker_id for _ in range(n))
    for i, share in enumerate(expected_share):
        assert abs(c[i] / n - share) < 0.04


@pytest.mark.parametrize("loads,allowed", [
    ([0, 10], {0}),
    ([10, 0], {1}),
    ([3, 3], {0, 1}),
    ([0, 5, 9], {0, 1}),   # the most loaded of three can never win a pair
])
def test_power_of_two(loads, allowed):
    ws = [S(i, num_running=n) for i, n in enumerate(loads)]
    pol = PowerOfTwoPolicy(rng=random.Random(5))
    got = {pol.choose(ws, req()).worker_id for _ in range(200)}
    assert got == allowed


LONG = "system: you are a careful assistant. " * 20  # 760 characters, 11 chunks of 64


@pytest.mark.parametrize("case", [
    # (loads, indexed {worker: text}, request text, expected worker(s), expected reason)
    {"loads": [0, 0], "index": {1: LONG}, "text": LONG + "question one", "want": {1}, "reason": "cache_hit"},
    {"loads": [0, 0], "index": {1: LONG[:128]}, "text": LONG, "want": {0}, "reason": "cache_miss"},   # match 17% < 30%
    {"loads": [0, 100], "index": {1: LONG}, "text": LONG, "want": {0}, "reason": "imbalanced"},      # 100 > 64 and > 1.5·0
    {"loads": [40, 100], "index": {1: LONG}, "text": LONG, "want": {1}, "reason": "cache_hit"},     # 60 ≤ 64: balanced
    {"loads": [70, 100], "index": {1: LONG}, "text": LONG, "want": {1}, "reason": "cache_hit"},     # 100 < 1.5·70
    {"loads": [0, 0, 0], "index": {}, "text": "short", "want": {0, 1, 2}, "reason": "cache_miss"},
])
def test_cache_aware_follows_sglang_rule(case):
    ws = [S(i, num_running=n) for i, n in enumerate(case["loads"])]
    pol = CacheAwarePolicy(0.3, 64, 1.5, PrefixIndex(64), rng=random.Random(2))
    for wid, t in case["index"].items():
        pol.index.insert(pol.index.hashes(t), wid)
    got = set()
    for _ in range(30):
        d = pol.choose(ws, req(case["text"]))
        assert d.reason == case["reason"]
        got.add(d.worker_id)
    assert got == case["want"]


def test_cache_aware_miss_goes_to_smallest_tree_and_indexes_it():
    ws = [S(0), S(1)]
    pol = CacheAwarePolicy(index=PrefixIndex(64), rng=random.Random(2))
    pol.index.insert(pol.index.hashes("x" * 640), 0)   # worker 0 holds 10 chunks
    r = req("y" * 640)
    d = pol.choose(ws, r)
    assert (d.worker_id, d.reason) == (1, "cache_miss")
    pol.on_dispatch(d.worker_id, r)
    d2 = pol.choose(ws, req("y" * 640 + " follow-up"))
    assert (d2.worker_id, d2.reason) == (1, "cache_hit")


class FakeKernel:
    """Stands in for seg.pick/pick_explain: score = base[i] + affinity[i] over non-excluded ids."""

    @dataclass
    class T:
        worker_id: int
        score: float
        pending: float
        pending_term: float = 0.0
        kv_term: float = 0.0
        latency_term: float = 0.0
        length_term: float = 0.0
        affinity: float = 0.0
        weight: float = 1.0

    def __init__(self, base: dict[int, float], pend: dict[int, int], num_slots: int = 8) -> None:
        self.base, self.pend, self.num_slots = base, pend, num_slots
        self.calls: list[list[float]] = []

    def pick_explain(self, params, prompt_len, affinity):
        self.calls.append(list(affinity))
        terms = [self.T(i, s + affinity[i], self.pend.get(i, 0)) for i, s in self.base.items()
                 if affinity[i] > EXCLUDED / 2]
        if not terms:
            return -1, []
        return max(terms, key=lambda t: t.score).worker_id, terms

    def pick(self, params, prompt_len, affinity):
        return self.pick_explain(params, prompt_len, affinity)[0]


@pytest.mark.parametrize("case", [
    # kernel scores alone decide when nothing matches
    {"base": {0: 0.9, 1: 0.8}, "pend": {}, "index": {}, "want": 0, "reason": "score"},
    # the affine worker wins a close race thanks to the bonus
    {"base": {0: 0.9, 1: 0.8}, "pend": {}, "index": {1: LONG}, "want": 1, "reason": "affinity"},
    # affine worker 16 requests busier than the least loaded: the bonus has faded (escape)
    {"base": {0: 0.9, 1: 0.8}, "pend": {0: 0, 1: 16}, "index": {1: LONG}, "want": 0, "reason": "escape"},
    # affine worker at its queue capacity: escape
    {"base": {0: 0.9, 1: 0.8}, "pend": {0: 250, 1: 256}, "index": {1: LONG}, "want": 0, "reason": "escape"},
    # kernel finds nobody eligible (e.g. all KV above threshold): least-loaded fallback
    {"base": {}, "pend": {}, "index": {}, "want": 1, "reason": "fallback", "loads": [5, 1]},
])
def test_weighted_affinity_and_escape(case):
    kern = FakeKernel(case["base"], case["pend"])
    pol = WeightedPolicy(kern, params=None, index=PrefixIndex(64), w_affinity=0.3, affinity_max_imbalance=16,
                     rng=random.Random(4))
    for wid, t in case["index"].items():
        pol.index.insert(pol.index.hashes(t), wid)
    loads = case.get("loads", [0, 0])
    ws = [S(i, num_running=n) for i, n in enumerate(loads)]
    d = pol.choose(ws, req(LONG + " next turn"))
    assert (d.worker_id, d.reason) == (case["want"], case["reason"])


def test_weighted_excludes_router_ineligible_workers_through_affinity():
    kern = FakeKernel({0: 0.99, 1: 0.5, 2: 0.4}, {})
    pol = WeightedPolicy(kern, None, PrefixIndex(64), rng=random.Random(1))
    d = pol.choose([S(1), S(2)], req("hi"))       # worker 0 is e.g. probe-failed
    assert d.worker_id == 1
    aff = kern.calls[-1]
    assert aff[0] == EXCLUDED and aff[1] == 0.0 and aff[2] == 0.0 and aff[3] == EXCLUDED


def test_weighted_bonus_formula():
    pol = WeightedPolicy(FakeKernel({}, {}), None, w_affinity=0.3, affinity_max_imbalance=16)
    assert pol.bonus(1.0, 0, 0, 256) == pytest.approx(0.3)
    assert pol.bonus(0.5, 8, 0, 256) == pytest.approx(0.3 * 0.5 * 0.5)
    assert pol.bonus(1.0, 16, 0, 256) == 0.0
    assert pol.bonus(1.0, 256, 250, 256) == 0.0
    assert pol.bonus(0.0, 0, 0, 256) == 0.0


def test_weighted_explain_rows_carry_every_term():
    kern = FakeKernel({0: 0.9, 1: 0.8}, {0: 1, 1: 0})
    pol = WeightedPolicy(kern, None, PrefixIndex(64), rng=random.Random(1))
    d = pol.choose([S(0), S(1)], req("hello"), explain=True)
    assert {r["worker_id"] for r in d.scores} == {0, 1}
    for r in d.scores:
        assert set(r) >= {"worker_id", "score", "pending", "pending_term", "kv_term", "latency_term",
                          "length_term", "affinity", "weight"}


def test_build_policy_names():
    rp = RoutingPolicy()
    for name in policy_names():
        kernel = FakeKernel({}, {}) if name in ("dplb", "weighted") else None
        assert build_policy(name, rp, kernel=kernel).name == name
    for name in ("dplb", "weighted"):
        with pytest.raises(ValueError):
            build_policy(name, rp)
    with pytest.raises(ValueError, match="unknown routing policy"):
        build_policy("fastest", rp)


# ---- the field's policies (issue 13): one table each ------------------------------------------

@pytest.mark.parametrize("name,workers,want", [
    ("the shortest prefill queue wins", [S(0, prefill_tokens=9000), S(1, prefill_tokens=3000)], 1),
    ("a faster learned rate offsets a longer queue",
     [S(0, prefill_tokens=9000, prefill_rate=90_000.0), S(1, prefill_tokens=3000, prefill_rate=10_000.0)], 0),
    ("the KV barrier: 0.15 s at k = 0.5 outweighs 3,000 tokens at 30,769/s (0.0975 s)",
     [S(0, kv_cache_usage=0.5), S(1, prefill_tokens=3000)], 1),
])
def test_least_load(name, workers, want):
    assert LeastLoadPolicy(rng=random.Random(0)).choose(workers, req("x", 10)).worker_id == want


def test_least_load_cost_formula():
    pol = LeastLoadPolicy(prefill_rate=10_000.0, kv_barrier_s=0.15)
    assert pol.cost(S(0, prefill_tokens=5000, kv_cache_usage=0.5)) == pytest.approx(0.5 + 0.15)


def _with_prefix(pol, wid: int, text: str):
    pol.index.insert(pol.index.hashes(text), wid)
    return pol


@pytest.mark.parametrize("name,workers,cached_on,want", [
    ("uncached × (batch + 1): the cache holder wins at equal batch", [S(0), S(1)], 1, 1),
    ("a busy cache holder loses: 2,400 words x 41 > 4,800 x 1", [S(0), S(1, num_running=40)], 1, 0),
])
def test_lmetric(name, workers, cached_on, want):
    pol = _with_prefix(LMetricPolicy(PrefixIndex(64), rng=random.Random(0)), cached_on, LONG)
    d = pol.choose(workers, req(LONG + " " + LONG, 4800))
    assert d.worker_id == want
    if want == cached_on:  # half the prompt is cached, up to the index's 64-character chunking
        assert 2400 <= d.uncached_tokens < 2600
    else:
        assert d.uncached_tokens == 4800


@pytest.mark.parametrize("name,workers,cached_on,want", [
    ("fewer prefill blocks: the cache holder", [S(0), S(1)], 1, 1),
    ("decode blocks held elsewhere decide", [S(0), S(1, decode_ctx_tokens=100_000)], 1, 0),
    ("queued prefill counts like uncached prompt", [S(0, prefill_tokens=50_000), S(1)], None, 1),
])
def test_kv_cost(name, workers, cached_on, want):
    pol = KvCostPolicy(PrefixIndex(64), overlap_weight=1.0, block_size=16, rng=random.Random(0))
    if cached_on is not None:
        _with_prefix(pol, cached_on, LONG)
    assert pol.choose(workers, req(LONG + " " + LONG, 4800)).worker_id == want


def test_session_sticks_spills_and_moves_only_its_own_keys():
    pol = SessionPolicy(max_load_skew=1.5, rng=random.Random(0))
    ws = [S(i) for i in range(4)]

    def route(key: str, workers=ws) -> int:
        return pol.choose(workers, RequestInfo(session=key, text="x", prompt_len=1)).worker_id

    keys = [f"user-{k}" for k in range(200)]
    home = {k: route(k) for k in keys}
    assert all(route(k) == home[k] for k in keys)                          # sticky
    assert len(set(home.values())) == 4                                     # spread over the ring
    # a worker leaves: only its own sessions move
    rest = [w for w in ws if w.worker_id != 2]
    moved = [k for k in keys if route(k, rest) != home[k]]
    assert moved and all(home[k] == 2 for k in moved)
    # bounded load: the home worker far above the mean passes the session on along the ring
    k0 = keys[0]
    busy = [S(i, num_running=30 if i == home[k0] else 0) for i in range(4)]
    d = pol.choose(busy, RequestInfo(session=k0, text="x", prompt_len=1))
    assert d.worker_id != home[k0] and d.reason == "session_spill"


def test_session_without_key_goes_to_the_least_loaded():
    pol = SessionPolicy(rng=random.Random(0))
    d = pol.choose([S(0, num_running=3), S(1)], RequestInfo(text="x", prompt_len=1))
    assert (d.worker_id, d.reason) == (1, "no_session")
