"""The router's admission step on the event loop: :class:`AdmissionGate` (docs/admission.md).

Wraps the synchronous core (:class:`router.admission.AdmissionQueue`, the code ``dplb-simulate``
runs) as the :class:`router.director.Director`'s admission step, for the HTTP router and the
endpoint picker alike::

    gate.tag(info, headers, auth)       # class, tenant and own budget from the request's headers
    gate.ready(info)                    # nothing waits and the cluster has room: True, decision kept
    await gate.wait(info)               # else: queued; returns once dispatched (its lease taken),
                                        # raises Overloaded (429) or NoEligibleWorker (503)
    gate.take_pick(info, exclude)       # the edge's pick: the decision ready() or the pump made
    gate.take_lease(info, handle)       # the edge's lease: the one the pump took (None: take one)
    gate.kick()                         # a request ended or got its first token: pump soon

The pump takes a queued request's lease itself, before the next request is judged, so that one
pump never admits more than the room it sees. While requests wait, the queue is pumped every
``admission.poll_ms`` (other router processes' releases and the agents' publications reach this
process only through the segment) and at each :meth:`AdmissionGate.kick`. The saturation rule
reads the kernel's estimate over the segment's shared accounting, so N router processes together
hold the cluster at the level one would: each dispatch any of them makes raises the estimate all of
them read. (Order and fairness are per process: each holds its own queue.)

A waiter whose client leaves is cancelled: its ticket leaves the queue at once; a lease taken for
it in the same instant is released. With ``admission.enabled: false`` :meth:`ready` is always
True (every request bound on arrival, as before).
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable

from router.admission import (
    BUDGET,
    DEADLINE,
    FAIL,
    FULL,
    GO,
    AdmissionQueue,
    Ticket,
)
from router.admission_rule import judge_route, route_ticket
from router.config import AdmissionSection
from router.errors import NoEligibleWorker, Overloaded
from router.metrics import Metrics
from router.policies.base import Decision, RequestInfo
from router.scheduling import Lease, Scheduler
from router.workers import WorkerHandle

#: request headers naming the priority class (an integer, higher first), first present wins:
#: DPLB's own, then SGLang gateway's (smg)
PRIORITY_HEADERS = (b"x-dplb-priority", b"x-smg-priority")
#: request headers shortening the queue budget: milliseconds, or a Go duration (llm-d's TTL)
BUDGET_MS_HEADER = b"x-dplb-queue-budget-ms"
TTL_HEADER = b"x-llm-d-inference-ttl"
PRIORITY_RANGE = 1000

_WHY = {BUDGET: "the request waited its queue budget ({w:.1f} s) while every worker was saturated",
        DEADLINE: "the request can no longer meet its TTFT deadline (waited {w:.1f} s while every worker was saturated)",
        FULL: "the router's admission queue is full"}


class _Wait:
    __slots__ = ("fut", "info")

    def __init__(self, info: RequestInfo, fut: asyncio.Future[None] | None) -> None:
        self.info = info
        self.fut = fut


class AdmissionGate:
    """One process's admission step (module docstring). ``clock``: seconds (monotonic)."""

    def __init__(self, cfg: AdmissionSection, scheduler: Scheduler, metrics: Metrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.sched = scheduler
        self.metrics = metrics
        self.clock = clock
        self.q: AdmissionQueue[_Wait] = AdmissionQueue(cfg)
        # read once: a pydantic section's attribute costs ~0.15 µs (its __getattr__ hook turns off
        # the interpreter's attribute fast path) and these are read per request
        self._enabled = cfg.enabled
        self._tenant_header = cfg.tenant_header.encode()
        #: every header name :meth:`tag` reads (a request's other headers cost one set lookup each)
        self._names = frozenset((*PRIORITY_HEADERS, self._tenant_header, BUDGET_MS_HEADER, TTL_HEADER))
        scheduler.policy.report_ttft = cfg.enabled
        if metrics is not None:   # the series exist from the start (rate() and the dashboard show 0)
            metrics.admission_start(str(cfg.default_priority), (BUDGET, DEADLINE, FULL))
        self._poller: asyncio.Task[None] | None = None
        self._kicked = False
        #: the decision :meth:`ready` made for the request the edge is about to pick for
        self._picked: tuple[RequestInfo, WorkerHandle, Decision] | None = None
        #: id(info) → (info, handle, decision, lease) of requests the pump dispatched, until picked
        self._granted: dict[int, tuple[RequestInfo, WorkerHandle, Decision, Lease]] = {}

    # -- request metadata ----------------------------------------------------------------------
    def tag(self, info: RequestInfo, headers: Iterable[tuple[bytes, bytes]], auth: bytes | None = None) -> None:
        """Set ``info``'s class, tenant and own budget from its ``headers`` (lower-case names):
        ``x-dplb-priority`` / ``x-smg-priority`` (an integer, clamped to ±1000; not a number: the
        default), the tenant from ``admission.tenant_header``, else the body's ``user`` (already
        in ``info.tenant``), else a digest of the ``Authorization`` value ``auth``; the budget from
        ``x-dplb-queue-budget-ms`` or ``x-llm-d-inference-ttl`` (a Go duration), the shorter."""
        if not self._enabled:
            return
        th, names = self._tenant_header, self._names
        for k, v in headers:
            if k not in names:
                continue
            if k in PRIORITY_HEADERS:
                if info.priority is None:
                    try:
                        info.priority = max(-PRIORITY_RANGE, min(PRIORITY_RANGE, int(v.decode("latin-1").strip())))
                    except ValueError:
                        pass
            elif k == th:
                info.tenant = v.decode("latin-1").strip()[:128]
            elif k == BUDGET_MS_HEADER or k == TTL_HEADER:
                text = v.decode("latin-1")
                if k == TTL_HEADER:
                    b = go_duration_s(text)
                else:
                    try:
                        b = float(text) / 1000.0
                    except ValueError:
                        b = None
                if b is not None and b >= 0 and (info.queue_budget_s is None or b < info.queue_budget_s):
                    info.queue_budget_s = b
        if not info.tenant and auth:
            info.tenant = "key:" + hashlib.sha256(auth).hexdigest()[:12]

    # -- the Director's admission step ---------------------------------------------------------
    def _ticket(self, info: RequestInfo, fut: asyncio.Future[None] | None, now: float) -> Ticket[_Wait]:
        return self.q.ticket(_Wait(info, fut), now, info.prompt_len, info.priority, info.tenant, info.queue_budget_s)

    def ready(self, info: RequestInfo) -> bool:
        """May ``info`` go now (no await: the protocol callback asks)? True when admission is off,
        or nothing waits and the cluster has room (the decision is kept for :meth:`take_pick`).
        A NoEligibleWorker here is left to the edge's pick (True: it answers 503)."""
        if not self._enabled:
            return True
        if self.q.depth:
            return False
        now = self.clock()
        t = self._ticket(info, None, now)
        try:
            v, h, d = judge_route(self.q, self.sched, info, t, now)
        except NoEligibleWorker:
            return True
        if v != GO or h is None or d is None:
            return False
        self.q.record(t, now)
        self._picked = (info, h, d)
        return True

    async def wait(self, info: RequestInfo) -> None:
        """Queue ``info`` until the pump dispatches it (its lease taken, :meth:`take_lease`).
        Raises :class:`~router.errors.Overloaded` (429: shed) or NoEligibleWorker (503)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        now = self.clock()
        t = self._ticket(info, fut, now)
        if not self.q.offer(t):
            self._count_shed(t, FULL)
            raise self._overloaded(t, FULL, now)
        self._pump()
        self._ensure_poller()
        try:
            await fut
        except asyncio.CancelledError:
            # the client left: out of the queue; a lease handed over in the same instant goes back
            self.q.withdraw(t, self.clock())
            got = self._granted.pop(id(info), None)
            if got is not None:
                got[3].finish(None)
            raise
        finally:
            self._set_depth()
            # also when shed (429): the access log says how long it queued
            info.queued_s = t.waited or 0.0

    def take_pick(self, info: RequestInfo, exclude: set[int] | frozenset[int]) -> tuple[WorkerHandle, Decision] | None:
        """The decision admission made for ``info`` (:meth:`ready`, or the pump), unless it chose
        a worker in ``exclude`` (then a lease the pump took is given back); None: the edge picks."""
        p = self._picked
        if p is not None and p[0] is info:
            self._picked = None
            if p[1].worker_id not in exclude:
                return p[1], p[2]
            return None
        g = self._granted.get(id(info))
        if g is not None and g[0] is info:
            if g[1].worker_id not in exclude:
                return g[1], g[2]
            del self._granted[id(info)]
            g[3].finish(None)
        return None

    def take_lease(self, info: RequestInfo, h: WorkerHandle) -> Lease | None:
        """The lease the pump took for ``info`` on ``h``; None: the edge takes one."""
        g = self._granted.get(id(info))
        if g is None or g[0] is not info or g[1] is not h:
            return None
        del self._granted[id(info)]
        return g[3]

    def kick(self) -> None:
        """Capacity may have freed (a request of this process ended or got its first token):
        pump once at the next turn of the loop (no-op while nothing waits)."""
        if not self.q.depth or self._kicked:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._kicked = True
        loop.call_soon(self._kick_now)

    def _kick_now(self) -> None:
        self._kicked = False
        self._pump()

    # -- the pump ------------------------------------------------------------------------------
    def _pump(self) -> None:
        now = self.clock()
        out = self.q.pump(now, lambda t: self._try(t, now))
        for t, reason in out.shed:
            self._count_shed(t, reason)
            fut = t.payload.fut
            if fut is not None and not fut.done():
                fut.set_exception(self._overloaded(t, reason, now))
        for t in out.dispatched:
            self._observe_wait(t.priority, t.waited or 0.0)
        self._set_depth()

    def _try(self, t: Ticket[_Wait], now: float) -> str:
        w = t.payload
        fut = w.fut
        if fut is None or fut.done():          # cancelled while queued and not yet withdrawn: drop it
            return FAIL
        try:
            v, lease, d = route_ticket(self.q, self.sched, w.info, t, now)
        except NoEligibleWorker as e:
            fut.set_exception(e)
            return FAIL
        if v == GO and lease is not None and d is not None:
            self._granted[id(w.info)] = (w.info, lease.handle, d, lease)
            fut.set_result(None)
        return v

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        interval = self.cfg.poll_ms / 1000.0
        while self.q.depth:
            await asyncio.sleep(interval)
            self._pump()

    async def close(self) -> None:
        """Stop the poller (shutdown); waiting requests are answered 503 by their handlers."""
        p = self._poller
        if p is not None and not p.done():
            p.cancel()
            try:
                await p
            except asyncio.CancelledError:
                pass

    # -- what is seen --------------------------------------------------------------------------
    def _overloaded(self, t: Ticket[_Wait], reason: str, now: float) -> Overloaded:
        w = t.waited if t.waited is not None else now - t.arrival
        return Overloaded(_WHY[reason].format(w=w) + "; retry later", reason=reason,
                          retry_after=self.q.retry_after(t.priority, now))

    def _count_shed(self, t: Ticket[_Wait], reason: str) -> None:
        if self.metrics is not None:
            self.metrics.admission_shed(reason, t.priority, t.waited or 0.0)

    def _observe_wait(self, priority: int, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.admission_wait(priority, seconds)

    def _set_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.admission_depth(self.q.depth)

    def status(self) -> dict[str, object]:
        """``/dplb/status``'s ``admission`` (this process's queue; :meth:`AdmissionQueue.status`)."""
        return self.q.status(self.clock())


def go_duration_s(text: str) -> float | None:
    """A Go duration (``1h2m3.5s``, ``500ms``, ``250us``; llm-d's ``x-llm-d-inference-ttl``) in
    seconds; a bare number is seconds. None when it does not parse or is negative."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
    s = text.strip()
    if not s:
        return None
    try:
        v = float(s)
        return v if v >= 0 else None
    except ValueError:
        pass
    total = 0.0
    i = 0
    n = len(s)
    while i < n:
        j = i
        while j < n and (s[j].isdigit() or s[j] == "."):
            j += 1
        if j == i:
            return None
        k = j
        while k < n and not (s[k].isdigit() or s[k] == "."):
            k += 1
        unit = s[j:k]
        if unit not in units:
            return None
        try:
            total += float(s[i:j]) * units[unit]
        except ValueError:
            return None
        i = k
    return total


__all__ = ["AdmissionGate", "go_duration_s"]
