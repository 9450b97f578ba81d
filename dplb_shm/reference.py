"""Pure-Python reference of the native scoring kernel (``csrc/dplb_kernel.h``).

Used by tests to check the native kernel on the same inputs; never used for routing. The order
of floating-point operations follows the C code exactly, so scores agree bit for bit.

Formula (weights from :class:`~dplb_shm.ScoringParams`, defaults are the seeds' 0.4/0.3/0.2/0.1,
docs/DESIGN.md "Scoring")::

    eligible     = state READY and now - heartbeat <= heartbeat_timeout and circuit != OPEN
                   and kv_cache_usage <= kv_cache_threshold (unknown -1 passes) and weight > 0
                   and the slot was read consistently (not ``stale``: the kernel skips a slot
                   whose seqlock stays odd)
    pending      = max(running + waiting, inflight) + max(0, router_inflight - inflight)
    max_queue    = params.max_queue or slot.max_num_seqs or 256 (vLLM's default max_num_seqs):
                   the queue scale, the pending count at which the queue term reaches 0
    pending_term = w_pending * (1 - pending / max_queue)   not clipped (see csrc/dplb_kernel.h)
    kv_term      = w_kv * (1 - max(kv, 0))
    latency_term = w_latency * (1 / (1 + ttft_ms / latency_scale_ms), or 1 without a sample)
    length_term  = w_length * sum_k h[k] * 2^-|k - bin(prompt_len)| / sum_k h[k]   (1 if empty),
                   h[k] = min(hist[k], 2^26)
    score        = weight * (((pending_term + kv_term) + latency_term) + length_term) + affinity[i]

Ties (score >= best - 1e-9) break by ``ties[int(rng_u * len(ties))]`` in slot order.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from dplb_shm.types import (
    Circuit,
    ScoreTerms,
    ScoringParams,
    TtftParams,
    TtftTerms,
    WorkerSnapshot,
    WorkerState,
)

TIE_EPS = 1e-9
DEFAULT_MAX_QUEUE = 256  # vLLM EngineArgs default max_num_seqs
HIST_BINS = 32


def len_bin(n: int) -> int:
    """Histogram bin of a prompt length: floor(log2 n) clipped to [0, 31]; 0 for n <= 1."""
    return 0 if n <= 1 else min(HIST_BINS - 1, int(n).bit_length() - 1)


HIST_SAT = 1 << 26  # counts saturate here for scoring (keeps the kernel's fixed-point sum in 63 bits)


def length_compat(hist: Sequence[int], b: int) -> float:
    """How well a prompt in bin ``b`` fits the queued prompt-length histogram ``hist`` (0..1].

    ``sum_k h[k] * 2^-|k-b| / sum_k h[k]`` with ``h[k] = min(hist[k], 2^26)``, the numerator
    summed exactly with 31 fractional bits, as the kernel does; 1.0 when nothing is queued.
    """
    num = 0
    den = 0
    for k in range(HIST_BINS):
        c = min(hist[k] if k < len(hist) else 0, HIST_SAT)
        num += c << (31 - abs(k - b))
        den += c
    return (float(num) * 2.0 ** -31) / float(den) if den else 1.0


def score_terms(s: WorkerSnapshot, params: ScoringParams, prompt_len: int, affinity: float,
                now_ns: int) -> ScoreTerms | None:
    """Terms of one worker's score, or None when it is not eligible."""
    if s.state != WorkerState.READY or s.stale:
        return None
    if now_ns - s.heartbeat_ns > int(params.heartbeat_timeout_ms * 1e6):
        return None
    if s.circuit == Circuit.OPEN:
        return None
    if s.kv_cache_usage > params.kv_cache_threshold:
        return None
    if not s.weight > 0.0:
        return None
    known = max(s.num_running + s.num_waiting, s.inflight)
    unseen = max(0, s.router_inflight - s.inflight)
    pending = float(known + unseen)
    if params.max_queue > 0:
        mq = float(params.max_queue)
    else:
        mq = float(s.max_num_seqs) if s.max_num_seqs > 0 else float(DEFAULT_MAX_QUEUE)
    pending_term = params.w_pending * (1.0 - pending / mq)
    kv = max(s.kv_cache_usage, 0.0)
    kv_term = params.w_kv * (1.0 - kv)
    lat = 1.0 if s.ttft_ms < 0.0 else 1.0 / (1.0 + s.ttft_ms / params.latency_scale_ms)
    latency_term = params.w_latency * lat
    length_term = params.w_length * length_compat(s.prompt_len_hist, len_bin(prompt_len))
    score = s.weight * (((pending_term + kv_term) + latency_term) + length_term) + affinity
    return ScoreTerms(worker_id=s.worker_id, score=score, pending=pending, pending_term=pending_term,
                      kv_term=kv_term, latency_term=latency_term, length_term=length_term,
                      affinity=affinity, weight=s.weight)


def pick(snapshots: Sequence[WorkerSnapshot], params: ScoringParams, prompt_len: int,
         affinity: Sequence[float] | None, now_ns: int, rng_u: float) -> tuple[int, list[ScoreTerms]]:
    """Reference pick over ``snapshots`` (index == slot).

    ``affinity``: per-slot bonus (shorter lists pad with 0); ``now_ns``: CLOCK_MONOTONIC ns;
    ``rng_u``: the tie-breaking draw in [0, 1). Returns ``(chosen slot or -1, terms of every
    eligible worker in slot order)``.
    """
    terms: list[ScoreTerms] = []
    for i, s in enumerate(snapshots):
        aff = float(affinity[i]) if affinity is not None and i < len(affinity) else 0.0
        t = score_terms(s, params, prompt_len, aff, now_ns)
        if t is not None:
            terms.append(t)
    if not terms:
        return -1, terms
    best = max(t.score for t in terms)
    ties = [t.worker_id for t in terms if t.score >= best - TIE_EPS]
    j = min(len(ties) - 1, max(0, int(rng_u * len(ties))))
    return ties[j], terms


def ttft_terms(s: WorkerSnapshot, params: TtftParams, prompt_len: int, uncached: float | None,
               now_ns: int, out_tokens: float = 0.0) -> TtftTerms | None:
    """Estimated-TTFT terms of one worker at its own rate (pass 1 of ``dplb_pick_ttft`` in
    csrc/dplb_kernel.h), or None when it is not eligible. ``uncached``: this request's prompt
    tokens not cached there (None: ``prompt_len``; negative: ruled out by the router)."""
    if s.state != WorkerState.READY or s.stale:
        return None
    u = float(prompt_len) if uncached is None else float(uncached)
    if u < 0.0:
        return None
    if now_ns - s.heartbeat_ns > int(params.heartbeat_timeout_ms * 1e6):
        return None
    if s.circuit == Circuit.OPEN:
        return None
    if s.kv_cache_usage > params.kv_cache_threshold:
        return None
    if not s.weight > 0.0:
        return None
    rate = s.prefill_rate if s.prefill_rate > 0.0 else params.prefill_rate
    waiting = max(0, s.num_waiting)
    ext = max(0, max(0, s.num_running) + waiting - s.inflight)
    queue = (float(s.prefill_tokens) if s.prefill_tokens > 0 else 0.0) + float(min(ext, waiting)) * params.waiting_tokens
    dreq = float(s.decode_reqs) if s.decode_reqs > 0 else 0.0
    dctx = float(s.decode_ctx_tokens) if s.decode_ctx_tokens > 0 else 0.0
    tokens = queue + u
    steps = 1.0 + math.floor(tokens / params.step_tokens)
    decode_s = steps * ((params.step_base_s + params.decode_seq_s * dreq) + params.decode_ctx_s * dctx)
    k = 0.0 if s.kv_cache_usage < 0.0 else min(s.kv_cache_usage, 0.99)
    kv_s = params.kv_barrier_s * k / (1.0 - k)
    batch = float(max(0, s.router_inflight) + ext)
    batch_s = params.w_decode * out_tokens * (params.decode_seq_s * batch + params.decode_ctx_s * dctx)
    return priced(TtftTerms(worker_id=s.worker_id, est_s=0.0, queue_tokens=queue, uncached_tokens=u, rate=rate,
                            own_rate=rate, steps=steps, prefill_s=0.0, decode_s=decode_s, kv_s=kv_s,
                            batch_s=batch_s, interf_s=0.0, miss_s=0.0, decode_reqs=dreq, batch=batch,
                            outside_reqs=float(ext), weight=s.weight), rate, params, u)


def priced(t: TtftTerms, rate: float, params: TtftParams, umin: float) -> TtftTerms:
    """``t`` priced at ``rate`` tokens/s (pass 2 of ``dplb_pick_ttft``); ``umin``: the fewest
    uncached tokens over the eligible workers (the miss term's reference)."""
    prefill_s = (t.queue_tokens + t.uncached_tokens) / rate
    b_int = params.interf_batch_cap if 0.0 < params.interf_batch_cap < t.batch else t.batch
    interf_s = params.w_interf * b_int * t.uncached_tokens / rate
    miss_s = params.w_miss * (t.uncached_tokens - umin) / rate
    est = (((((prefill_s + t.decode_s) + t.kv_s) + t.batch_s) + interf_s) + miss_s) / t.weight
    return dataclasses.replace(t, rate=rate, prefill_s=prefill_s, interf_s=interf_s, miss_s=miss_s, est_s=est)


def pick_ttft(snapshots: Sequence[WorkerSnapshot], params: TtftParams, prompt_len: int,
              uncached: Sequence[float] | None, now_ns: int, rng_u: float,
              out_tokens: float = 0.0) -> tuple[int, list[TtftTerms]]:
    """Reference of ``Segment.pick_ttft``: the smallest estimated TTFT, ties (within 1e-9 s)
    broken by ``ties[int(rng_u * len(ties))]`` in slot order. Returns ``(slot or -1, terms)``."""
    terms: list[TtftTerms] = []
    for i, s in enumerate(snapshots):
        u = float(uncached[i]) if uncached is not None and i < len(uncached) else None
        t = ttft_terms(s, params, prompt_len, u, now_ns, out_tokens)
        if t is not None:
            terms.append(t)
    if not terms:
        return -1, terms
    umin = min(t.uncached_tokens for t in terms)
    if params.rate_band > 0.0 and len(terms) > 1:
        m = statistics.median(t.own_rate for t in terms)
        lo, hi = m / (1.0 + params.rate_band), m * (1.0 + params.rate_band)
        terms = [priced(t, m if lo <= t.own_rate <= hi else t.own_rate, params, umin) for t in terms]
    else:
        terms = [priced(t, t.own_rate, params, umin) for t in terms]
    best = min(t.est_s for t in terms)
    ties = [t.worker_id for t in terms if t.est_s <= best + TIE_EPS]
    j = min(len(ties) - 1, max(0, int(rng_u * len(ties))))
    return ties[j], terms
