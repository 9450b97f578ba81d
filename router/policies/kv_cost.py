"""kv_cost: Dynamo's KV-router cost at temperature 0 (the cheapest worker wins).

For each eligible worker i, in KV blocks of ``kv_block_size`` tokens::

    prefill_blocks_i = (W_i + u_i) / block_size        # queued prefill + this request's uncached part
    decode_blocks_i  = (C_i + prompt_len) / block_size # blocks decoding requests hold, plus ours
    cost_i           = overlap_weight · prefill_blocks_i + decode_blocks_i

``W_i``: outstanding prefill tokens on i; ``u_i``: this request's prompt tokens not cached there
(router prefix index); ``C_i``: context tokens of the requests decoding on i. Source: NVIDIA
Dynamo's KV router (``lib/llm/src/kv_router/scheduler.rs``: logit = overlap_score_weight ·
potential prefill blocks + potential active blocks, softmax sampling with temperature; 0 =
argmin). ``overlap_weight`` defaults to Dynamo's 1.0. Ties at random.

Config: ``routing_policy: {policy: kv_cost, overlap_weight: 1.0, kv_block_size: 16}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from router.policies.base import BasePolicy, Decision, RequestInfo, pick_min
from router.policies.prefix_index import (
    PrefixIndex,
    PrefixIndexedPolicy,
    PrefixParams,
    uncached_tokens,
)
from router.policies.registry import PolicyContext, PolicySpec, register

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class KvCostPolicy(PrefixIndexedPolicy, BasePolicy):
    """Dynamo's prefill + decode block cost over a :class:`PrefixIndex`."""

    name = "kv_cost"
    needs_text = True

    def __init__(self, index: PrefixIndex | None = None, overlap_weight: float = 1.0, block_size: int = 16,
                 rng=None) -> None:
        super().__init__(rng)
        self.index = index if index is not None else PrefixIndex()   # an empty index is falsy (len 0)
        self.overlap_weight = overlap_weight
        self.block_size = max(1, block_size)
        self._pending_hashes: tuple[int, Sequence[int]] | None = None

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        matches = self.matches(req) if req.text else {}
        bs = float(self.block_size)
        rows = []
        costs: dict[int, float] = {}
        unc: dict[int, int] = {}
        for w in workers:
            u = uncached_tokens(self.index, matches, req.text, req.prompt_len, w.worker_id)
            unc[w.worker_id] = u
            prefill = (max(0, int(w.prefill_tokens)) + u) / bs
            decode = (max(0, int(w.decode_ctx_tokens)) + req.prompt_len) / bs
            costs[w.worker_id] = self.overlap_weight * prefill + decode
            if explain:
                rows.append({"worker_id": w.worker_id, "score": -costs[w.worker_id], "prefill_blocks": prefill,
                             "decode_blocks": decode, "uncached_tokens": u})
        wid = pick_min(costs, self.rng)
        return Decision(wid, "kv_cost", rows, uncached_tokens=unc[wid])


class KvCostParams(PrefixParams):
    """``kv_cost``'s parameters (Dynamo KV router): the weight of prefill blocks against decode
    blocks (Dynamo's ``overlap_score_weight``, 1.0) and the KV block size, tokens."""

    overlap_weight: float = Field(default=1.0, ge=0)
    kv_block_size: int = Field(default=16, ge=1)


def _build(p: KvCostParams, ctx: PolicyContext) -> KvCostPolicy:
    return KvCostPolicy(p.prefix_index(), p.overlap_weight, p.kv_block_size, rng=ctx.rng)


SPEC = register(PolicySpec("kv_cost", KvCostParams, _build,
                           reads="prefill + decode KV blocks (Dynamo KV router, temperature 0)"))
