"""cache_aware: SGLang router's published rule (``sgl-router/src/policies/cache_aware.rs``).

1. Load balance first. With load_i = pending requests of worker i, the system is *imbalanced* when
   ``max_load - min_load > balance_abs_threshold`` **and** ``max_load > min_load * balance_rel_threshold``
   (defaults 64 and 1.5); then the least-loaded worker is chosen (reason ``imbalanced``).
2. Otherwise, longest prefix match in the approximate prefix index: match_rate = matched characters
   / prompt characters. If ``match_rate > cache_threshold`` (default 0.3) the best-matching worker
   is chosen (``cache_hit``), else the worker holding the fewest indexed prefixes, i.e. the most
   free cache (``cache_miss``).
3. The chosen worker is recorded in the index in both cases.

Differences from SGLang: the index is chunk-granular (:mod:`router.policies.prefix_index`) rather
than a character radix tree, and load counts the engine's queue as well as the router's own.

Config: ``routing_policy: {policy: cache_aware, cache_threshold: 0.3, balance_abs_threshold: 64,
balance_rel_threshold: 1.5}``
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from router.policies.base import (
    BasePolicy,
    Decision,
    RequestInfo,
    least_loaded,
    pending,
)
from router.policies.prefix_index import PrefixIndex, PrefixIndexedPolicy, PrefixParams
from router.policies.registry import (
    BalanceParams,
    PolicyContext,
    PolicySpec,
    register,
)

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


class CacheAwarePolicy(PrefixIndexedPolicy, BasePolicy):
    """SGLang's cache-aware rule over a :class:`PrefixIndex` (one index for all models)."""

    name = "cache_aware"
    needs_text = True
    #: its ties go to the worker with the smallest index (:mod:`router.events_index` keeps the
    #: index filled beside the engines' events for it)
    uses_index_sizes = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, index: PrefixIndex | None = None, rng=None) -> None:
        super().__init__(rng)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.index = index if index is not None else PrefixIndex()   # an empty index is falsy (len 0)
        self._pending_hashes: tuple[int, Sequence[int]] | None = None

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        loads = {w.worker_id: pending(w) for w in workers}
        mx, mn = max(loads.values()), min(loads.values())
        hashes = self.index.hashes(req.text, req.model)
        self._pending_hashes = (id(req), hashes)
        matches = self.index.match(hashes) if hashes else {}
        n_chars = max(len(req.text), 1)
        cc = self.index.chunk_chars
        rows = []
        if explain:
            rows = [{"worker_id": w.worker_id, "score": float(-loads[w.worker_id]), "pending": loads[w.worker_id],
                     "match_rate": min(1.0, matches.get(w.worker_id, 0) * cc / n_chars),
                     "tree_size": self.index.size(w.worker_id)} for w in workers]
        if mx - mn > self.balance_abs_threshold and mx > mn * self.balance_rel_threshold:
            return Decision(least_loaded(workers, self.rng).worker_id, "imbalanced", rows)
        eligible = {w.worker_id for w in workers}
        best_id, best_len = None, 0
        cands = [(n, wid) for wid, n in matches.items() if wid in eligible]
        if cands:
            best_len = max(n for n, _ in cands)
            tied = [wid for n, wid in cands if n == best_len]
            best_id = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        if best_id is not None and best_len * cc / n_chars > self.cache_threshold:
            return Decision(best_id, "cache_hit", rows)
        smallest = min(self.index.size(w.worker_id) for w in workers)
        tied = [w.worker_id for w in workers if self.index.size(w.worker_id) == smallest]
        return Decision(tied[0] if len(tied) == 1 else self.rng.choice(tied), "cache_miss", rows)


class CacheAwareParams(BalanceParams, PrefixParams):
    """``cache_aware``'s parameters: the match rate above which the best-matching worker wins
    (SGLang router's published default 0.3)."""

    cache_threshold: float = Field(default=0.3, ge=0, le=1)


def _build(p: CacheAwareParams, ctx: PolicyContext) -> CacheAwarePolicy:
    return CacheAwarePolicy(p.cache_threshold, p.balance_abs_threshold, p.balance_rel_threshold,
                            p.prefix_index(), rng=ctx.rng)


SPEC = register(PolicySpec("cache_aware", CacheAwareParams, _build,
                           reads="pending + prefix index (SGLang router's rule)"))
