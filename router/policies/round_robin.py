"""round_robin: each request goes to the next eligible worker in id order.

Reads: only the eligible worker ids. Formula: ``workers[counter % len(workers)]``, counter +1 per
decision. Each router process keeps its own counter (a baseline; it ignores load).

Config: ``routing_policy: {policy: round_robin}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.policies.base import BasePolicy, Decision, RequestInfo, load_scores


class RoundRobinPolicy(BasePolicy):
    """Rotate over eligible workers sorted by id; the counter starts at a random offset so that
    several router processes do not all start at worker 0."""

    name = "round_robin"
    reads_load = False  # eligibility from the last tick's snapshots (no per-request slot reads)

    def __init__(self, rng=None, clock=None) -> None:
        super().__init__(rng, clock)
        self._n = self.rng.randrange(1 << 16)

    def choose(self, workers: Sequence[Any], req: RequestInfo, explain: bool = False) -> Decision:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        w = ordered[self._n % len(ordered)]
        if not explain:  # a dry run (/dplb/route) shows the next choice without consuming it
            self._n += 1
        return Decision(w.worker_id, "rotate", load_scores(workers) if explain else [])
