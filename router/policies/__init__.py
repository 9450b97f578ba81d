"""Routing policies, one per file; :func:`build_policy` is the factory (choosing one is config's job).

| name            | file               | reads                                  |
|-----------------|--------------------|----------------------------------------|
| dplb            | dplb.py            | native kernel score + prefix affinity  |
| round_robin     | round_robin.py     | ids                                    |
| random          | random.py          | static weights                         |
| shortest_queue  | shortest_queue.py  | pending                                |
| power_of_two    | power_of_two.py    | pending of two random workers          |
| cache_aware     | cache_aware.py     | pending + prefix index (SGLang's rule) |
"""
from __future__ import annotations

from typing import Any

from router.policies.base import Decision, Policy, RequestInfo, pending
from router.policies.cache_aware import CacheAwarePolicy
from router.policies.dplb import DplbPolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.prefix_index import PrefixIndex
from router.policies.random import RandomPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.shortest_queue import ShortestQueuePolicy

__all__ = [
    "CacheAwarePolicy",
    "Decision",
    "DplbPolicy",
    "Policy",
    "PowerOfTwoPolicy",
    "PrefixIndex",
    "RandomPolicy",
    "RequestInfo",
    "RoundRobinPolicy",
    "ShortestQueuePolicy",
    "build_policy",
    "pending",
    "scoring_params",
]


def scoring_params(cfg: Any) -> Any:
    """The kernel's ``dplb_shm.ScoringParams`` from a router ``Config`` (weights, thresholds,
    heartbeat timeout); the live router and ``dplb-simulate`` both build them here."""
    from dplb_shm import ScoringParams

    rp = cfg.routing_policy
    return ScoringParams(w_pending=rp.w_pending, w_kv=rp.w_kv, w_latency=rp.w_latency,
                         w_length=rp.w_length if rp.enable_length_compatibility else 0.0,
                         max_queue=rp.max_queue, kv_cache_threshold=rp.kv_cache_threshold,
                         heartbeat_timeout_ms=float(cfg.health_check.heartbeat_timeout_ms),
                         latency_scale_ms=rp.latency_scale_ms)


def build_policy(name: str, rp: Any, kernel: Any = None, params: Any = None, rng=None, clock=None) -> Policy:
    """Build policy ``name`` from a ``RoutingPolicy`` config section ``rp``.

    ``kernel``/``params`` (a ``dplb_shm.Segment`` and its ``ScoringParams``) are required for
    ``dplb``. ``rng``: the policy's ``random.Random`` (None: seeded from the OS); ``clock``: the
    routing clock, ns in the heartbeat domain (None: CLOCK_MONOTONIC; ``dplb-simulate`` passes its
    virtual clock). Every policy takes both, so the simulator can build any policy listed in
    ``router.config.POLICIES`` through this function alone. Raises ``ValueError`` for an unknown name.
    """
    def index() -> PrefixIndex:
        return PrefixIndex(rp.prefix_chunk_chars, rp.prefix_max_chunks, rp.prefix_index_max_entries)

    if name == "dplb":
        if kernel is None:
            raise ValueError("the dplb policy needs the segment's kernel")
        return DplbPolicy(kernel, params, index(), w_affinity=rp.w_affinity,
                          affinity_max_imbalance=rp.affinity_max_imbalance,
                          balance_abs_threshold=rp.balance_abs_threshold,
                          balance_rel_threshold=rp.balance_rel_threshold, rng=rng, clock=clock)
    if name == "cache_aware":
        return CacheAwarePolicy(rp.cache_threshold, rp.balance_abs_threshold, rp.balance_rel_threshold,
                                index(), rng=rng, clock=clock)
    simple: dict[str, Any] = {"round_robin": RoundRobinPolicy, "random": RandomPolicy, "shortest_queue": ShortestQueuePolicy,
              "power_of_two": PowerOfTwoPolicy}
    if name not in simple:
        raise ValueError(f"unknown routing policy {name!r}; one of dplb, cache_aware, {', '.join(simple)}")
    policy: Policy = simple[name](rng=rng, clock=clock)
    return policy
