"""The admission queue: late binding, order, fairness and shedding (docs/admission.md).

One synchronous core, the same code in the router (:mod:`router.admission_gate` wraps it for
asyncio), the endpoint picker and ``dplb-simulate`` (:mod:`simulate.cluster`); the rule that
judges a routing decision for it is :mod:`router.admission_rule`. It holds no
worker state and takes no lease: the caller routes a ticket (``try_dispatch``) and the core only
decides *which* waiting request is tried next, *whether* a routing decision may be acted on now
(:meth:`AdmissionQueue.judge`), and *when* a waiting request is answered instead.

**Saturation rule** (:meth:`AdmissionQueue.judge`), from the policy's decision over live state:
the ``dplb`` policy's estimated TTFT on the worker it chose (``Decision.ttft_s``: the kernel's
``dplb_pick_ttft``, csrc/dplb_kernel.h, with the terms that price what the choice costs others
off: queue ahead + own prefill, whose queued prefill is the segment's shared accounting of every
router process and counts the engine's waiting requests, the decode steps sharing them, and the
KV barrier that prices KV use), as long as dispatching it pushes no decode in flight on that
worker over its TPOT bound (``Decision.slo_victims``, :mod:`router.policies.tpot_slo`). A
decode there already pacing above ``tpot_slo_s`` (:func:`router.admission_rule.pacing_over`: the batch is full for its
SLO) holds the request when at least half the eligible workers have one (the cluster has no TPOT
room), when a waiting request went late or was shed for its budget within ``reserve_window_s``
(:meth:`AdmissionQueue.shedding`: past capacity), or when the request fills only the reserve
(below): a burst on a minority of workers is not saturation, and holding for it would cost TTFT
below capacity without saving its decodes. These TPOT holds apply only on overload evidence
(:meth:`AdmissionQueue.overloaded`), while the reserve is in force (:meth:`AdmissionQueue.rationed`)
or for a request that fills only the reserve (``tpot_holds: always``: at any load). The cluster has room for a request when that estimate is within ``headroom`` × the
request's TTFT budget (``ttft_slo_base_s + ttft_slo_per_1k_s × prompt tokens / 1000``; for a
request that fills only the reserve of a higher class, at most that class's typical budget,
:meth:`AdmissionQueue.room_budget`); when every worker is above the KV threshold (decision
reason ``kv_full``) it has none. A burst costs nothing: in the first ``hold_after_s`` of a
spell without room (no hold within ``reserve_window_s`` before it) a request without room is
bound on arrival, as without the queue. A policy
that estimates nothing (``round_robin``, ...) falls back to the chosen worker's router in-flight
count against its ``max_num_seqs`` (the caller passes ``full``).

**Order** (:meth:`AdmissionQueue.pump`): priority class first (higher integer first). Within a
class, requests that can still meet their deadline (arrival + TTFT budget) come before those that
cannot ("late"): earliest deadline first (EDF, which maximises the share of deadlines met while
the load is feasible; Liu & Layland 1973) among the tenants' heads, the tenant chosen by start-time
fair queuing (Goyal, Vin & Cheng, SIGCOMM 1996: each tenant's virtual time advances by one per
dispatched request; a tenant that becomes active starts at the smallest virtual time of those
waiting, so an idle tenant banks no credit), so a flooding tenant cannot starve a light one. A
request judged unable to meet its deadline even if dispatched now (``now + est > deadline``)
moves to its class's late list (FIFO), tried only when no on-time request of any class waits.
A request of a class with a lower class active (which fills only the reserve, so room for this
class frees up first) is instead passed over for the rest of that try and keeps its place: the
next try may choose another worker, or the one holding its cached prefix once that has room,
where it still makes it; it turns late when its deadline passes (moved to the late list at the
first such verdict, it waited behind every on-time request of every class until it was shed:
agentic, 4 engines, 2x capacity, the high class 0.950 -> 0.982; bench/results/admission.md,
round 6). A late request is tried only after every on-time one;
with ``shed_late`` it is answered 429 at once instead (reason ``deadline``), once requests have
waited without a break for ``late_backlog_s`` (:meth:`AdmissionQueue.backlogged`): a burst's
late requests are served late, not refused (on the simulator CLI's 60-request window 16 of 60
were answered 429 at x0.25 of the trace's rate when every late request was shed).

**Head of line per worker** (:data:`HOLD`): a request held because the worker its routing chose
has no room (its cached prefix there, say) keeps its place, and the pump tries the requests of its
class behind it (up to ``lookahead`` held ones): one routed to another worker with room goes, one
routed to a held worker waits behind the request held there. A queue-wide head of line left the
high class's requests behind a head held for its prefix worker 1-2.5 s past their deadline
(agentic workload at 2x capacity, bench/results/admission.md round 4; round 5 for this rule).

**Shedding**: a request that waited its class's queue budget is answered 429 (reason
``budget``); one arriving to a queue holding ``max_queue`` requests at once (reason ``full``).
``Retry-After`` (:meth:`AdmissionQueue.retry_after`) is the time the requests ahead would take at
the recent dispatch rate, 1 to 60 s. An empty pool is the scheduler's 503, as without the queue.
Nothing dispatched is ever cut.

Costs: with room the caller's one routing decision is judged and acted on (one comparison more);
the queue's structures are touched only while requests wait.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from router.config import AdmissionSection

#: :meth:`AdmissionQueue.judge` verdicts: dispatch now / the cluster has no room (stop trying) /
#: this request would miss its deadline (try the next one) / the caller failed the request itself /
#: the worker this request's routing chose has no room (it keeps its place; a request behind it
#: may go to another worker: :meth:`AdmissionQueue.pump`)
GO, WAIT, LATE, FAIL, HOLD = "go", "wait", "late", "fail", "hold"
#: shed reasons (metric label values)
BUDGET, DEADLINE, FULL = "budget", "deadline", "full"
WAITING, DISPATCHED, SHED, GONE, FAILED = range(5)
#: how far back the dispatch rate of ``Retry-After`` looks, s
RATE_WINDOW_S = 10.0
RETRY_AFTER_MAX_S = 60
#: a tenant with more than this many times its fair share of its class's recent dispatches fills
#: only the reserved headroom (:meth:`AdmissionQueue.headroom`)
OVER_SHARE = 1.25
#: weight of one arrival in a class's running mean of prompt tokens (an exponentially weighted
#: mean over about its last 1 / 0.05 = 20 requests: short enough to follow a change of the class's
#: prompt mix within a few seconds of traffic, long enough that one long prompt moves it by 5 %)
PROMPT_EWMA = 0.05

P = TypeVar("P")


class Ticket(Generic[P]):
    """One request waiting for admission. Times in seconds on the queue's clock.

    ``priority``: class (higher first); ``tenant``: fairness key; ``deadline``: arrival + TTFT
    budget; ``expires``: arrival + queue budget (then 429); ``payload``: the caller's (a future, a
    request index)."""

    __slots__ = ("arrival", "deadline", "expires", "late", "payload", "priority", "prompt_tokens", "seq",
                 "state", "tenant", "ttft_budget", "waited")

    def __init__(self, seq: int, priority: int, tenant: str, arrival: float, ttft_budget: float,
                 queue_budget: float, prompt_tokens: int, payload: P) -> None:
        self.seq = seq
        self.priority = priority
        self.tenant = tenant
        self.arrival = arrival
        self.ttft_budget = ttft_budget
        self.deadline = arrival + ttft_budget
        self.expires = arrival + queue_budget
        self.prompt_tokens = prompt_tokens
        self.payload = payload
        self.state = WAITING
        self.late = False
        #: seconds between arrival and leaving the queue (dispatch or shed); None while waiting
        self.waited: float | None = None


@dataclass
class _Tenant(Generic[P]):
    vt: float = 0.0
    waiting: int = 0
    heap: list[tuple[float, int, Ticket[P]]] = field(default_factory=list)   # (deadline, seq): on time


@dataclass
class _Class(Generic[P]):
    tenants: dict[str, _Tenant[P]] = field(default_factory=dict)
    late: list[tuple[float, int, Ticket[P]]] = field(default_factory=list)   # (arrival, seq)
    waiting: int = 0


@dataclass
class Outcome(Generic[P]):
    """What one :meth:`AdmissionQueue.pump` did: tickets dispatched, and tickets shed with their
    reason (the caller answers them 429)."""

    dispatched: list[Ticket[P]] = field(default_factory=list)
    shed: list[tuple[Ticket[P], str]] = field(default_factory=list)


class AdmissionQueue(Generic[P]):
    """The queue of one router process (or picker, or simulation); see the module docstring.

    ``cfg``: the ``admission`` config section. Not thread-safe: one event loop owns it."""

    def __init__(self, cfg: AdmissionSection) -> None:
        #: the section's values as plain attributes (read a dozen times per request)
        self.cfg = cfg.values()
        self._classes: dict[int, _Class[P]] = {}
        self._order: list[int] = []        # priorities present, highest first
        self._expiry: list[tuple[float, int, Ticket[P]]] = []
        self._seq = 0
        self._dispatch_times: deque[float] = deque()
        #: requests waiting now
        self.depth = 0
        #: ``(reason, priority) -> count`` of requests shed since start
        self.shed_counts: dict[tuple[str, int], int] = {}
        self.dispatched_total = 0
        #: priority → when a request of that class last arrived (trunk reservation)
        self._seen: dict[int, float] = {}
        #: priority → running mean of its requests' prompt tokens (:data:`PROMPT_EWMA`): the
        #: budget of a typical request of a higher class (:meth:`room_budget`)
        self._ptok: dict[int, float] = {}
        #: when a request was last answered 429 for its deadline or budget (overload evidence)
        self._last_shed = -math.inf
        #: since when requests have waited without a break (None: the queue is empty)
        self._busy_since: float | None = None
        #: a spell without room: its first and last request judged without room (it ends when
        #: ``hold_after_s`` pass without one); when a waiting request last went late; last hold
        self._spell_since = self._last_no_room = self._last_late = self._last_hold = -math.inf
        #: last hold on the TTFT estimate (not a TPOT rule's); last :meth:`note_overload` (:meth:`overloaded`)
        self._last_est_hold = self._last_pace_over = -math.inf
        #: per class, the dispatches of the last ``reserve_window_s`` (time, tenant) and their
        #: count per tenant (a tenant above its fair share fills only the reserved headroom)
        self._recent: dict[int, deque[tuple[float, str]]] = {}
        self._recent_n: dict[int, dict[str, int]] = {}
        #: during a :meth:`pump`, the workers a request tried earlier in it waits for (:data:`HOLD`):
        #: a request behind it that is routed to one of them waits too (the rule's
        #: :func:`router.admission_rule.judge_route` reads and fills it)
        self.held: set[int] = set()
        #: True while :meth:`pump` runs (outside it, a held worker is not remembered)
        self.pumping = False

    # -- entering and leaving ------------------------------------------------------------------
    def ticket(self, payload: P, now: float, prompt_tokens: int, priority: int | None = None, tenant: str = "",
               budget_s: float | None = None) -> Ticket[P]:
        """A new ticket (not queued yet). ``budget_s``: the request's own queue budget, which can
        only shorten its class's (headers ``x-llm-d-inference-ttl``, ``x-dplb-queue-budget-ms``)."""
        cfg = self.cfg
        prio = cfg.default_priority if priority is None else priority
        budget = cfg.budget_s(prio)
        self._seen[prio] = now
        m = self._ptok.get(prio)
        self._ptok[prio] = float(prompt_tokens) if m is None else m + PROMPT_EWMA * (prompt_tokens - m)
        if budget_s is not None and budget_s >= 0:
            budget = min(budget, budget_s)
        self._seq += 1
        return Ticket(self._seq, prio, tenant, now, cfg.ttft_budget_s(prompt_tokens), budget, prompt_tokens, payload)

    def offer(self, t: Ticket[P]) -> bool:
        """Queue ``t``; False (and ``t`` shed, reason ``full``) when ``max_queue`` requests wait."""
        if self.depth >= self.cfg.max_queue:
            self._shed(t, FULL, t.arrival)
            return False
        c = self._classes.get(t.priority)
        if c is None:
            c = self._classes[t.priority] = _Class()
            self._order = sorted(self._classes, reverse=True)
        ten = c.tenants.get(t.tenant)
        if ten is None:
            ten = c.tenants[t.tenant] = _Tenant()
        if ten.waiting == 0:   # becomes active: no credit banked while idle (SFQ)
            active = [x.vt for x in c.tenants.values() if x.waiting > 0]
            if active:
                ten.vt = max(ten.vt, min(active))
        ten.waiting += 1
        c.waiting += 1
        if self.depth == 0:
            self._busy_since = t.arrival
        self.depth += 1
        heapq.heappush(ten.heap, (t.deadline, t.seq, t))
        heapq.heappush(self._expiry, (t.expires, t.seq, t))
        return True

    def withdraw(self, t: Ticket[P], now: float) -> bool:
        """The client left: drop ``t`` from the queue (True when it was waiting)."""
        if t.state != WAITING:
            return False
        self._leave(t, GONE, now)
        return True

    def fail(self, t: Ticket[P], now: float) -> None:
        """The caller answered ``t`` itself (no worker at all: 503)."""
        if t.state == WAITING:
            self._leave(t, FAILED, now)

    def _leave(self, t: Ticket[P], state: int, now: float) -> None:
        t.state = state
        t.waited = max(0.0, now - t.arrival)
        c = self._classes[t.priority]
        c.tenants[t.tenant].waiting -= 1
        c.waiting -= 1
        self.depth -= 1
        # entries stay in the heaps and are skipped when reached (lazy deletion); drop the
        # structures when the queue empties so that they cannot grow without bound
        if self.depth == 0:
            self._busy_since = None
            self._expiry.clear()
            for cl in self._classes.values():
                cl.late.clear()
                for ten in cl.tenants.values():
                    ten.heap.clear()

    def _shed(self, t: Ticket[P], reason: str, now: float) -> None:
        if t.state == WAITING:
            self._leave(t, SHED, now)
        else:
            t.state = SHED
            t.waited = max(0.0, now - t.arrival)
        key = (reason, t.priority)
        self.shed_counts[key] = self.shed_counts.get(key, 0) + 1
        if reason != FULL:
            self._last_shed = now

    # -- the rule ------------------------------------------------------------------------------
    def judge(self, t: Ticket[P], est_s: float | None, now: float, full: bool = False) -> str:
        """May ``t`` be dispatched now on a decision whose estimated TTFT is ``est_s`` seconds?
        :data:`GO`, :data:`WAIT` (saturated: ``est_s`` above :meth:`headroom` × its TTFT budget, or
        ``full``: no worker has room by the caller's own rule) or :data:`LATE` (it has room but
        the request would still miss its deadline; only for a ticket not already late)."""
        if est_s is None and not full:
            return GO
        if full or est_s is None or est_s > self.headroom(t.priority, now, t.tenant) * self.room_budget(t, now):
            if now - self._last_no_room > self.cfg.hold_after_s:
                self._spell_since = now      # a spell without room begins
            self._last_no_room = now
            if (self.depth <= 1 and now - self._spell_since < self.cfg.hold_after_s
                    and now - self._last_hold > self.cfg.reserve_window_s and est_s is not None
                    and self.headroom(t.priority, now, t.tenant) >= self.cfg.headroom):
                # a burst: bound on arrival, as without the queue (not past a seat count: a policy
                # without a TTFT estimate has no other measure of room; not for the reserve)
                return GO
            self._last_hold = now
            if not full and est_s is not None:
                self._last_est_hold = now
            return WAIT
        if not t.late and now + est_s > t.deadline:
            return LATE
        return GO

    def room_budget(self, t: Ticket[P], now: float) -> float:
        """The TTFT budget, s, the saturation rule measures ``t``'s estimate against: its own,
        or, while a higher class had a request within ``reserve_window_s``, the smaller of its own
        and the budget of a typical request of that class (its running mean of prompt tokens,
        :data:`PROMPT_EWMA`). A lower-class request with a long prompt (a long budget) would
        otherwise queue seconds of prefill ahead of the next high-class request, whose own budget
        is short: the reserve must be counted in the time the class it is kept for can wait."""
        budget = t.ttft_budget
        cfg = self.cfg
        horizon = now - cfg.reserve_window_s
        for p, seen in self._seen.items():
            if p > t.priority and seen >= horizon:
                budget = min(budget, cfg.ttft_budget_s(int(self._ptok.get(p, 0.0))))
        return budget

    def backlogged(self, now: float) -> bool:
        """Whether requests have waited without a break for ``late_backlog_s`` or longer: the
        cluster is past its capacity (a sustained backlog), not in a burst that clears in a few
        seconds. Only then does ``shed_late`` answer a late request 429 at once."""
        return self._busy_since is not None and now - self._busy_since >= self.cfg.late_backlog_s

    def shedding(self, now: float) -> bool:
        """Whether a waiting request went late (could no longer meet its deadline) or was answered
        429 for its budget within the last ``reserve_window_s``: evidence that the cluster is past
        its capacity, not in a burst."""
        return now - max(self._last_shed, self._last_late) <= self.cfg.reserve_window_s

    def overloaded(self, now: float) -> bool:
        """Whether the cluster shows it is past its capacity, by evidence the TPOT holds do not make
        themselves: within ``reserve_window_s`` a hold on the TTFT estimate (not a burst's), a late
        or shed request (:meth:`shedding`) or a :meth:`note_overload`; or :meth:`backlogged`. The
        TPOT holds of :mod:`router.admission_rule` wait for it (below capacity they turn into TTFT)."""
        return (now - max(self._last_est_hold, self._last_shed, self._last_late, self._last_pace_over)
                <= self.cfg.reserve_window_s or self.backlogged(now))

    def rationed(self, now: float) -> bool:
        """Whether the reserve is in force (:meth:`headroom`): two priority classes arrived within
        ``reserve_window_s``, or a tenant had more than :data:`OVER_SHARE` × its fair share of its
        class's dispatches then. The TPOT holds then protect the higher class's and the light
        tenants' decodes at any load."""
        horizon = now - self.cfg.reserve_window_s
        if sum(1 for seen in self._seen.values() if seen >= horizon) > 1:
            return True
        for prio, counts in self._recent_n.items():
            if len(counts) > 1:
                self._trim(prio, horizon)
                total = sum(counts.values())
                if len(counts) > 1 and total and max(counts.values()) * len(counts) > OVER_SHARE * total:
                    return True
        return False

    def note_overload(self, now: float) -> None:
        """The caller saw most decodes in flight pace over their bound (evidence for :meth:`overloaded`)."""
        self._last_pace_over = now

    def headroom(self, priority: int, now: float, tenant: str | None = None) -> float:
        """The share of its TTFT budget a request of class ``priority`` (and ``tenant``) may find
        queued ahead: ``headroom``, times ``reserve`` while a higher class had a request within
        ``reserve_window_s``, or times ``tenant_reserve`` while ``tenant`` had more than
        :data:`OVER_SHARE` × its fair share (1 / tenants served) of its class's dispatches in that
        window. Trunk reservation
        (Ott & Krishnan, ITC 1985): the room above is kept for the higher class and the lighter
        tenants, whose requests then go at once instead of waiting for a request to end."""
        cfg = self.cfg
        horizon = now - cfg.reserve_window_s
        for p, t in self._seen.items():
            if p > priority and t >= horizon:
                return cfg.headroom * cfg.reserve
        if tenant is not None and self._over_share(priority, tenant, horizon):
            return cfg.headroom * cfg.tenant_reserve
        return cfg.headroom

    def _over_share(self, priority: int, tenant: str, horizon: float) -> bool:
        """Whether ``tenant`` had more than :data:`OVER_SHARE` × its fair share of class
        ``priority``'s dispatches since ``horizon``."""
        counts = self._recent_n.get(priority)
        if not counts or len(counts) < 2:
            return False
        self._trim(priority, horizon)
        total = sum(counts.values())
        return bool(total) and counts.get(tenant, 0) * len(counts) > OVER_SHARE * total

    def record(self, t: Ticket[P], now: float) -> None:
        """Count the dispatch of ``t`` (its tenant's virtual time, the recent dispatch rate and
        shares); :meth:`pump` does it for what it dispatches, an edge for a request it routed at
        once without queueing it."""
        self.dispatched_total += 1
        self._note_dispatch(now)
        c = self._classes.get(t.priority)
        if c is not None and t.tenant in c.tenants:
            c.tenants[t.tenant].vt += 1.0
        rec = self._recent.get(t.priority)
        if rec is None:
            rec = self._recent[t.priority] = deque()
            self._recent_n[t.priority] = {}
        rec.append((now, t.tenant))
        counts = self._recent_n[t.priority]
        counts[t.tenant] = counts.get(t.tenant, 0) + 1
        self._trim(t.priority, now - self.cfg.reserve_window_s)

    def _trim(self, priority: int, horizon: float) -> None:
        rec = self._recent[priority]
        counts = self._recent_n[priority]
        while rec and rec[0][0] < horizon:
            _, ten = rec.popleft()
            left = counts[ten] - 1
            if left:
                counts[ten] = left
            else:
                del counts[ten]

    # -- the pump ------------------------------------------------------------------------------
    def pump(self, now: float, try_dispatch: Callable[[Ticket[P]], str]) -> Outcome[P]:
        """Shed what expired, then offer waiting tickets in order to ``try_dispatch`` until it
        answers :data:`WAIT` or nothing waits. ``try_dispatch(t)`` routes ``t`` and returns
        :data:`GO` (it dispatched ``t``: lease taken), :data:`WAIT`, :data:`HOLD` (nothing taken:
        ``t`` keeps its place and waits for the worker it was routed to, named in :attr:`held`;
        the next tickets of its class are tried, up to ``lookahead`` held ones per pump, and a
        ticket routed to a held worker is held too, so no request overtakes another on the worker
        both wait for; a lower class is not tried past a held ticket),
        :data:`LATE` (nothing taken; ``t`` moves to its class's late list, or is shed with
        ``shed_late``; of a class with a lower class active, it keeps its place and the tickets
        behind it are tried) or :data:`FAIL` (the caller answered ``t`` itself, e.g. 503 for an empty
        pool)."""
        out: Outcome[P] = Outcome()
        self._expire(now, out)
        self.held.clear()
        self.pumping = True
        aside: list[tuple[list[tuple[float, int, Ticket[P]]], tuple[float, int, Ticket[P]]]] = []
        passed: list[tuple[list[tuple[float, int, Ticket[P]]], tuple[float, int, Ticket[P]]]] = []
        try:
            while self.depth > 0:
                t = self._next(now, out)
                if t is None or (aside and t.priority < aside[0][1][2].priority):
                    break   # never a lower class past a held one: the room it would take is reserved
                v = try_dispatch(t)
                if v == GO:
                    self._leave(t, DISPATCHED, now)
                    self.record(t, now)
                    out.dispatched.append(t)
                elif v == HOLD and len(aside) < self.cfg.lookahead:
                    self._set_aside(t, aside)
                elif v == LATE and not t.late:
                    if self._above_active(t.priority, now):
                        # late on the worker this decision chose; room for its class frees up
                        # first: the next try may find a worker where it still makes it
                        self._set_aside(t, passed)
                    else:
                        self._make_late(t, now, out)
                elif v == FAIL:
                    self.fail(t, now)
                else:   # WAIT, a HOLD past the look-ahead, LATE for a late ticket (the caller's rule disagrees)
                    break
        finally:
            for h, e in aside + passed:   # back in their place
                if e[2].state == WAITING:
                    heapq.heappush(h, e)
            self.held.clear()
            self.pumping = False
        return out

    def _above_active(self, priority: int, now: float) -> bool:
        """Whether a class below ``priority`` had a request within ``reserve_window_s`` (it then
        fills only the reserve: room for class ``priority`` frees up first)."""
        horizon = now - self.cfg.reserve_window_s
        return any(p < priority and seen >= horizon for p, seen in self._seen.items())

    def _set_aside(self, t: Ticket[P], aside: list[tuple[list[tuple[float, int, Ticket[P]]], tuple[float, int, Ticket[P]]]]) -> None:
        """Take ``t`` (the head :meth:`_next` returned) off its heap for the rest of a pump."""
        h = self._classes[t.priority].late if t.late else self._classes[t.priority].tenants[t.tenant].heap
        aside.append((h, heapq.heappop(h)))

    def expire(self, now: float) -> Outcome[P]:
        """Shed what waited its budget and, with ``shed_late``, what can no longer meet its
        deadline, without trying anything (a timer's work between pumps)."""
        out: Outcome[P] = Outcome()
        self._expire(now, out)
        if self.cfg.shed_late and self.depth:
            for c in self._classes.values():
                for ten in c.tenants.values():
                    self._settle_head(ten, now, out)
        return out

    def _expire(self, now: float, out: Outcome[P]) -> None:
        ex = self._expiry
        while ex and ex[0][0] <= now:
            _, _, t = heapq.heappop(ex)
            if t.state == WAITING:
                self._shed(t, BUDGET, now)
                out.shed.append((t, BUDGET))
        if self.cfg.shed_late and self.depth and self.backlogged(now):
            # the backlog turned sustained: what went late during it is answered now
            for c in self._classes.values():
                while c.late:
                    _, _, t = heapq.heappop(c.late)
                    if t.state == WAITING:
                        self._shed(t, DEADLINE, now)
                        out.shed.append((t, DEADLINE))

    def _settle_head(self, ten: _Tenant[P], now: float, out: Outcome[P]) -> list[tuple[float, int, Ticket[P]]]:
        """Pop from ``ten``'s deadline heap what no longer waits on time (answered, shed, already
        late) and make late each waiting head whose deadline passed; returns the heap, its head
        now an on-time waiting ticket (or empty)."""
        h = ten.heap
        while h and (h[0][2].state != WAITING or h[0][2].late or h[0][0] <= now):
            _, _, t = heapq.heappop(h)
            if t.state == WAITING and not t.late:
                self._make_late(t, now, out)
        return h

    def _make_late(self, t: Ticket[P], now: float, out: Outcome[P]) -> None:
        t.late = True
        self._last_late = now
        if self.cfg.shed_late and self.backlogged(now):
            self._shed(t, DEADLINE, now)
            out.shed.append((t, DEADLINE))
        else:
            heapq.heappush(self._classes[t.priority].late, (t.arrival, t.seq, t))

    def _next(self, now: float, out: Outcome[P]) -> Ticket[P] | None:
        """The next ticket to try: the best on-time one, else the oldest late one of the highest
        class. Heads whose deadline passed become late on the way."""
        for prio in self._order:
            c = self._classes[prio]
            if c.waiting == 0:
                continue
            best: _Tenant[P] | None = None
            best_key = (0.0, 0.0)
            for ten in c.tenants.values():
                h = self._settle_head(ten, now, out)
                if h:
                    key = (ten.vt, h[0][0])
                    if best is None or key < best_key:
                        best, best_key = ten, key
            if best is not None:
                return best.heap[0][2]
        for prio in self._order:
            late = self._classes[prio].late
            while late and late[0][2].state != WAITING:
                heapq.heappop(late)
            if late:
                return late[0][2]
        return None

    # -- what is seen --------------------------------------------------------------------------
    def _note_dispatch(self, now: float) -> None:
        d = self._dispatch_times
        d.append(now)
        while d and d[0] < now - RATE_WINDOW_S:
            d.popleft()

    def retry_after(self, priority: int, now: float) -> int:
        """``Retry-After`` for a request of class ``priority`` shed now, whole seconds in [1, 60]:
        the requests waiting at its class or above over the dispatch rate of the last 10 s."""
        d = self._dispatch_times
        while d and d[0] < now - RATE_WINDOW_S:
            d.popleft()
        ahead = sum(c.waiting for p, c in self._classes.items() if p >= priority)
        if not d:
            return 1 if ahead == 0 else RETRY_AFTER_MAX_S
        rate = len(d) / RATE_WINDOW_S
        return max(1, min(RETRY_AFTER_MAX_S, math.ceil(ahead / rate)))

    def waiting(self) -> Iterator[Ticket[P]]:
        """Every ticket waiting now (cold path: status pages)."""
        seen: set[int] = set()
        for _, _, t in self._expiry:
            if t.state == WAITING and t.seq not in seen:
                seen.add(t.seq)
                yield t

    def status(self, now: float, max_tenants: int = 20) -> dict[str, object]:
        """``/dplb/status``'s ``queue``: depth, oldest wait (s) and per-class depth by tenant (the
        ``max_tenants`` deepest per class), sheds by reason and class, dispatched total."""
        classes: dict[str, dict[str, object]] = {}
        oldest = 0.0
        per: dict[int, dict[str, int]] = {}
        old_by: dict[int, float] = {}
        for t in self.waiting():
            per.setdefault(t.priority, {})
            per[t.priority][t.tenant] = per[t.priority].get(t.tenant, 0) + 1
            w = now - t.arrival
            old_by[t.priority] = max(old_by.get(t.priority, 0.0), w)
            oldest = max(oldest, w)
        for prio in sorted(per, reverse=True):
            tenants = sorted(per[prio].items(), key=lambda kv: -kv[1])[:max_tenants]
            classes[str(prio)] = {"depth": sum(per[prio].values()), "oldest_wait_s": round(old_by[prio], 3),
                                  "tenants": {k or "-": v for k, v in tenants}}
        shed: dict[str, dict[str, int]] = {}
        for (reason, prio), n in sorted(self.shed_counts.items()):
            shed.setdefault(reason, {})[str(prio)] = n
        return {"enabled": self.cfg.enabled, "depth": self.depth, "oldest_wait_s": round(oldest, 3),
                "classes": classes, "shed": shed, "dispatched": self.dispatched_total}


__all__ = ["BUDGET", "DEADLINE", "FAIL", "FULL", "GO", "HOLD", "LATE", "WAIT", "AdmissionQueue", "Outcome", "Ticket"]
