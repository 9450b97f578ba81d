"""Routing policies, one per file, each registered in :mod:`router.policies.registry` with its name,
its parameters and its factory; :func:`build_policy` builds one by name (choosing one is config's job).

The modules are imported below in the order the docs list them (the registry keeps that order).
What each one reads (``PolicySpec.reads``; the docs' table is checked against it):

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

import random as _random
from collections.abc import Callable
from typing import TYPE_CHECKING

# the registration order is the docs' order: these imports stay in it
# isort: off
from router.policies.base import Decision, Policy, RequestInfo, pending
from router.policies.dplb import DplbParams, DplbPolicy
from router.policies.weighted import WeightedParams, WeightedPolicy
from router.policies.round_robin import RoundRobinPolicy
from router.policies.random import RandomPolicy
from router.policies.shortest_queue import ShortestQueuePolicy
from router.policies.power_of_two import PowerOfTwoPolicy
from router.policies.cache_aware import CacheAwareParams, CacheAwarePolicy
from router.policies.least_load import LeastLoadParams, LeastLoadPolicy
from router.policies.lmetric import LMetricParams, LMetricPolicy
from router.policies.kv_cost import KvCostParams, KvCostPolicy
from router.policies.session import SessionParams, SessionPolicy
# isort: on
from router.policies.prefix_index import PrefixIndex, PrefixParams
from router.policies.registry import (
    REGISTRY,
    PolicyContext,
    PolicyParams,
    PolicySpec,
    policy_names,
    register,
    spec_of,
)

if TYPE_CHECKING:
    from dplb_shm import Segment
    from dplb_shm.types import ScoringParams, TtftParams

__all__ = [
    "REGISTRY",
    "CacheAwareParams",
    "CacheAwarePolicy",
    "Decision",
    "DplbParams",
    "DplbPolicy",
    "KvCostParams",
    "KvCostPolicy",
    "LMetricParams",
    "LMetricPolicy",
    "LeastLoadParams",
    "LeastLoadPolicy",
    "Policy",
    "PolicyContext",
    "PolicyParams",
    "PolicySpec",
    "PowerOfTwoPolicy",
    "PrefixIndex",
    "PrefixParams",
    "RandomPolicy",
    "RequestInfo",
    "RoundRobinPolicy",
    "SessionParams",
    "SessionPolicy",
    "ShortestQueuePolicy",
    "WeightedParams",
    "WeightedPolicy",
    "build_policy",
    "pending",
    "policy_names",
    "register",
    "spec_of",
]


def build_policy(name: str, rp: PolicyParams, kernel: Segment | None = None, params: ScoringParams | None = None,
                 rng: _random.Random | None = None, ttft_params: TtftParams | None = None,
                 clock: Callable[[], int] | None = None) -> Policy:
    """Build the registered policy ``name`` from ``rp`` (the ``routing_policy`` config section,
    :class:`router.config.RoutingPolicy`, or that policy's own parameters).

    ``kernel`` (a ``dplb_shm.Segment``) is required for the kernel policies: ``weighted`` also
    needs ``params`` (its ``ScoringParams``), ``dplb`` needs ``ttft_params`` (``TtftParams``).
    ``clock``: optional ``() -> ns`` for the kernel policies' heartbeat check (virtual time in the
    simulator; the other policies read no time). Raises ``ValueError`` for an unknown name or a missing kernel.
    """
    ctx = PolicyContext(kernel=kernel, scoring=params, ttft=ttft_params, rng=rng, clock=clock)
    return spec_of(name).build(rp, ctx)
