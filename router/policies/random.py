"""random: a random eligible worker, weighted by each worker's static ``weight``.

Reads: ``weight``. Formula: P(worker i) = weight_i / Σ weight. Config: ``routing_policy: {policy: random}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policies.base import BasePolicy, Decision, RequestInfo, load_scores
from router.policies.registry import PolicyContext, PolicyParams, PolicySpec, register

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class RandomPolicy(BasePolicy):
    """Weighted random choice (uniform when all weights are equal)."""

    name = "random"
    reads_load = False  # eligibility from the last tick's snapshots (no per-request slot reads)

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        weights = [max(float(w.weight), 0.0) for w in workers]
        if sum(weights) <= 0:
            w = self.rng.choice(list(workers))
        else:
            w = self.rng.choices(list(workers), weights=weights, k=1)[0]
        return Decision(w.worker_id, "random", load_scores(workers) if explain else [])


def _build(p: PolicyParams, ctx: PolicyContext) -> RandomPolicy:
    return RandomPolicy(rng=ctx.rng)


SPEC = register(PolicySpec("random", PolicyParams, _build, reads="static weights"))
