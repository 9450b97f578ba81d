"""The saturation rule over a routing decision: may a waiting request act on the policy's choice now?

The queue core (:class:`router.admission.AdmissionQueue`) orders, holds and sheds; this module
asks the scheduler for a routing decision for one ticket and turns it into the queue's verdict
(:func:`judge_route`, :func:`route_ticket`): the decision's estimated TTFT against the request's
budget (:meth:`~router.admission.AdmissionQueue.judge`), and whether the worker it chose has TPOT
room (:func:`pacing_over`, ``Decision.slo_victims``, the KV threshold). The router's gate
(:mod:`router.admission_gate`), the picker and ``dplb-simulate`` (:mod:`simulate.admission`) all
call it, so the three judge by the same code.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

from router.admission import GO, HOLD, WAIT, AdmissionQueue, Ticket
from router.errors import NoEligibleWorker

if TYPE_CHECKING:
    from dplb_shm.types import RouterLine
    from router.accounting import LearnSettings
    from router.policies.base import Decision, RequestInfo
    from router.scheduling import Lease, Scheduler
    from router.workers import WorkerHandle

P = TypeVar("P")


#: a decode is judged by its pace once it has streamed this many tokens
PACE_MIN_TOKENS = 8
#: more than this share of the decodes in flight pacing over their TPOT bound is overload evidence
#: (:meth:`AdmissionQueue.note_overload`): a majority. Agentic, 4 engines, seed 0: at most 0.39
#: (one-second means) at the capacity rate, above 0.5 from 12 s on at 1.5x (bench/results/admission.md round 7)
OVERLOAD_PACE_SHARE = 0.5


def pacing_over(requests: Iterable[tuple[int | None, int, float | None]], tpot_s: float) -> bool:
    """True when a decode in flight on a worker (``requests``: ``(max_tokens, tokens streamed,
    seconds since its first token)`` each, :meth:`router.scheduling.DecodeBook.requests`) has
    streamed at least :data:`PACE_MIN_TOKENS` tokens at a mean time per output token above
    ``tpot_s`` (0: never): the worker's batch is already past its TPOT bound, one more request
    there makes it worse."""
    if tpot_s <= 0:
        return False
    for _, k, since in requests:
        if k >= PACE_MIN_TOKENS and since is not None and since > tpot_s * (k - 1):
            return True
    return False


def pace_share(workers: Iterable[Iterable[tuple[int | None, int, float | None]]], tpot_s: float) -> float:
    """The share, in [0, 1], of the decodes in flight on ``workers`` (per worker, its
    :meth:`router.scheduling.DecodeBook.requests`) that have streamed at least
    :data:`PACE_MIN_TOKENS` tokens at a mean time per output token above ``tpot_s`` (0 when none
    has streamed that many, or ``tpot_s`` <= 0)."""
    if tpot_s <= 0:
        return 0.0
    n = over = 0
    for reqs in workers:
        for _, k, since in reqs:
            if k >= PACE_MIN_TOKENS and since is not None:
                n += 1
                if since > tpot_s * (k - 1):
                    over += 1
    return over / n if n else 0.0


def decode_over(line: RouterLine, learn: LearnSettings, prompt_tokens: int, tpot_s: float) -> bool:
    """True when a worker's decode step, once every request the routers dispatched there (its
    router line ``line``: ``router_inflight``, ``decode_reqs``, ``decode_ctx_tokens``) and one
    more of ``prompt_tokens`` decode together, would take longer than ``tpot_s`` (0: never): every
    decode there would then pace above its TPOT bound whatever the prefills do. The step is the
    kernel's decode-cost model (csrc/dplb_kernel.h ``decode_s``; :class:`LearnSettings`
    ``step_base_s + decode_seq_s x requests + decode_ctx_s x context tokens``); a request
    dispatched but not past its first token counts with the decodes' mean context (the new
    request's prompt when none decodes). Why: a pump that finds room by the TTFT estimate alone
    can bind a dozen requests of long cached contexts to one worker at once (docqa, 4 engines, 2x
    capacity: 14 in one pump, 27 -> 41 decodes of about 55k tokens each, 11 TPOT misses;
    bench/results/admission.md, round 7)."""
    if tpot_s <= 0:
        return False
    dreq = max(0.0, float(line["decode_reqs"]))
    dctx = max(0.0, float(line["decode_ctx_tokens"]))
    pending = max(0.0, float(line["router_inflight"]) - dreq)
    mean = dctx / dreq if dreq > 0 else float(prompt_tokens)
    reqs = dreq + pending + 1.0
    ctx = dctx + pending * mean + prompt_tokens
    return (learn.step_base_s + learn.decode_seq_s * reqs) + learn.decode_ctx_s * ctx > tpot_s


def judge_route(q: AdmissionQueue[P], sched: Scheduler, info: RequestInfo, t: Ticket[P], now: float,
                exclude: set[int] | frozenset[int] = frozenset()) -> tuple[str, WorkerHandle | None, Decision | None]:
    """Route ``t`` (request ``info``) with ``sched`` and judge the decision by the saturation rule
    (:meth:`AdmissionQueue.judge`) on the chosen worker's own estimated TTFT (``Decision.ttft_s``,
    else the policy's ``est_s``; the caller turns on the policy's ``report_ttft``); on :data:`GO`
    the chosen worker's breaker admits it (a half-open breaker's probe is taken; one that refuses
    it: the choice is made again without it). Returns ``(verdict, handle, decision)`` (handle and
    decision only on GO; nothing is recorded: the caller takes the lease before it yields).

    :data:`HOLD` instead of :data:`WAIT` when the chosen worker alone has no room (the estimate
    there, its decodes' pace, a prefill that would push them over), not the cluster (every worker
    above the KV threshold, or at least half pacing over): the worker joins
    :attr:`AdmissionQueue.held` and the pump tries the requests behind ``t``; a request routed to a
    held worker is held too. Not for a request that fills only the reserve (it stops the pump). A
    request held for ``reroute_after`` × its TTFT budget or longer is routed again without the held
    workers and goes if that choice passes the same rule and still meets its deadline. Raises
    :class:`~router.errors.NoEligibleWorker` when no worker can take it at all (503, as without
    the queue).

    ``full`` (no room whatever the estimate): every offered worker above the KV threshold
    (decision reason ``kv_full``), or, for a policy that estimates no TTFT, the chosen worker's
    router in-flight count (read live from the segment) at its ``max_num_seqs``, or one of the TPOT
    holds: the request's prefill would push a decode in flight there over its TPOT bound
    (``Decision.slo_victims``), or a decode there already paces above ``tpot_slo_s``
    (``reserve_pace`` × it for a lower class while a higher one is active,
    :meth:`AdmissionQueue.headroom`; :func:`pacing_over`) and either at least half the eligible
    workers have one (the cluster has no TPOT room), or the queue is shedding
    (:meth:`AdmissionQueue.shedding`), or ``t`` fills only the reserve
    (:meth:`AdmissionQueue.headroom` below ``headroom``). The TPOT holds apply to a ``t`` that
    fills only the reserve, and otherwise (``tpot_holds: overload``) only while the queue sees
    overload (:meth:`AdmissionQueue.overloaded`; this call reports more than half the decodes in
    flight pacing over, :func:`pace_share`, as evidence) or the reserve is in force
    (:meth:`AdmissionQueue.rationed`); with ``tpot_holds: always`` at any load."""
    v, h, d = _judge(q, sched, info, t, now, exclude, True)
    share = q.cfg.reroute_after
    if v == HOLD and h is not None and share > 0 and now - t.arrival >= share * t.ttft_budget:
        # held for its worker for long enough: another worker with room, if its deadline holds there
        try:
            v2, h2, d2 = _judge(q, sched, info, t, now, set(exclude) | q.held | {h.worker_id}, False)
        except NoEligibleWorker:
            return HOLD, None, None
        if v2 == GO:
            return v2, h2, d2
    return (v, None, None) if v != GO else (v, h, d)


def _judge(q: AdmissionQueue[P], sched: Scheduler, info: RequestInfo, t: Ticket[P], now: float,
           exclude: set[int] | frozenset[int], hold: bool) -> tuple[str, WorkerHandle | None, Decision | None]:
    """:func:`judge_route` on one routing decision; on :data:`HOLD` also the worker it waits for
    (added to :attr:`AdmissionQueue.held` when ``hold``)."""
    h, d = sched.decide(info, exclude)
    if h.worker_id in q.held:   # a request ahead waits for this worker: no overtaking it there
        return HOLD, h, None
    cluster = d.reason == "kv_full"   # no room on any worker (else: none on the chosen one)
    reserve = q.headroom(t.priority, now, t.tenant) < q.cfg.headroom
    tpot, decodes = q.cfg.tpot_slo_s, sched.decodes
    lower = reserve and q.headroom(t.priority, now) < q.cfg.headroom   # a lower class (not a tenant)
    over = not cluster and pacing_over(decodes.requests(h.worker_id), tpot * (q.cfg.reserve_pace if lower else 1.0))
    # The TPOT holds: for a request that fills only the reserve, while the reserve protects a higher
    # class or the tenants within their share (rationed), and otherwise only on overload evidence
    # the holds cannot make themselves (AdmissionQueue.overloaded: a hold on the TTFT estimate, a
    # late or shed request, most decodes in flight pacing over). Below capacity the request goes
    # where the policy chose (the dplb policy priced its TPOT victims already): a hold there turned
    # into TTFT (agentic, 4 engines, at the capacity rate: TTFT p99 0.68 s with admission off, 2.56
    # s with the holds at any load). Past capacity they keep the decodes within their bound: gated
    # to a 10 s backlog alone, goodput at 2x fell to 0.51x the peak (bench/results/admission.md,
    # rounds 6 and 7).
    tpot_holds = (reserve or q.cfg.tpot_holds == "always"
                  or ((over or d.slo_victims > 0) and (q.overloaded(now) or q.rationed(now))))
    if over and not tpot_holds:
        cands = sched.candidates(info.model, set(exclude), False)
        if pace_share((decodes.requests(s.worker_id) for s in cands), tpot) > OVERLOAD_PACE_SHARE:
            q.note_overload(now)   # most decodes in flight already miss their bound: past capacity
            tpot_holds = True
    full = cluster or (d.slo_victims > 0 and tpot_holds)
    if not full and tpot_holds and over:
        # the chosen worker's batch paces above its TPOT bound: a request that fills only the
        # reserve (lower class, tenant above its share) waits for it, and so does any request
        # while the queue has shed one for its deadline or budget lately (past capacity);
        # otherwise it waits only when at least half the eligible workers pace over (the
        # cluster has no TPOT room). A minority pacing over is a burst the others' room
        # absorbs: holding for it turns into TTFT below capacity without saving the decodes
        # there (a pace is a mean since the first token, slow to fall back), and re-routing
        # would give up the prefix the policy chose the worker for. Measured (agentic, 4
        # engines, bench/results/admission.md): holding for the chosen worker alone raised
        # TTFT p99 at 0.8x capacity 0.76 -> 1.27 s; holding only when every worker paces over
        # let goodput at 1.5x capacity fall to 0.75x the peak.
        if reserve or q.shedding(now):
            full = True
        else:
            cands = sched.candidates(info.model, set(exclude), False)
            n_over = sum(1 for s in cands if pacing_over(decodes.requests(s.worker_id), tpot))
            full = cluster = 2 * n_over >= len(cands)
    if not full and q.cfg.decode_room and sched.seg is not None:
        full = decode_over(sched.seg.router_line(h.worker_id), sched.learn, info.prompt_len, q.cfg.tpot_slo_s)
    est = d.ttft_s if d.ttft_s is not None else d.est_s
    if est is None and not full:
        snap = h.snap
        if snap is not None and int(snap.max_num_seqs) > 0:
            # the live count, not the last health tick's: every dispatch of a burst (by any
            # router process) since that tick counts, or the whole burst passes on a stale 0
            seg = sched.seg
            n = int(snap.router_inflight) if seg is None else int(seg.router_inflight_get(h.worker_id))
            full = n >= int(snap.max_num_seqs)
    v = q.judge(t, est, now, full)
    if v == WAIT and est is not None and not cluster and not reserve:
        # room may be elsewhere for the requests behind this one (their prefix on another worker);
        # a request that fills only the reserve stops the pump, as the rest of its class would
        if hold and q.pumping:
            q.held.add(h.worker_id)
        return HOLD, h, None
    if v != GO:
        return v, None, None
    if not h.breaker.allow():   # a half-open breaker's probe is taken: choose among the others
        h, d = sched.admit(info, set(exclude) | {h.worker_id})
    return GO, h, d


def route_ticket(q: AdmissionQueue[P], sched: Scheduler, info: RequestInfo, t: Ticket[P], now: float,
                 exclude: set[int] | frozenset[int] = frozenset()) -> tuple[str, Lease | None, Decision | None]:
    """:func:`judge_route`, then on :data:`GO` the lease (``sched.lease``). Returns ``(verdict,
    lease or None, decision or None)``. Raises NoEligibleWorker."""
    v, h, d = judge_route(q, sched, info, t, now, exclude)
    if v != GO or h is None or d is None:
        return v, None, None
    return GO, sched.lease(h, d, info, now), d


__all__ = ["OVERLOAD_PACE_SHARE", "PACE_MIN_TOKENS", "decode_over", "judge_route", "pace_share", "pacing_over",
           "route_ticket"]
