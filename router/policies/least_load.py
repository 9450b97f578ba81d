"""least_load: SGLang model gateway's ``least_load`` idea, on DPLB's router-owned accounting.

For each eligible worker i (seconds; pick the smallest, ties at random)::

    cost_i = W_i / r_i + kv_barrier_s · k_i / (1 − k_i)

``W_i``: prompt tokens queued for prefill on i (outstanding prefill tokens dispatched by the
routers, which covers both the engine's queue and what was sent since the last poll), ``r_i``:
its prefill rate (learned, else ``prefill_tokens_per_s``), ``k_i``: KV-cache usage (capped at
0.99). Source: the SGLang gateway's ``least_load`` policy as described in its 2026 release notes
((queued uncached tokens + tokens dispatched since the last poll) / throughput + 0.15 s · k/(1−k)).
Unlike ``dplb`` it does not look at this request's own prefix: every worker is priced as if the
prompt were uncached everywhere.

Config: ``routing_policy: {policy: least_load, prefill_tokens_per_s: 30769, kv_barrier_s: 0.15}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policies.base import BasePolicy, Decision, RequestInfo, pick_min
from router.policies.registry import (
    KvBarrierParams,
    PolicyContext,
    PolicySpec,
    RateParams,
    register,
)

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class LeastLoadPolicy(BasePolicy):
    """Queued prefill time plus the KV barrier (see the module docstring)."""

    name = "least_load"

    def __init__(self, prefill_rate: float = 30_769.0, kv_barrier_s: float = 0.15, rng=None) -> None:
        super().__init__(rng)
        self.prefill_rate = prefill_rate
        self.kv_barrier_s = kv_barrier_s

    def cost(self, w: WorkerSnapshot) -> float:
        """``cost_i`` of worker ``w`` (a snapshot), seconds."""
        rate = w.prefill_rate if w.prefill_rate > 0 else self.prefill_rate
        k = min(max(float(w.kv_cache_usage), 0.0), 0.99)
        return max(0, int(w.prefill_tokens)) / rate + self.kv_barrier_s * k / (1.0 - k)

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        costs = {w.worker_id: self.cost(w) for w in workers}
        wid = pick_min(costs, self.rng)
        rows = [{"worker_id": w.worker_id, "score": -costs[w.worker_id], "cost_s": costs[w.worker_id],
                 "queue_tokens": int(w.prefill_tokens), "kv_cache_usage": float(w.kv_cache_usage)}
                for w in workers] if explain else []
        return Decision(wid, "least_load", rows)


class LeastLoadParams(RateParams, KvBarrierParams):
    """``least_load``'s parameters: the shared prefill-rate seed and the KV barrier."""


def _build(p: LeastLoadParams, ctx: PolicyContext) -> LeastLoadPolicy:
    return LeastLoadPolicy(p.prefill_tokens_per_s, p.kv_barrier_s, rng=ctx.rng)


SPEC = register(PolicySpec("least_load", LeastLoadParams, _build,
                           reads="queued prefill tokens / rate + KV barrier (SGLang gateway)"))
