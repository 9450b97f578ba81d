"""Experiment (issue 29, fourth round): interference priced by the victims' TPOT, in the simulator.

``dplb``'s interference term charges a placement ``w_interf · B_i · u_i / r_i``: our ``u_i``
prompt tokens delay each of the ``B_i`` requests in flight on worker ``i`` by ``u_i / r_i``
seconds, counted alike. Under a TPOT bound they are not alike: the delay raises a victim's TPOT
by ``delay / (o_v − 1)`` (``o_v`` its output tokens), and chunked prefill can add at most one
chunk (``step_tokens / r``) to each of its ``o_v − 1`` decode steps. A request with 4 output
tokens that shares three steps with an 8,192-token chunk has a TPOT near 300 ms; one with 256
output tokens hardly notices a 1 s prefill. On Mooncake's synthetic trace most of ``dplb``'s SLO
misses at the edge of capacity are exactly those: long prompts with 3-13 output tokens whose
decode steps carried another long prefill.

This script runs ``dplb-simulate`` (same flags, same output) with ``dplb`` given one extra
term per candidate worker, in seconds::

    tpot_s_i = w_tpot · Σ_v min(u_i, (o_v − 1)·S) / (r_i · (o_v − 1)) · (o_ref − 1)

over the requests ``v`` in flight on ``i`` (queued or running) with ``o_v`` > 1: each victim's
TPOT increase, converted to the end-to-end delay that would raise a reference request's
(``o_ref`` output tokens, ``dplb``'s default 256) TPOT as much. ``S`` is the kernel's
``step_tokens``, ``r_i`` the worker's (pooled) rate from the kernel's own terms. ``--only-whole``
counts only the victims whose every remaining step would carry our prefill (``(o_v − 1)·S <
u_i``); ``--replace`` drops ``interf_s`` so the TPOT form stands in for it.

It is a prototype, not a policy: the victims' ``max_tokens`` are read from the simulated
engines' queues (what a router could count in its lines, but does not), and the choice is made
in Python over the kernel's explanation rows (no tie breaking). ``--victim-outputs`` says how
well those lengths are known: ``exact`` (the trace's output length, which the simulator passes as
``max_tokens``: an oracle), ``pow2`` or ``x4`` (a client's looser bound). Measured with it
(docs/DESIGN.md "TPOT-priced interference", bench/results/goodput.md "Round 5"): over a grid of
rates it misses fewer requests than plain dplb with exact lengths, and the gain on the generated
workloads is gone with ``pow2`` or ``x4``, so it was not built into the kernel. ``learned``
(``LearnedOutputs``: the lengths of finished requests of the victim's prompt-length class, as a
router counts them in the streams it proxies) and ``learned-pow2`` / ``learned-x4`` (the same,
capped by the client's bound) need no oracle; Round 6 in bench/results/goodput.md: they help on
Round 5's windows and not on sixteen windows of seeds 2-5 chosen in advance (the agentic workload
loses), so they are not adopted either.

``--tpot-slo-s T`` (Round 7) prices the victims differently: not by how much our prefill raises
their TPOT but by how many of them it pushes over the bound ``T`` (:func:`slo_misses`; ``w_tpot``
seconds each): a victim with slack to spare costs nothing, and so does one already over its
bound. It is the first form that misses fewer than plain dplb on both sets of windows with the
client's bound (``pow2``) instead of the oracle (bench/results/goodput.md "Round 7").

Usage: ``python -m prototypes.tpot_interference [--tpot-slo-s 0.1] --w-tpot 0.2 [--victim-outputs exact|pow2|x4|learned|learned-pow2|learned-x4] [--only-whole] [--replace] DPLB-SIMULATE-ARGS``
"""
from __future__ import annotations

import argparse
import sys
from collections import deque
from collections.abc import Sequence
from typing import Any

from router.policies.tpot_slo import count_pushed, victim_rows
from simulate.settings import CLIENT_BOUNDS

#: o_ref: the output length the TPOT increase is converted at (dplb's default_output_tokens)
REFERENCE_OUTPUT_TOKENS = 256


def tpot_penalty_s(uncached: float, rate: float, victim_outputs: Sequence[int], step_tokens: float,
                   reference_output: int = REFERENCE_OUTPUT_TOKENS, only_whole: bool = False) -> float:
    """The summed TPOT increase our ``uncached``-token prefill gives the requests in flight on a
    worker (``victim_outputs``: their output tokens), in seconds of a reference request's delay
    (see the module docstring). ``rate``: prompt tokens/s (> 0); ``step_tokens``: tokens per step
    (> 0). Victims with one output token (no TPOT) count 0. Raises ValueError on a rate or step
    size that is not positive."""
    if rate <= 0 or step_tokens <= 0:
        raise ValueError(f"rate {rate} and step_tokens {step_tokens} must be > 0")
    total = 0.0
    for o in victim_outputs:
        if o <= 1:
            continue
        steps = o - 1
        if only_whole and steps * step_tokens >= uncached:
            continue
        total += min(uncached, steps * step_tokens) / (rate * steps) * (reference_output - 1)
    return total


#: How the victims' output lengths are known: "exact" (the trace's, an oracle), "pow2" (rounded up
#: to a power of two, a client's max_tokens with up to 2x slack), "x4" (four times, a looser bound)
VICTIM_KNOWLEDGE = {k: CLIENT_BOUNDS[k] for k in ("exact", "pow2", "x4")}   # dplb-simulate --client-max-tokens' bounds


#: --victim-outputs modes that learn: "learned" (the class's lengths), "learned-pow2" / "learned-x4"
#: (the same, each capped by the victim's own bound as VICTIM_KNOWLEDGE's pow2 / x4 give it)
LEARNED_MODES = ("learned", "learned-pow2", "learned-x4")


class LearnedOutputs:
    """Output lengths learned from finished requests, the way a router sees them (it proxies the
    stream, so it counts each finished request's output tokens): per prompt-length class (the
    log2 of the prompt's tokens) the last ``keep`` lengths. ``expected_penalty`` prices a victim
    by the mean of ``tpot_penalty_s`` over its class's lengths longer than what it has streamed so
    far (a request that has streamed ``k`` tokens has at least ``k + 1``); with no such length
    seen, the victim counts at ``2 (k + 1)``, and before any request has finished at ``fallback``
    (its ``max_tokens`` rounded up to a power of two: a client's bound, not the oracle)."""

    def __init__(self, keep: int = 64, bound: str = "pow2", capped: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep {keep}: must be >= 1")
        if bound not in ("pow2", "x4"):
            raise ValueError(f"bound {bound!r}: pow2 or x4 (a client's max_tokens, never the oracle)")
        self.bound, self.capped, self.keep = bound, capped, keep
        self.by_class: dict[int, deque[int]] = {}

    @staticmethod
    def prompt_class(prompt_tokens: int) -> int:
        """The class of a prompt of ``prompt_tokens`` tokens: floor(log2), 0 for 0 or 1 token."""
        return max(1, int(prompt_tokens)).bit_length() - 1

    def observe(self, prompt_tokens: int, output_tokens: int) -> None:
        """Record one finished request (output ≥ 1 token)."""
        if output_tokens >= 1:
            c = self.prompt_class(prompt_tokens)
            q = self.by_class.get(c)
            if q is None:
                q = self.by_class[c] = deque(maxlen=self.keep)
            q.append(int(output_tokens))

    def lengths(self, prompt_tokens: int, streamed: int, fallback: int) -> list[int]:
        """The output lengths a victim of ``prompt_tokens`` that has streamed ``streamed`` tokens
        may have, per the module's rule above (never empty)."""
        q = self.by_class.get(self.prompt_class(prompt_tokens))
        if not q:
            return [max(fallback, streamed + 1)]
        longer = [o for o in q if o > streamed]
        return longer or [2 * (streamed + 1)]

    def expected_penalty(self, uncached: float, rate: float, victims: Sequence[tuple[int, int, int]],
                         step_tokens: float, only_whole: bool = False) -> float:
        """Sum over ``victims`` ((prompt tokens, streamed tokens, max_tokens) each) of the mean
        ``tpot_penalty_s`` over their possible lengths, in seconds."""
        total = 0.0
        for prompt, streamed, max_tokens in victims:
            bound = VICTIM_KNOWLEDGE[self.bound](max_tokens)
            ls = self.lengths(prompt, streamed, bound)
            if self.capped:
                ls = [min(o, bound) for o in ls]
            total += tpot_penalty_s(uncached, rate, ls, step_tokens, only_whole=only_whole) / len(ls)
        return total


def slo_misses(uncached: float, rate: float, victims: Sequence[tuple[int, int, float]], step_tokens: float,
               tpot_slo_s: float) -> float:
    """How many of ``victims`` our ``uncached``-token prefill would push over the TPOT bound
    ``tpot_slo_s``: each ``(output tokens, streamed tokens, decode seconds so far)``; a victim's
    remaining ``o − k`` steps are assumed as long as its mean step so far (a queued one: 0), and
    our prefill adds ``min(u, (o − k)·S) / r`` to them. A victim already over its bound without us,
    or under it with us, counts 0 (a miss is priced once, where it is caused). The router's own
    rule (:mod:`router.policies.tpot_slo`, built from this experiment in Round 8); raises
    ValueError on a rate or step size that is not positive."""
    if rate <= 0 or step_tokens <= 0:
        raise ValueError(f"rate {rate} and step_tokens {step_tokens} must be > 0")
    rows = victim_rows(((o, k, spent) for o, k, spent in victims), tpot_slo_s, step_tokens, REFERENCE_OUTPUT_TOKENS)
    return float(count_pushed(rows, uncached, rate))


def install(w_tpot: float, only_whole: bool = False, replace: bool = False, known: str = "exact",
            tpot_slo_s: float = 0.0) -> None:
    """Patch ``DplbPolicy.choose`` and ``EngineCore`` in this process (see the module docstring).
    With ``w_tpot`` 0 and not ``replace`` nothing is patched: plain ``dplb``. ``known``: a key
    of ``VICTIM_KNOWLEDGE`` or one of ``LEARNED_MODES`` (``LearnedOutputs``); KeyError or
    ValueError otherwise."""
    learned = None
    if known.startswith("learned"):
        bound = known.partition("-")[2]
        learned = LearnedOutputs(bound=bound or "pow2", capped=bool(bound))
    seen = VICTIM_KNOWLEDGE["exact"] if learned is not None else VICTIM_KNOWLEDGE[known]
    if w_tpot <= 0 and not replace:
        return
    import router.policies.dplb as dplb_mod
    from sim_engine import engine as engine_mod

    cores: list[Any] = []
    plain_init = engine_mod.EngineCore.__init__
    plain_choose = dplb_mod.DplbPolicy.choose
    plain_finish = engine_mod.EngineCore._finish

    def finish(self: Any, req: Any, reason: str, now: float) -> None:
        plain_finish(self, req, reason, now)
        if learned is not None and reason != "abort":
            learned.observe(req.num_prompt_tokens, len(req.output))

    def init(self: Any, config: Any) -> None:
        plain_init(self, config)
        cores.append(self)

    def choose(self: Any, workers: Any, req: Any, explain: bool = False) -> Any:
        vec, _ = self.uncached_vector(workers, req)
        work = self.work_vector(vec, req.prompt_len)
        now = self.clock() if self.clock is not None else None
        out = float(min(req.max_tokens or self.default_output_tokens, self.max_output_tokens))
        wid, terms = self.kernel.pick_ttft_explain(self.params, req.prompt_len, work, now_ns=now, out_tokens=out)
        if int(wid) < 0:
            return plain_choose(self, workers, req, explain)
        mine = cores[-int(self.kernel.num_slots):]   # this simulation's engines, in slot order
        best: tuple[float, int] | None = None
        for t in terms:
            k = int(t.worker_id)
            inflight = (*mine[k].running, *mine[k].waiting)
            est = float(t.est_s) - (float(t.interf_s) if replace else 0.0)
            if tpot_slo_s > 0:
                t_now = (now - 1_000_000_000) / 1e9 if now is not None else 0.0
                u, r, st = float(t.uncached_tokens), float(t.rate), float(self.params.step_tokens)
                for v in inflight:
                    got = len(v.output)
                    spent = 0.0 if v.first_token_time is None else max(0.0, t_now - v.first_token_time)
                    if learned is None:
                        est += w_tpot * slo_misses(u, r, [(seen(v.max_tokens), got, spent)], st, tpot_slo_s)
                        continue
                    bound = VICTIM_KNOWLEDGE[learned.bound](v.max_tokens)
                    ls = learned.lengths(v.num_prompt_tokens, got, bound)
                    if learned.capped:
                        ls = [min(o, bound) for o in ls]
                    est += w_tpot * slo_misses(u, r, [(o, got, spent) for o in ls], st, tpot_slo_s) / len(ls)
            elif learned is not None:
                est += w_tpot * learned.expected_penalty(
                    float(t.uncached_tokens), float(t.rate),
                    [(v.num_prompt_tokens, len(v.output), v.max_tokens) for v in inflight],
                    float(self.params.step_tokens), only_whole=only_whole)
            else:
                est += w_tpot * tpot_penalty_s(float(t.uncached_tokens), float(t.rate),
                                               [seen(v.max_tokens) for v in inflight],
                                               float(self.params.step_tokens), only_whole=only_whole)
            if best is None or est < best[0]:
                best = (est, k)
        assert best is not None
        # est_s carries the TPOT price; the admission queue reads ttft_s, the request's own TTFT
        # there, as plain dplb reports it (else it would hold requests for the price)
        ttft = self.own_ttft(best[1], work, req.prompt_len, now, out) if self.report_ttft else None
        return dplb_mod.Decision(best[1], "ttft", [], uncached_tokens=int(vec[best[1]]), est_s=best[0], ttft_s=ttft)

    engine_mod.EngineCore.__init__ = init   # type: ignore[method-assign]
    engine_mod.EngineCore._finish = finish  # type: ignore[method-assign]
    dplb_mod.DplbPolicy.choose = choose     # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    """Parse this script's flags, patch, and hand the rest to ``dplb-simulate``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--w-tpot", type=float, default=0.0, help="weight of the TPOT-priced term (0: off)")
    ap.add_argument("--only-whole", action="store_true", help="count only victims whose every step we would share")
    ap.add_argument("--replace", action="store_true", help="drop dplb's interf_s (the TPOT form replaces it)")
    ap.add_argument("--victim-outputs", choices=[*sorted(VICTIM_KNOWLEDGE), *LEARNED_MODES], default="exact",
                    help="how the victims' output lengths are known (exact: the trace's, an oracle; "
                         "learned: from finished requests of the same prompt-length class; "
                         "learned-pow2/-x4: those, capped by the client's bound)")
    ap.add_argument("--tpot-slo-s", type=float, default=0.0,
                    help="price victims by the misses our prefill causes at this TPOT bound (w_tpot s each)")
    ns, rest = ap.parse_known_args(argv)
    if ns.w_tpot < 0:
        ap.error(f"--w-tpot {ns.w_tpot}: must be >= 0")
    install(ns.w_tpot, ns.only_whole, ns.replace, ns.victim_outputs, ns.tpot_slo_s)
    from simulate.cli import main as simulate_main
    return simulate_main(rest)


if __name__ == "__main__":
    sys.exit(main())
