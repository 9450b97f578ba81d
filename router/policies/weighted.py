"""weighted: the seeds' weighted score (native kernel) plus a router-computed prefix-affinity bonus.

This was DPLB's default policy until the estimated-TTFT policy (``dplb``) replaced it; it is kept
so an operator can still choose the seeds' formula (docs/DESIGN.md, "What changed").

Score of eligible worker i (computed by the kernel, ``seg.pick``/``seg.pick_explain``, from the
live segment; docs/DESIGN.md "Scoring")::

    score_i = weight_i · ( 0.4·(1 − pending_i/max_queue)      # queue room
                         + 0.3·(1 − kv_usage_i)               # KV-cache room
                         + 0.2·1/(1 + latency_ms_i/100)       # recent latency
                         + 0.1·length_compatibility_i )       # prompt length fits the queued ones
              + affinity_i

The router supplies ``affinity_i``:

* workers the router itself rules out (probe-failed, circuit open, drained, other model, already
  tried by this request) get ``EXCLUDED`` (−1e9), so the kernel never picks them while others remain;
* with a prefix match (see :mod:`router.policies.prefix_index`) of fraction ``m_i`` of the prompt::

      bonus_i = w_affinity · m_i · max(0, 1 − (pending_i − min_pending) / affinity_max_imbalance)

  and 0 when worker i is *overloaded* (pending ≥ its max_queue, or SGLang's imbalance rule:
  pending_i − min_pending > balance_abs_threshold and pending_i > balance_rel_threshold·min_pending).
  The linear fade is the escape hatch: a hot prefix cannot pile a burst onto one worker, because
  every request it takes shrinks its bonus until the least-loaded worker wins again.

Without any prefix match the decision is one native ``seg.pick`` call. With a match the kernel's
per-worker terms (``pick_explain``) are combined with the bonus in Python (argmax, random ties).
If the kernel finds no eligible worker (e.g. every KV cache above ``kv_cache_threshold``) the
least-loaded router-eligible worker is taken (reason ``fallback``) rather than refusing service.

Config::

    routing_policy: {policy: weighted, w_pending: 0.4, w_kv: 0.3, w_latency: 0.2, w_length: 0.1,
                     w_affinity: 0.3, kv_cache_threshold: 0.8, prefix_chunk_chars: 64}
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

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
    KvThresholdParams,
    PolicyContext,
    PolicySpec,
    register,
)

if TYPE_CHECKING:
    from dplb_shm import Segment
    from dplb_shm.types import ScoreTerms, ScoringParams, WorkerSnapshot
    from router.policies.base import ScoreValue

EXCLUDED = -1.0e9
TERM_FIELDS = ("score", "pending", "pending_term", "kv_term", "latency_term", "length_term", "affinity", "weight")


def terms_row(t: ScoreTerms, bonus: float = 0.0) -> dict[str, ScoreValue]:
    """One ``/dplb/route`` explanation row from a kernel ``ScoreTerms`` (plus the router's bonus)."""
    row: dict[str, ScoreValue] = {"worker_id": int(t.worker_id)}
    for f in TERM_FIELDS:
        row[f] = getattr(t, f, None)
    row["affinity"] = bonus
    row["score"] = float(t.score) + bonus
    return row


class WeightedPolicy(PrefixIndexedPolicy, BasePolicy):
    """Kernel score + prefix affinity with escape.

    ``kernel``: object with ``num_slots``, ``pick(params, prompt_len, affinity) -> int`` and
    ``pick_explain(params, prompt_len, affinity) -> (int, list[ScoreTerms])`` (a ``dplb_shm.Segment``);
    ``params``: the ``ScoringParams`` handed to it. Returned worker id −1 means "none eligible".
    """

    name = "weighted"
    needs_text = True
    uses_kernel = True

    def __init__(self, kernel: Segment, params: ScoringParams, index: PrefixIndex | None = None, w_affinity: float = 0.3,
                 affinity_max_imbalance: float = 8.0, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, rng=None, clock: Callable[[], int] | None = None) -> None:
        super().__init__(rng)
        self.clock = clock  # optional () -> ns for the kernel's heartbeat check (the simulator's)
        self.kernel = kernel
        self.params = params
        self.index = index if index is not None else PrefixIndex()   # an empty index is falsy (len 0)
        self.w_affinity = w_affinity
        self.affinity_max_imbalance = max(affinity_max_imbalance, 1e-9)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._pending_hashes: tuple[int, Sequence[int]] | None = None

    def _clock_kw(self) -> dict[str, int]:
        """``now_ns=`` for the kernel when a clock was given (virtual time), else nothing."""
        return {} if self.clock is None else {"now_ns": self.clock()}

    def _base_affinity(self, workers: Sequence[WorkerSnapshot]) -> list[float]:
        aff = [EXCLUDED] * int(self.kernel.num_slots)
        for w in workers:
            aff[w.worker_id] = 0.0
        return aff

    def bonus(self, match_frac: float, p: int, min_p: int, max_queue: int) -> float:
        """Affinity bonus for a worker with prefix match ``match_frac`` (0..1), ``p`` pending,
        ``min_p`` the least pending among eligible workers, ``max_queue`` its queue capacity."""
        if match_frac <= 0 or self.w_affinity <= 0:
            return 0.0
        if max_queue > 0 and p >= max_queue:
            return 0.0
        if p - min_p > self.balance_abs_threshold and p > self.balance_rel_threshold * min_p:
            return 0.0
        return self.w_affinity * match_frac * max(0.0, 1.0 - (p - min_p) / self.affinity_max_imbalance)

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        hashes = self.index.hashes(req.text, req.model) if self.w_affinity > 0 else []
        self._pending_hashes = (id(req), hashes)
        matches = self.index.match(hashes) if hashes else {}
        eligible = {w.worker_id: w for w in workers}
        matches = {k: v for k, v in matches.items() if k in eligible}
        aff = self._base_affinity(workers)
        if not matches and not explain:
            wid = int(self.kernel.pick(self.params, req.prompt_len, aff, **self._clock_kw()))
            if wid in eligible:
                return Decision(wid, "score")
            return Decision(least_loaded(workers, self.rng).worker_id, "fallback")
        _, terms = self.kernel.pick_explain(self.params, req.prompt_len, aff, **self._clock_kw())
        terms = [t for t in terms if int(t.worker_id) in eligible]
        if not terms:
            return Decision(least_loaded(workers, self.rng).worker_id, "fallback",
                            [{"worker_id": w.worker_id, "score": None, "pending": pending(w)} for w in workers]
                            if explain else [])
        n_chars = max(len(req.text), 1)
        cc = self.index.chunk_chars
        min_p = min(int(t.pending) for t in terms)
        bonuses = {}
        escaped = False
        for t in terms:
            wid = int(t.worker_id)
            n = matches.get(wid, 0)
            if n:
                w = eligible[wid]
                mq = int(getattr(w, "max_num_seqs", 0) or 0)  # the engine's batch capacity
                b = self.bonus(min(1.0, n * cc / n_chars), int(t.pending), min_p, mq)
                escaped = escaped or b == 0.0
                bonuses[wid] = b
        best: list[int] = []
        best_s = None
        for t in terms:
            s = float(t.score) + bonuses.get(int(t.worker_id), 0.0)
            if best_s is None or s > best_s + 1e-12:
                best, best_s = [int(t.worker_id)], s
            elif abs(s - best_s) <= 1e-12:
                best.append(int(t.worker_id))
        wid = best[0] if len(best) == 1 else self.rng.choice(best)
        if bonuses.get(wid, 0.0) > 0:
            reason = "affinity"
        elif escaped and matches:
            reason = "escape"
        else:
            reason = "score"
        rows = [terms_row(t, bonuses.get(int(t.worker_id), 0.0)) for t in terms] if explain else []
        return Decision(wid, reason, rows)


class WeightedParams(KvThresholdParams, BalanceParams, PrefixParams):
    """``weighted``'s parameters: the seeds' term weights (``w_pending``, ``w_kv``, ``w_latency``,
    ``w_length``; ``enable_length_compatibility`` false zeroes the last), the latency term's scale
    (``latency_scale_ms``), the queue scale of the queue term ``w_pending·(1 − pending/max_queue)``,
    not clipped: one request is worth ``w_pending/max_queue`` of score at any depth
    (csrc/dplb_kernel.h; 0: each worker's ``max_num_seqs``), and the prefix-affinity bonus
    ``w_affinity`` × matched fraction, which fades to 0 once the affine worker has
    ``affinity_max_imbalance`` more pending requests than the least loaded."""

    w_pending: float = Field(default=0.4, ge=0)
    w_kv: float = Field(default=0.3, ge=0)
    w_latency: float = Field(default=0.2, ge=0)
    w_length: float = Field(default=0.1, ge=0)
    enable_length_compatibility: bool = True
    latency_scale_ms: float = Field(default=100.0, gt=0)
    max_queue: int = Field(default=16, ge=0, description="queue scale: one request costs w_pending/max_queue")
    w_affinity: float = Field(default=0.3, ge=0)
    affinity_max_imbalance: float = Field(default=8.0, gt=0)


def _build(p: WeightedParams, ctx: PolicyContext) -> WeightedPolicy:
    # build() has checked the kernel (needs_kernel); the config gives the scoring parameters
    return WeightedPolicy(cast("Segment", ctx.kernel), cast("ScoringParams", ctx.scoring), p.prefix_index(), w_affinity=p.w_affinity,
                          affinity_max_imbalance=p.affinity_max_imbalance,
                          balance_abs_threshold=p.balance_abs_threshold,
                          balance_rel_threshold=p.balance_rel_threshold, rng=ctx.rng, clock=ctx.clock)


SPEC = register(PolicySpec("weighted", WeightedParams, _build, needs_kernel=True,
                           reads="native kernel: the seeds' weighted score + prefix affinity"))
