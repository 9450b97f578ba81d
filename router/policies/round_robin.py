"""round_robin: each request goes to the next eligible worker in id order.

Reads: only the eligible worker ids. Formula: ``workers[counter[model] % len(workers)]``, that
model's counter +1 per decision. One counter per model (requests for two models alternating do
not each land on the same worker: the eligible set differs per model, and one shared counter
would step through it in lockstep). Each router process keeps its own counters (a baseline; it
ignores load).

Config: ``routing_policy: {policy: round_robin}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policies.base import BasePolicy, Decision, RequestInfo, load_scores
from router.policies.registry import PolicyContext, PolicyParams, PolicySpec, register

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class RoundRobinPolicy(BasePolicy):
    """Rotate over eligible workers sorted by id, one position per model (``req.model``; None is
    a model of its own); each counter starts at a random offset so that several router processes
    do not all start at worker 0. At most ``max_models`` counters are kept (least recently used
    dropped), so a client naming random models cannot grow the state without bound."""

    name = "round_robin"
    reads_load = False  # eligibility from the last tick's snapshots (no per-request slot reads)
    max_models = 1024

    def __init__(self, rng=None) -> None:
        super().__init__(rng)
        self._n: dict[str | None, int] = {}

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        key = req.model
        n = self._n.pop(key, None)
        if n is None:
            n = self.rng.randrange(1 << 16)
            if len(self._n) >= self.max_models:
                del self._n[next(iter(self._n))]   # dicts keep insertion order: the least recently used
        w = ordered[n % len(ordered)]
        # a dry run (/dplb/route) shows the next choice without consuming it
        self._n[key] = n if explain else n + 1
        return Decision(w.worker_id, "rotate", load_scores(workers) if explain else [])


def _build(p: PolicyParams, ctx: PolicyContext) -> RoundRobinPolicy:
    return RoundRobinPolicy(rng=ctx.rng)


SPEC = register(PolicySpec("round_robin", PolicyParams, _build, reads="ids"))
