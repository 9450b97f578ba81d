"""Router-owned accounting of each dispatched request, kept in the segment's router lines.

At dispatch the router knows the prompt's length and how much of it the chosen worker probably
has cached; at the first token it knows prefill is done; at the end it knows the request left.
That is what the estimated-TTFT kernel prices (csrc/dplb_kernel.h, ``dplb_pick_ttft``), so the
router keeps it itself, per worker, in the segment (atomics: every router process, and the
simulator, share one truth without a lock)::

    dispatch      router_inflight += 1, dispatched += 1, prefill_tokens += work(uncached)
    first token   prefill_tokens -= work, decode_reqs += 1, decode_ctx_tokens += prompt
                  learn: prefill rate sample, TTFT sample
    end           router_inflight -= 1, and prefill_tokens -= work (no first token seen)
                  or decode_reqs -= 1, decode_ctx_tokens -= prompt; TPOT sample

Each transition happens exactly once (:class:`RequestAccount` guards it), on success, error and
client disconnect alike, so the counters return to zero when the worker is idle.

**Prefill rate, learned.** A request that saw ``W`` outstanding prefill tokens ahead of it and had
``u`` uncached tokens of its own waited for ``W + u`` prompt tokens to be computed; with the
kernel's estimate of what the decodes in those steps cost (``decode_s``), one sample of the
worker's prefill speed is ``(W + u) / (ttft - decode_s)`` tokens/s. Samples feed a lock-free EWMA
in the segment (``Segment.prefill_rate_observe``: clipped to 4x the current value, alpha 0.1), so
a slower GPU, another model, a tensor-parallel group or a degraded engine is priced by what it
does. Requests with fewer than ``min_tokens`` tokens to compute are not learned from (their TTFT
is one engine step, not a prefill), nor are requests whose first token was inferred, not seen.

**Prefill work, not tokens.** Attention makes a prompt token dearer the longer its context: the
dense layers cost about ``2·P`` FLOPs per token (``P`` parameters), attention about ``4·L·d``
per token and per token of context before it (``L`` layers, width ``d``; Kaplan et al. 2020,
"Scaling Laws for Neural Language Models", Table 1). Computing ``u`` tokens after ``c`` cached
ones touches ``u·c + u²/2`` (token, context) pairs, so in units of one context-free token the
work is::

    work(u, c) = u · (1 + (c + u/2) / A),    A = 2·P / (4·L·d) = P / (2·L·d)

``A`` (``routing_policy.attention_tokens``) is the context length at which attention costs as
much as the dense layers: 30,500 for Llama-3.1-8B (8.0e9 / (2·32·4096)). With ``A`` > 0 the
router's lines hold work (``prefill_tokens``, the queue ahead), the rate is learned in work per
second and ``dplb`` prices work, so an 85k-token prompt (2.4 times its tokens in work at 30,500)
does not make the worker that served it look slow, nor a short prompt's worker fast. The default
is 0 (plain tokens): on the generated workloads pricing work lost more goodput than it won
(docs/DESIGN.md "Pricing attention").

Time is passed in (``now``, seconds on one monotonic clock), never read here: the live router
passes ``time.monotonic()``, the simulator its virtual clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dplb_shm import Segment
    from router.ledger import AccountedSegment


def prefill_work(uncached: float, prompt: float, attention_tokens: float) -> float:
    """Prefill work of computing the last ``uncached`` tokens of a ``prompt``-token prompt (the
    rest cached), in token-equivalents: ``u · (1 + (c + u/2) / A)`` with ``c = prompt − u`` and
    ``A = attention_tokens`` (see the module docstring; ``A <= 0``: ``u``). Negative ``uncached``
    (the policies' "ruled out") is returned unchanged."""
    if attention_tokens <= 0.0 or uncached <= 0.0:
        return uncached
    cached = max(0.0, prompt - uncached)
    return uncached * (1.0 + (cached + 0.5 * uncached) / attention_tokens)


@dataclass(frozen=True, slots=True)
class LearnSettings:
    """How observed TTFTs teach each worker's prefill rate (see the module docstring).

    ``alpha``: EWMA weight of one sample (0.1: about the last 10 requests dominate);
    ``clip``: a sample is first clipped to [rate/clip, rate*clip]; ``min_tokens``: requests that
    computed fewer prompt tokens than this teach nothing; ``step_tokens``, ``step_base_s``,
    ``decode_seq_s``, ``decode_ctx_s``: the kernel's decode-cost constants (:class:`dplb_shm.TtftParams`),
    subtracted from the TTFT so the rate is a prefill rate; ``latency_alpha``: EWMA weight of the
    router-side TTFT/TPOT averages; ``attention_tokens``: the ``A`` of :func:`prefill_work` (0:
    the lines count plain tokens).
    """

    alpha: float = 0.1
    clip: float = 4.0
    min_tokens: int = 1024
    step_tokens: float = 8192.0
    step_base_s: float = 0.005
    decode_seq_s: float = 0.00005
    decode_ctx_s: float = 3.9e-8
    latency_alpha: float = 0.1
    attention_tokens: float = 0.0

    def decode_s(self, tokens: float, decode_reqs: float, decode_ctx: float) -> float:
        """What the decodes sharing the steps of a ``tokens``-token prefill cost, s (the kernel's
        ``decode_s`` term)."""
        steps = 1.0 + math.floor(tokens / self.step_tokens)
        return steps * ((self.step_base_s + self.decode_seq_s * decode_reqs) + self.decode_ctx_s * decode_ctx)


class RequestAccount:
    """One dispatched request's share of a worker's router line; every transition exactly once.

    ``seg``: the segment (``router_inflight_add``, ``dispatched_add``, ``prefill_add``,
    ``decode_add``, ``prefill_rate_observe``, ``latency_observe``, ``router_line``);
    ``worker_id``: the slot; ``prompt_tokens``: the prompt's length in tokens; ``uncached_tokens``:
    the part of it the worker is expected to compute (the rest is in its prefix cache), charged
    to the line as :func:`prefill_work` (``learn.attention_tokens``; plain tokens without ``learn``);
    ``now``: dispatch time, s; ``learn``: :class:`LearnSettings`, or None to learn nothing;
    ``observed``: False when the router does not expect to see the first token (a non-streamed
    request): the worker's decode load at dispatch is not read, and should the first content be
    seen after all (an engine that streams the answer anyway) the TTFT is still learnt but not the
    prefill rate, which needs that load.
    """

    __slots__ = ("_decode_ctx", "_decode_reqs", "_first", "_open", "learn", "prompt_tokens", "queue_ahead",
                 "seg", "t_dispatch", "t_first", "uncached_tokens", "work", "worker_id")

    def __init__(self, seg: Segment | AccountedSegment, worker_id: int, prompt_tokens: int, uncached_tokens: int, now: float,
                 learn: LearnSettings | None = None, observed: bool = True) -> None:
        self.seg = seg
        self.worker_id = worker_id
        self.prompt_tokens = max(0, int(prompt_tokens))
        self.uncached_tokens = max(0, min(int(uncached_tokens), self.prompt_tokens))
        #: what the line is charged: the prefill work of those tokens (token-equivalents)
        self.work = round(prefill_work(self.uncached_tokens, self.prompt_tokens,
                                       learn.attention_tokens if learn is not None else 0.0))
        self.learn = learn
        self.t_dispatch = now
        self.t_first: float | None = None
        self._first = False
        self._open = True
        seg.router_inflight_add(worker_id, 1)
        seg.dispatched_add(worker_id, 1)
        after = seg.prefill_add(worker_id, self.work)
        #: outstanding prefill work ahead of this request when it was dispatched
        self.queue_ahead = max(0, int(after) - self.work)
        self._decode_reqs: float | None = None   # None: not read at dispatch (``observed`` False)
        self._decode_ctx = 0.0
        if learn is not None and observed:
            line = seg.router_line(worker_id)
            self._decode_reqs = max(0.0, float(line["decode_reqs"]))
            self._decode_ctx = max(0.0, float(line["decode_ctx_tokens"]))

    @property
    def open(self) -> bool:
        """True until :meth:`finish` ran."""
        return self._open

    @property
    def first_seen(self) -> bool:
        """True once the request moved from prefill to decode."""
        return self._first

    def first_token(self, now: float, observed: bool = True) -> float | None:
        """The first token came back (``observed``) or is assumed to have (a non-streamed request
        past its estimated TTFT): move the request from prefill to decode. Learns the worker's
        prefill rate and TTFT only when observed. Returns the TTFT (s), or None when this was not
        the first call or the request already finished."""
        if self._first or not self._open:
            return None
        self._first = True
        self.t_first = now
        seg, wid = self.seg, self.worker_id
        seg.prefill_add(wid, -self.work)
        seg.decode_add(wid, 1, self.prompt_tokens)
        ttft = now - self.t_dispatch
        lr = self.learn
        if observed and lr is not None and ttft > 0:
            seg.latency_observe(wid, ttft_s=ttft, alpha=lr.latency_alpha)
            tokens = float(self.queue_ahead + self.work)
            if tokens >= lr.min_tokens and self._decode_reqs is not None:
                compute = ttft - lr.decode_s(tokens, self._decode_reqs, self._decode_ctx)
                if compute > 0:
                    seg.prefill_rate_observe(wid, tokens / compute, lr.alpha, lr.clip)
        return ttft

    def finish(self, now: float, output_tokens: int | None = None) -> bool:
        """The request left the worker (done, failed or abandoned): give its load back. Returns
        False (and does nothing) when already finished. With ``output_tokens`` > 1 and a seen
        first token, learns the router-side TPOT ``(now - t_first) / (output_tokens - 1)``."""
        if not self._open:
            return False
        self._open = False
        seg, wid = self.seg, self.worker_id
        try:
            if self._first:
                seg.decode_add(wid, -1, -self.prompt_tokens)
            else:
                seg.prefill_add(wid, -self.work)
        finally:
            seg.router_inflight_add(wid, -1)
        lr = self.learn
        if (lr is not None and self._first and self.t_first is not None and output_tokens is not None
                and output_tokens > 1 and now > self.t_first):
            seg.latency_observe(wid, tpot_s=(now - self.t_first) / (output_tokens - 1), alpha=lr.latency_alpha)
        return True


__all__ = ["LearnSettings", "RequestAccount", "prefill_work"]
