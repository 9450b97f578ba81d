"""Routing policies, one per file; :func:`build_policy` is the factory (choosing one is config's job).

| name            | file               | reads                                                        |
|-----------------|--------------------|--------------------------------------------------------------|
| dplb (default)  | dplb.py            | native kernel: estimated TTFT in tokens + prefix index        |
| weighted        | weighted.py        | native kernel: the seeds' weighted score + prefix affinity    |
| round_robin     | round_robin.py     | ids                                                          |
| random          | random.py          | static weights                                               |
| shortest_queue  | shortest_queue.py  | pending                                                      |
| power_of_two    | power_of_two.py    | pending of two random workers                                |
| cache_aware     | cache_aware.py     | pending + prefix index (SGLang router's rule)                |
| least_load      | least_load.py      | queued prefill tokens / rate + KV barrier (SGLang gateway)   |
| lmetric         | lmetric.py         | uncached tokens × (batch + 1) (LMetric)                       |
| kv_cost         | kv_cost.py         | prefill + decode KV blocks (Dynamo KV router, temperature 0) |
| session         | session.py         | consistent hash of a session key, bounded load               |
"""
from __future__ import annotations

from typing import Any

from router.policies.base import Decision, Policy, RequestInfo, pending
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.dplb import DplbPolicy
from router.policies.kv_cost import KvCostPolicy
from router.policies.least_load import LeastLoadPolicy
from router.policies.lmetric import LMetricPolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.prefix_index import PrefixIndex
from router.policies.random import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.session import SessionPolicy
from router.policies.shortest_queue import ShortestQueuePolicy
from router.policies.weighted import WeightedPolicy

#: every policy name, in the order the docs list them (config validates against this)
POLICY_NAMES = ("dplb", "weighted", "round_robin", "random", "shortest_queue", "power_of_two", "cache_aware",
                "least_load", "lmetric", "kv_cost", "session")

__all__ = [
    "POLICY_NAMES",
    "CacheAwarePolicy",
    "Decision",
    "DplbPolicy",
    "KvCostPolicy",
    "LMetricPolicy",
    "LeastLoadPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixIndex",
    "RandomPolicy",
    "RequestInfo",
    "RoundRobinPolicy",
    "SessionPolicy",
    "ShortestQueuePolicy",
    "WeightedPolicy",
    "build_policy",
    "pending",
]


def build_policy(name: str, rp: Any, kernel: Any = None, params: Any = None, rng=None,
                 ttft_params: Any = None, clock: Any = None) -> Policy:
    """Build policy ``name`` from a ``RoutingPolicy`` config section ``rp``.

    ``kernel`` (a ``dplb_shm.Segment``) is required for the kernel policies: ``weighted`` also
    needs ``params`` (its ``ScoringParams``), ``dplb`` needs ``ttft_params`` (``TtftParams``).
    ``clock``: optional ``() -> ns`` for the kernel policies' heartbeat check (virtual time in the
    simulator; the other policies read no time). Raises ``ValueError`` for an unknown name or a missing kernel.
    """
    def index() -> PrefixIndex:
        return PrefixIndex(rp.prefix_chunk_chars, rp.prefix_max_chunks, rp.prefix_index_max_entries)

    if name in ("dplb", "weighted") and kernel is None:
        raise ValueError(f"the {name} policy needs the segment's kernel")
    if name == "dplb":
        return DplbPolicy(kernel, ttft_params, index(), rng=rng, clock=clock,
                          default_output_tokens=rp.default_output_tokens)
    if name == "weighted":
        return WeightedPolicy(kernel, params, index(), w_affinity=rp.w_affinity,
                              affinity_max_imbalance=rp.affinity_max_imbalance,
                              balance_abs_threshold=rp.balance_abs_threshold,
                              balance_rel_threshold=rp.balance_rel_threshold, rng=rng, clock=clock)
    if name == "cache_aware":
        return CacheAwarePolicy(rp.cache_threshold, rp.balance_abs_threshold, rp.balance_rel_threshold,
                                index(), rng=rng)
    if name == "least_load":
        return LeastLoadPolicy(rp.prefill_tokens_per_s, rp.kv_barrier_s, rng=rng)
    if name == "lmetric":
        return LMetricPolicy(index(), rng=rng)
    if name == "kv_cost":
        return KvCostPolicy(index(), rp.overlap_weight, rp.kv_block_size, rng=rng)
    if name == "session":
        return SessionPolicy(rp.max_load_skew, rng=rng)
    simple: dict[str, Any] = {"round_robin": RoundRobinPolicy, "random": RandomPolicy,
                              "shortest_queue": ShortestQueuePolicy, "power_of_two": PowerOfTwoPolicy}
    if name not in simple:
        raise ValueError(f"unknown routing policy {name!r}; one of {', '.join(POLICY_NAMES)}")
    policy: Policy = simple[name](rng=rng)
    return policy
