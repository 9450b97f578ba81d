"""What a placement costs the requests already decoding on a worker, counted in TPOT-SLO misses.

Continuous batching runs a new request's prefill in the same engine steps as the decodes already
on the worker: each of their next tokens waits for our prompt's chunk (chunked prefill: at most
``step_tokens`` prompt tokens per step, so at most one chunk per decode step). Under a TPOT bound
``T`` (the operator's SLO: a request meets it when its mean time per output token after the first
is ≤ ``T``; DistServe, Zhong et al. 2024, and ``vllm bench serve --goodput``) that delay is harmless
to a victim with slack to spare and fatal to one close to its bound. So the cost of the placement
is the number of victims it pushes over ``T`` — not how much it raises their TPOT (that herds
long-running sessions onto the workers carrying the longest decodes, which look cheapest; issue
29, bench/results/goodput.md Rounds 6 and 7).

A victim ``v`` is one streamed request in flight on the worker (queued, in prefill or decoding)
with an output bound ``o`` (its ``max_tokens``; ``default_output_tokens`` when it sent none) that
has streamed ``k`` tokens, ``spent`` seconds after its first::

    left   = o − max(k, 1)                      decode steps still to come
    mean   = spent / (k − 1)   (0 while k ≤ 1)  its mean step so far
    base   = spent + left · mean                its decode time at that pace
    budget = T · (o − 1)                        what its TPOT bound allows
    slack  = budget − base

``v`` is already lost without us when ``slack < 0`` (counts 0: a miss is priced once, where it
is caused) and pushed over by our ``u`` uncached tokens at rate ``r`` when
``min(u, left · step_tokens) / r > slack``. The term is ``w_slo_miss`` seconds per victim pushed
over (:func:`victim_rows`, :func:`count_pushed`). Victims with ``o ≤ 1`` (no TPOT) or ``k ≥ o``
(done) count 0; non-streamed requests are not victims (their client sees one answer, no TPOT).

Only this router process's requests are seen (its leases); with several router processes each
prices its own share of a worker's decodes.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def victim_rows(requests: Iterable[tuple[int | None, int, float | None]], tpot_slo_s: float, step_tokens: float,
                default_output_tokens: int) -> list[tuple[float, float]]:
    """The victims a prefill could still push over the TPOT bound, as ``(slack_s, cap_tokens)``
    pairs (see the module docstring): ``slack_s`` ≥ 0, the seconds of delay the victim can still
    absorb; ``cap_tokens = left · step_tokens``, the most of a prompt that can share its remaining
    steps.

    ``requests``: one ``(max_tokens or None, output tokens streamed so far, seconds since its first
    token or None before it)`` per streamed request in flight on the worker; ``tpot_slo_s`` > 0:
    the TPOT bound, s; ``step_tokens`` > 0: prompt tokens per engine step (chunked prefill);
    ``default_output_tokens``: the bound assumed for a request without ``max_tokens``. Raises
    ValueError on a bound or step size that is not positive."""
    if tpot_slo_s <= 0 or step_tokens <= 0:
        raise ValueError(f"tpot_slo_s {tpot_slo_s} and step_tokens {step_tokens} must be > 0")
    rows: list[tuple[float, float]] = []
    append = rows.append
    for max_tokens, k, since_first in requests:
        o = default_output_tokens if max_tokens is None else max_tokens
        if o <= 1 or k >= o:
            continue
        spent = since_first if since_first is not None and since_first > 0.0 else 0.0
        if k > 1:
            # base = spent + (o − k) · spent / (k − 1) = spent · (o − 1) / (k − 1)
            slack = (o - 1) * (tpot_slo_s - spent / (k - 1))
            left = o - k
        else:
            slack = (o - 1) * tpot_slo_s - spent
            left = o - 1
        if slack >= 0.0:
            append((slack, left * step_tokens))
    return rows


def count_pushed(rows: Sequence[tuple[float, float]], uncached: float, rate: float) -> int:
    """How many of ``rows`` (:func:`victim_rows`) a prefill of ``uncached`` tokens at ``rate``
    tokens/s pushes over their bound: ``min(uncached, cap) / rate > slack``. 0 when ``uncached``
    ≤ 0 (a full prefix hit delays nobody) or ``rate`` ≤ 0 (no rate known: nothing is priced)."""
    if uncached <= 0.0 or rate <= 0.0:
        return 0
    n = 0
    for slack, cap in rows:
        if min(cap, uncached) > slack * rate:
            n += 1
    return n


__all__ = ["count_pushed", "victim_rows"]
