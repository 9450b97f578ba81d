"""lmetric: new prefill tokens × (batch size + 1), the smallest wins.

For each eligible worker i::

    score_i = u_i · (B_i + 1)

``u_i``: this request's prompt tokens not cached on i (the router's prefix index, as for
``dplb``), ``B_i``: requests on i (:func:`router.policies.base.pending`: the engine's running and
waiting, or the routers' in-flight count when larger). The product prices both what the request
adds to i (its uncached prefill) and how many requests it slows down or waits behind. Source:
the LMetric routing metric (KV-cache-aware routing study, 2025: "prefill tokens × (batch + 1)"),
as the routing issue of this project summarises it. Ties at random.

Config: ``routing_policy: {policy: lmetric, prefix_chunk_chars: 64}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from router.policies.base import BasePolicy, Decision, RequestInfo, pending, pick_min
from router.policies.prefix_index import (
    PrefixIndex,
    PrefixIndexedPolicy,
    PrefixParams,
    uncached_tokens,
)
from router.policies.registry import PolicyContext, PolicySpec, register

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class LMetricPolicy(PrefixIndexedPolicy, BasePolicy):
    """Uncached prefill tokens times (batch + 1) over a :class:`PrefixIndex`."""

    name = "lmetric"
    needs_text = True

    def __init__(self, index: PrefixIndex | None = None, rng=None) -> None:
        super().__init__(rng)
        self.index = index if index is not None else PrefixIndex()   # an empty index is falsy (len 0)
        self._pending_hashes: tuple[int, Sequence[int]] | None = None

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        matches = self.matches(req) if req.text else {}
        unc = {w.worker_id: uncached_tokens(self.index, matches, req.text, req.prompt_len, w.worker_id)
               for w in workers}
        scores = {w.worker_id: float(unc[w.worker_id] * (pending(w) + 1)) for w in workers}
        wid = pick_min(scores, self.rng)
        rows = [{"worker_id": w.worker_id, "score": -scores[w.worker_id], "uncached_tokens": unc[w.worker_id],
                 "batch": pending(w)} for w in workers] if explain else []
        return Decision(wid, "lmetric", rows, uncached_tokens=unc[wid])


class LMetricParams(PrefixParams):
    """``lmetric``'s parameters: the prefix index's size only."""


def _build(p: LMetricParams, ctx: PolicyContext) -> LMetricPolicy:
    return LMetricPolicy(p.prefix_index(), rng=ctx.rng)


SPEC = register(PolicySpec("lmetric", LMetricParams, _build, reads="uncached tokens × (batch + 1) (LMetric)"))
