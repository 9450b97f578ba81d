"""power_of_two: sample two distinct eligible workers at random, take the less loaded.

Reads: pending counts (see :func:`router.policies.base.pending`). Mitzenmacher's "power of two
choices" (2001): near-JSQ balance with two reads per decision. Ties at random.
Config: ``routing_policy: {policy: power_of_two}``
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


class PowerOfTwoPolicy(BasePolicy):
    """Two random candidates, the one with fewer pending requests wins."""

    name = "power_of_two"

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        ws = list(workers)
        pair = ws if len(ws) <= 2 else self.rng.sample(ws, 2)
        w = least_loaded(pair, self.rng)
        return Decision(w.worker_id, "power_of_two", load_scores(workers) if explain else [])


def _build(p: PolicyParams, ctx: PolicyContext) -> PowerOfTwoPolicy:
    return PowerOfTwoPolicy(rng=ctx.rng)


SPEC = register(PolicySpec("power_of_two", PolicyParams, _build, reads="pending of two random workers"))
