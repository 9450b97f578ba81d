"""dplb (default): the worker with the smallest estimated time to first token, counted in tokens.

For every eligible worker i the native kernel (``Segment.pick_ttft``, ``dplb_pick_ttft`` in
csrc/dplb_kernel.h) estimates, in seconds::

    est_i = ( (W_i + u_i) / r_i                                        # prefill queue + own prefill
            + steps_i · (step_base + decode_seq·D_i + decode_ctx·C_i)   # decodes sharing those steps
            + kv_barrier · k_i / (1 − k_i)                              # KV cache filling up
            + w_decode · out · (decode_seq·B_i + decode_ctx·C_i)          # the batch, on our decode
            + w_interf · min(B_i, 64) · u_i / r_i                          # our prefill, on the batch there
            + w_miss · (u_i − u_min) / r_i                                 # a prefix miss, on those behind it
            + w_slo_miss · n_i ) / weight_i                                # decodes pushed over their TPOT bound

* ``W_i``: outstanding prefill tokens on i (uncached prompt tokens dispatched by any router whose
  first token has not come back; :mod:`router.accounting`), fresh at every dispatch;
* ``u_i``: this request's prompt tokens *not* cached on i, from the router's prefix index
  (:func:`router.policies.prefix_index.uncached_tokens`): a cache hit is worth exactly the
  prefill time it saves, so a hot prefix escapes to another worker exactly when queueing there
  costs more than recomputing the prefix elsewhere. A block every request shares (a system prompt)
  is indexed on every worker that served it and discounts them all alike, so it pulls nothing;
* ``r_i``: i's prefill rate learned from its observed TTFTs (seeded by ``prefill_tokens_per_s``);
* with ``attention_tokens`` ``A`` > 0, ``u_i`` and ``W_i`` are prefill work in token-equivalents,
  ``u·(1 + (cached + u/2)/A)`` (:func:`router.accounting.prefill_work`: attention's cost grows
  with the context), and ``r_i`` is learned in the same units; ``/dplb/route`` then shows
  ``prefill_work`` beside ``uncached_tokens``. Default 0: plain tokens (docs/DESIGN.md
  "Pricing attention");
* ``D_i``, ``C_i``: decoding requests on i and their context tokens; ``steps_i = 1 +
  floor((W_i + u_i) / step_tokens)``;
* ``k_i``: KV-cache usage (above ``kv_cache_threshold`` the worker is not eligible at all);
* ``B_i``: requests in i's batch (router in-flight, or the engine's running + waiting when larger),
  ``out``: the request's ``max_tokens`` (256 when absent, capped at 4,096). Without this term a
  burst sharing a cached prefix would pile onto its holder (each request costs it ~0 prefill)
  while every TPOT there suffers; with it, one more request in the batch costs what it costs.

The last two terms price what the choice costs the work already on the worker, not this request
(issue 29 item 4; each in seconds of other requests' delay, summed — the marginal cost of an
arrival in queueing theory is its own delay plus the delay it adds to everyone else):

* **interference** ``w_interf · B_i · u_i / r_i``: continuous batching runs our ``u_i`` prompt
  tokens in the steps that also carry the ``B_i`` requests in flight on i (its decodes, and the
  prefills queued ahead, which decode while ours runs), so each of their next tokens comes
  ``u_i / r_i`` later; under FCFS nothing queued behind us exists yet. Summed: ``B_i·u_i/r_i``.
  With ``w_interf = 1`` the own prefill plus this is ``u_i·(B_i + 1)/r_i``, LMetric's score in
  seconds (LMetric leaves the queue ahead out; we keep it). ``B_i`` counts at most
  ``interf_batch_cap`` (64; 0 = no cap): in larger batches the differences between workers say
  where the long outputs are, not how much our prefill harms (decodes with slack absorb it; the
  TPOT-SLO term below prices those without), and uncapped, the worker with the smallest batch
  drew every long prompt until its prefill saturated (docs/DESIGN.md "Capping the batch the
  interference counts").
* **prefix miss** ``w_miss · (u_i − u_min) / r_i``, ``u_min`` the fewest uncached tokens over the
  eligible workers: the compute this placement spends that the best-hit placement would not.
  Worker i's prefill is busy that much longer and every request reaching it before the recompute
  drains waits for it in full (FCFS); ``w_miss`` is that number of requests (a count), so the
  term is their summed delay in seconds. ``prefill_s`` already counts the recompute once, for
  this request alone.

Each is switched off by a weight of 0; the defaults were chosen by the ablation in
docs/DESIGN.md ("Pricing the cluster") over every workload, not one.

* **TPOT-SLO misses** ``w_slo_miss · n_i`` (issue 29, round 8; :mod:`router.policies.tpot_slo`):
  ``n_i`` is how many of this router process's streamed requests in flight on i our prefill
  (``u_i`` at ``r_i``) would push over the TPOT bound ``slo_tpot_s`` (0.1 s; 0 = off): each
  victim's slack is what its bound allows minus its decode time at its pace so far, and our
  prefill adds ``min(u_i, left · step_tokens) / r_i`` to its remaining steps. A victim with slack
  to spare costs nothing, nor does one already lost; ``w_slo_miss`` (1 s) is the price of one
  miss. The kernel ranks, this term is added in Python over its rows (``pick_ttft_rows``) only
  when some offered worker has a victim within reach; ``/dplb/route`` shows ``slo_victims`` and
  ``slo_miss_s``. Output bounds are the requests' ``max_tokens`` (``default_output_tokens``
  without one); streamed tokens come from the proxy's stream meter and native relay.

Ties break at random. The field's versions of the same idea, for comparison (each is a policy of
its own here): SGLang gateway's ``least_load`` (queued tokens / throughput + the same KV barrier,
no prefix term), Dynamo's KV router (``kv_cost``: uncached prefill blocks + active decode blocks)
and LMetric (``lmetric``: new prefill tokens × (batch + 1)).

If every offered worker's KV cache is above ``kv_cache_threshold`` (overload), the estimate still
decides among them, with the threshold lifted (reason ``kv_full``; the KV barrier ranks them);
only when the kernel finds nobody at all (stale heartbeats) the least-loaded router-eligible
worker is taken (reason ``fallback``) rather than refusing service.

Config::

    routing_policy: {policy: dplb, prefill_tokens_per_s: 30769, step_tokens: 8192, kv_barrier_s: 0.15,
                     w_decode: 0.25, w_interf: 0.5, interf_batch_cap: 64, w_miss: 0.0, attention_tokens: 0,
                     slo_tpot_s: 0.1, w_slo_miss: 1.0, kv_cache_threshold: 0.8, prefix_chunk_chars: 64}
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import Field

from router.accounting import prefill_work
from router.policies.base import (
    BasePolicy,
    Decision,
    Decodes,
    RequestInfo,
    least_loaded,
    pending,
)
from router.policies.prefix_index import (
    PrefixIndex,
    PrefixIndexedPolicy,
    PrefixParams,
    uncached_tokens,
)
from router.policies.registry import (
    KvBarrierParams,
    KvThresholdParams,
    PolicyContext,
    PolicySpec,
    RateParams,
    register,
)
from router.policies.tpot_slo import count_pushed

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot
    from router.policies.base import ScoreValue

EXCLUDED = -1.0  # an uncached-token entry below 0 rules the slot out in the kernel


class DplbPolicy(PrefixIndexedPolicy, BasePolicy):
    """Estimated-TTFT routing over the native kernel (see the module docstring).

    ``kernel``: object with ``num_slots``, ``pick_ttft(params, prompt_len, uncached) -> (int, est)``
    ``pick_ttft_explain(...) -> (int, list[TtftTerms])`` and ``pick_ttft_rows(...)`` (a ``dplb_shm.Segment``); ``params``: the
    ``dplb_shm.TtftParams`` handed to it; ``clock``: optional ``() -> ns`` for the kernel's heartbeat
    check (the simulator passes its virtual clock; None = the kernel's own CLOCK_MONOTONIC).
    """

    name = "dplb"
    needs_text = True
    uses_kernel = True

    # Any: a Segment and TtftParams, which PolicyContext holds as Optional (build() checks needs_kernel)
    def __init__(self, kernel: Any, params: Any, index: PrefixIndex | None = None, rng=None,  # type: ignore[explicit-any]
                 clock: Callable[[], int] | None = None, default_output_tokens: int = 256, max_output_tokens: int = 4096,
                 attention_tokens: float = 0.0, slo_tpot_s: float = 0.1, w_slo_miss: float = 1.0) -> None:
        super().__init__(rng)
        #: the TPOT bound the SLO-miss term protects, s (0: the term is off), and its price per
        #: victim pushed over it, s (router.policies.tpot_slo)
        self.slo_tpot_s = slo_tpot_s
        self.w_slo_miss = w_slo_miss
        self.decodes: Decodes | None = None
        #: ``A`` of :func:`router.accounting.prefill_work` (0: the kernel prices plain tokens)
        self.attention_tokens = attention_tokens
        self.kernel = kernel
        self.params = params
        self.default_output_tokens = default_output_tokens
        self.max_output_tokens = max_output_tokens
        self.index = index if index is not None else PrefixIndex()   # an empty index is falsy (len 0)
        self.clock = clock
        #: the same parameters without the KV threshold, for when every worker is above it
        self._relaxed = (replace(params, kv_cache_threshold=1.0)
                         if params is not None and params.kv_cache_threshold < 1.0 else None)
        #: the same parameters with the terms that price others' delay (and our own decode) off:
        #: the kernel's estimate is then this request's own TTFT (``Decision.ttft_s``)
        self._ttft_only = (replace(params, w_decode=0.0, w_interf=0.0, w_miss=0.0, kv_cache_threshold=1.0)
                           if params is not None else None)
        self._pending_hashes: tuple[int, Sequence[int]] | None = None

    def bind_decodes(self, book: Decodes) -> None:
        """Keep the scheduler's :class:`router.scheduling.DecodeBook`: the SLO-miss term's victims."""
        self.decodes = book

    def victims(self, workers: Sequence[WorkerSnapshot]) -> dict[int, list[tuple[float, float]]]:
        """Per offered worker with any, the decodes our prefill could still push over the TPOT
        bound (:func:`router.policies.tpot_slo.victim_rows`); empty when the term is off."""
        book = self.decodes
        if book is None or self.slo_tpot_s <= 0.0 or self.w_slo_miss <= 0.0:
            return {}
        step = float(self.params.step_tokens)
        out: dict[int, list[tuple[float, float]]] = {}
        for w in workers:
            wid = w.worker_id
            if book.has_requests(wid):
                rows = book.victim_rows(wid, self.slo_tpot_s, step, self.default_output_tokens)
                if rows:
                    out[wid] = rows
        return out

    def uncached_vector(self, workers: Sequence[WorkerSnapshot], req: RequestInfo) -> tuple[list[float], dict[int, int]]:
        """Per slot, the prompt tokens to compute there (``EXCLUDED`` for workers not offered), and
        the prefix matches (``{worker_id: chunks}``)."""
        matches = self.matches(req) if req.text else {}
        vec = [EXCLUDED] * int(self.kernel.num_slots)
        if not matches:   # no prefix held anywhere: the whole prompt everywhere
            whole = float(req.prompt_len)
            for w in workers:
                vec[w.worker_id] = whole
            return vec, matches
        for w in workers:
            vec[w.worker_id] = float(uncached_tokens(self.index, matches, req.text, req.prompt_len, w.worker_id))
        return vec, matches

    def work_vector(self, vec: list[float], prompt_len: int) -> list[float]:
        """``vec`` (uncached tokens per slot) as prefill work, token-equivalents
        (:func:`router.accounting.prefill_work` with ``attention_tokens``; ruled-out slots stay
        below 0): what the kernel prices, in the units of the router lines' queue. ``vec``
        itself when ``attention_tokens`` is 0 (no copy on the default path)."""
        a = self.attention_tokens
        if a <= 0.0:
            return vec
        return [prefill_work(u, prompt_len, a) for u in vec]

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        vec, matches = self.uncached_vector(workers, req)
        work = self.work_vector(vec, req.prompt_len)
        now = self.clock() if self.clock is not None else None
        rows: list[dict[str, ScoreValue]] = []
        out = float(min(req.max_tokens or self.default_output_tokens, self.max_output_tokens))
        victims = self.victims(workers)
        missed: dict[int, int] = {}
        est: float | None
        if explain:
            wid, terms = self.kernel.pick_ttft_explain(self.params, req.prompt_len, work, now_ns=now, out_tokens=out)
            if victims and int(wid) >= 0:
                wid, est, missed = self._with_slo_misses(
                    [(t.worker_id, t.est_s, t.uncached_tokens, t.rate, t.weight) for t in terms], victims)
            else:
                est = next((float(t.est_s) for t in terms if int(t.worker_id) == wid), None)
            # the kernel's ``uncached_tokens`` is the work it was given: shown as ``prefill_work``,
            # beside the tokens themselves; the score includes the SLO-miss term
            w_slo = self.w_slo_miss
            rows = [{"worker_id": int(t.worker_id),
                     "score": -(float(t.est_s) + w_slo * missed.get(int(t.worker_id), 0) / float(t.weight)),
                     **t.to_dict(), "uncached_tokens": vec[int(t.worker_id)], "prefill_work": float(t.uncached_tokens),
                     "slo_victims": missed.get(int(t.worker_id), 0),
                     "slo_miss_s": w_slo * missed.get(int(t.worker_id), 0)}
                    for t in terms]
        elif victims:
            # the kernel's rows (no TtftTerms built), re-ranked with the SLO-miss term
            wid, krows = self.kernel.pick_ttft_rows(self.params, req.prompt_len, work, now_ns=now, out_tokens=out)
            est = None
            if int(wid) >= 0:
                wid, est, missed = self._with_slo_misses(krows, victims)
        else:
            wid, est = self.kernel.pick_ttft(self.params, req.prompt_len, work, now_ns=now, out_tokens=out)
        wid = int(wid)
        if wid < 0 and self._relaxed is not None:
            # every offered worker's KV cache is above the threshold (overload): still route by the
            # estimate, whose KV barrier ranks them, not by request counts
            wid, est = self.kernel.pick_ttft(self._relaxed, req.prompt_len, work, now_ns=now, out_tokens=out)
            wid = int(wid)
            if wid >= 0:
                return Decision(wid, "kv_full", rows, uncached_tokens=int(vec[wid]), est_s=est)
        if wid < 0:
            w = least_loaded(workers, self.rng)
            if explain and not rows:
                rows = [{"worker_id": x.worker_id, "score": None, "pending": pending(x)} for x in workers]
            return Decision(w.worker_id, "fallback", rows, uncached_tokens=int(vec[w.worker_id]))
        if not matches:
            reason = "ttft"
        else:
            least = min((matches.get(w.worker_id, 0) for w in workers), default=0)
            reason = "prefix" if matches.get(wid, 0) > least else "ttft"
        return Decision(wid, reason, rows, uncached_tokens=int(vec[wid]), est_s=est,
                        ttft_s=self.own_ttft(wid, work, req.prompt_len, now, out) if self.report_ttft else None,
                        slo_victims=missed.get(wid, 0))

    def own_ttft(self, wid: int, work: list[float], prompt_len: int, now: int | None, out: float) -> float | None:
        """The chosen worker ``wid``'s estimate without the terms that price others' delay
        (``w_decode``, ``w_interf``, ``w_miss`` 0): queue ahead + own prefill, the decode steps
        sharing them, the KV barrier, over the weight (csrc/dplb_kernel.h). One kernel call over a
        vector offering ``wid`` alone; None when the kernel finds it ineligible."""
        p = self._ttft_only
        if p is None:
            return None
        only = [EXCLUDED] * len(work)
        only[wid] = work[wid]
        k, est = self.kernel.pick_ttft(p, prompt_len, only, now_ns=now, out_tokens=out)
        return float(est) if int(k) == wid else None


    def _with_slo_misses(self, krows: Sequence[tuple[int, float, float, float, float]],
                         victims: dict[int, list[tuple[float, float]]]) -> tuple[int, float, dict[int, int]]:
        """The kernel's eligible workers (``krows``: ``(worker_id, est_s, uncached work, rate,
        weight)`` each, ``Segment.pick_ttft_rows``) re-ranked with the SLO-miss term: ``est_s +
        w_slo_miss · pushed / weight``, ``pushed`` the victims our prefill (the row's work at its
        pooled rate) pushes over the TPOT bound. Returns ``(worker, its estimate, {worker:
        pushed})``; ties (within 1e-9 s, as the kernel's) broken at random."""
        w = self.w_slo_miss
        missed: dict[int, int] = {}
        best: list[int] = []
        best_est = float("inf")
        for k, est_s, unc, rate, weight in krows:
            rows = victims.get(k)
            n = count_pushed(rows, unc, rate) if rows else 0
            if n:
                missed[k] = n
            est = est_s + w * n / weight
            if est < best_est - 1e-9:
                best, best_est = [k], est
            elif est <= best_est + 1e-9:
                best.append(k)
        return (best[0] if len(best) == 1 else self.rng.choice(best)), best_est, missed


class DplbParams(RateParams, KvThresholdParams, KvBarrierParams, PrefixParams):
    """``dplb``'s parameters (besides the shared groups): prompt tokens assumed per request waiting
    in an engine that the routers did not send (``waiting_tokens``); the weight of the batch term
    (``w_decode``: what a worker's batch adds to this request's decode; 0 = TTFT only) and the
    output length assumed when a request has no ``max_tokens``; what a choice costs the work
    already on the worker (csrc/dplb_kernel.h, docs/DESIGN.md "Pricing the cluster"): ``w_interf``
    weighs our prefill's delay summed over the requests sharing its steps (B·u/r), ``w_miss``
    counts the later requests that wait behind a prefix miss's recompute ((u − u_min)/r);
    ``interf_batch_cap``: the interference term counts at most this many requests of a batch (0 =
    no cap); ``rate_band``: learned rates within
    this fraction of the workers' median count as the median (sampling noise between identical
    engines must not steer a burst; csrc/dplb_kernel.h), 0 = off; ``slo_tpot_s``: the TPOT bound,
    s, whose misses a placement is charged ``w_slo_miss`` s each (router.policies.tpot_slo; 0 =
    off)."""

    waiting_tokens: int = Field(default=1024, ge=0)
    w_decode: float = Field(default=0.25, ge=0)
    w_interf: float = Field(default=0.5, ge=0)
    w_miss: float = Field(default=0.0, ge=0)
    interf_batch_cap: int = Field(default=64, ge=0)
    default_output_tokens: int = Field(default=256, ge=1)
    rate_band: float = Field(default=0.25, ge=0)
    slo_tpot_s: float = Field(default=0.1, ge=0)
    w_slo_miss: float = Field(default=1.0, ge=0)


def _build(p: DplbParams, ctx: PolicyContext) -> DplbPolicy:
    return DplbPolicy(ctx.kernel, ctx.ttft, p.prefix_index(), rng=ctx.rng, clock=ctx.clock,
                      default_output_tokens=p.default_output_tokens, attention_tokens=p.attention_tokens,
                      slo_tpot_s=p.slo_tpot_s, w_slo_miss=p.w_slo_miss)


SPEC = register(PolicySpec("dplb", DplbParams, _build, needs_kernel=True,
                           reads="native kernel: estimated TTFT in tokens + prefix index"))
