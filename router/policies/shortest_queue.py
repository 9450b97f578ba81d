"""shortest_queue: the worker with the fewest pending requests.

Reads: ``num_waiting``, ``num_running``, ``router_inflight``, ``inflight``.
Formula: argmin pending, pending = waiting + running + (router in-flight not yet seen by the agent);
ties at random. Config: ``routing_policy: {policy: shortest_queue}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policies.base import (
    BasePolicy,
    Decision,
    RequestInfo,
    least_loaded,
    load_scores,
)
from router.policies.registry import PolicyContext, PolicyParams, PolicySpec, register

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class ShortestQueuePolicy(BasePolicy):
    """Join-the-shortest-queue over :func:`router.policies.base.pending`."""

    name = "shortest_queue"

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        w = least_loaded(workers, self.rng)
        return Decision(w.worker_id, "shortest", load_scores(workers) if explain else [])


def _build(p: PolicyParams, ctx: PolicyContext) -> ShortestQueuePolicy:
    return ShortestQueuePolicy(rng=ctx.rng)


SPEC = register(PolicySpec("shortest_queue", PolicyParams, _build, reads="pending"))
