"""The one scheduling pipeline, and the only place that decides which workers may take a request.

    lease, decision = scheduler.select(req, exclude)   # raises NoEligibleWorker (503)
    # or, to hand the request to the engine before the bookkeeping:
    handle, decision = scheduler.admit(req, exclude)   # ... write the request ...
    lease = scheduler.lease(handle, decision, req)     # before the next await
    ... forward; report what happened to the attempt ...
    lease.head_seen()          # the worker sent a response head (liveness evidence)
    lease.refused()            # nothing accepted the connection (the worker is down)
    lease.first_token()        # prefill done (the first content came back)
    lease.finish(ok)           # exactly once; ok: the breaker's verdict (None: no verdict, client left)

**Eligibility** (one definition, here): a worker may take a request when its slot is READY (a
DRAINING one never is, whatever the policy: its agent is waiting for its last requests to end
before it stops the engine), its heartbeat is younger than ``heartbeat_timeout_ms``, its probes have not failed ``max_failures``
times in a row, it is not drained or removed by an admin, its breaker lets requests through, no
router process has its circuit open, it serves the requested model (or announces none), and this
request has not already tried it. :meth:`Scheduler.candidates`, :meth:`Scheduler.routing_state`
(the verdict ``/dplb/status`` shows) and :meth:`Scheduler.ready_handles` (``/health``) all read it from :meth:`Scheduler.eligible_handle` and
:meth:`Scheduler.live`. Kernel-backed policies (``dplb``) get the last synced snapshots (the
kernel re-checks state, heartbeat, circuit and KV threshold on the live segment), the baselines
get freshly read slots. After a policy picks, the slot must still be READY at that instant
(:meth:`Scheduler.ready_now`, one relaxed load: a synced snapshot can be one health interval old,
and the ``dplb`` policy's fallback picks from snapshots when the kernel finds nobody), and the
worker's breaker must admit it (a half-open breaker admits one probe); otherwise the pipeline
tries again without it. When every worker serving the model is out (all draining at a stop, say),
:class:`~router.errors.NoEligibleWorker` is raised: 503 + ``Retry-After``.

A :class:`Lease` is the router-side load guard (SGLang's RAII load guard): taking it records the
request in the worker's router line (:mod:`router.accounting`: in-flight, outstanding prefill
tokens, later decoding requests) so every router process, the kernel and the worker's agent (which
drains on that count) see the dispatch at once, and bumps this process's count. The proxy never
writes health state: the lease reports each attempt's outcome, and the health monitor
(:class:`HealthReporter`: probes, liveness) and the breaker make the decisions. (The per-worker
gauges of ``/metrics`` read the segment's counts when scraped.) The proxy calls
:meth:`Lease.first_token` at a stream's first chunk that carries content
(:mod:`router.stream_meter`), not at its first byte.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from dplb_shm import WorkerSnapshot, heartbeat_stale
from router.accounting import LearnSettings, RequestAccount
from router.errors import NoEligibleWorker
from router.metrics import Metrics
from router.policies.base import Decision, Policy, RequestInfo
from router.workers import DEAD, DRAINING, READY, STATE_NAMES, Registry, WorkerHandle

if TYPE_CHECKING:
    from dplb_shm import Segment
    from router.ledger import AccountedSegment


class HealthReporter(Protocol):
    """Where a lease reports liveness evidence (the health monitor, :mod:`router.health`)."""

    def on_refused(self, h: WorkerHandle) -> None:
        """Nothing accepted a connection to ``h``: it is down now (a probe brings it back)."""

    def on_head(self, h: WorkerHandle) -> None:
        """``h`` sent a response head to a real request: it is alive, if busy."""


class _NoHealth:
    """A reporter that ignores everything (schedulers built without a health monitor)."""

    def on_refused(self, h: WorkerHandle) -> None:
        return None

    def on_head(self, h: WorkerHandle) -> None:
        return None


class Lease:
    """One dispatched request on ``handle``: its :class:`~router.accounting.RequestAccount` in the
    segment (router in-flight, outstanding prefill tokens, decoding requests) and this process's
    in-flight count. :meth:`first_token` once prefill is done, :meth:`finish` (or :meth:`release`,
    without a breaker verdict) exactly once at the end (idempotent). ``deadline``: when a request
    whose first token the router cannot see (not
    streamed) is assumed past prefill (dispatch + its estimated TTFT; :meth:`Scheduler.sweep`).

    While open, a streamed request's lease sits in ``book`` (a :class:`DecodeBook`, what the policy
    reads of the decodes in flight): ``max_tokens`` (the request's output bound, None when it sent
    none) and :meth:`streamed` (output tokens so far: ``progress()`` when the proxy set a counter,
    else ``tokens``, which the simulator sets at every token)."""

    __slots__ = ("account", "book", "deadline", "handle", "health", "judged", "max_tokens", "progress", "tokens")

    def __init__(self, handle: WorkerHandle, seg: Segment | AccountedSegment, prompt_tokens: int = 0, uncached_tokens: int | None = None,
                 now: float | None = None, learn: LearnSettings | None = None, deadline: float | None = None,
                 health: HealthReporter | None = None, max_tokens: int | None = None,
                 book: DecodeBook | None = None) -> None:
        self.handle = handle
        self.health: HealthReporter = health if health is not None else _NoHealth()
        self.judged = False
        t = time.monotonic() if now is None else now
        self.account = RequestAccount(seg, handle.worker_id, prompt_tokens,
                                      prompt_tokens if uncached_tokens is None else uncached_tokens, t, learn,
                                      observed=deadline is None)
        self.deadline = deadline
        self.max_tokens = max_tokens
        #: output tokens streamed so far (set by whoever watches the stream; see :meth:`streamed`)
        self.tokens = 0
        self.progress: Callable[[], int] | None = None
        handle.local_inflight += 1
        # streamed: a TPOT victim while in flight (non-streamed: no TPOT)
        self.book = book if deadline is None else None
        if self.book is not None:
            self.book.add(self)

    def streamed(self) -> int:
        """Output tokens this request has streamed so far (0 before its first)."""
        p = self.progress
        return p() if p is not None else self.tokens

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return not self.account.open

    def first_token(self, now: float | None = None, observed: bool = True) -> float | None:
        """Prefill is done (the first content came back, or is assumed to have); returns the TTFT
        in s the first time, None after. See :meth:`RequestAccount.first_token`."""
        return self.account.first_token(time.monotonic() if now is None else now, observed)

    def release(self, now: float | None = None, output_tokens: int | None = None) -> bool:
        """Give the request's load back (no breaker verdict); returns False (and does nothing) when
        already released."""
        if not self.account.open:
            return False
        try:
            self.account.finish(time.monotonic() if now is None else now, output_tokens)
        finally:
            self.handle.local_inflight -= 1
            if self.book is not None:
                self.book.discard(self)
            self.progress = None     # drops the stream meter it may hold
        return True

    def head_seen(self) -> None:
        """The worker answered this attempt with a response head below 500: liveness evidence for
        the health monitor (a probe that times out meanwhile is not held against it)."""
        self.health.on_head(self.handle)

    def refused(self) -> None:
        """Nothing accepted this attempt's connection (refused, socket gone): the worker is down
        for sure; the health monitor takes it out now, a passing probe brings it back."""
        self.health.on_refused(self.handle)

    def finish(self, ok: bool | None, now: float | None = None, output_tokens: int | None = None) -> bool:
        """End the attempt: give its load back (unless :meth:`release` already did, e.g. at a
        stream's end with its token count) and hand the breaker its verdict (``ok`` False: a
        connection error, timeout or 5xx; True: anything else, 4xx and 429 included; None: no
        verdict, e.g. the client left, which frees a half-open breaker's probe). The verdict is
        given exactly once: returns False (and does nothing) after the first call. The same
        verdict is counted in the worker's router stats line (``Segment.outcome_add``: ``ok`` True
        → ``completed``, False → ``failed``, None → neither), the per-worker counts that every
        router process adds to and the dump, ``/dplb/status`` and ``/metrics`` read."""
        if self.judged:
            return False
        self.judged = True
        try:
            self.release(now, output_tokens)
        finally:
            if ok is not None:
                self.account.seg.outcome_add(self.handle.worker_id, int(ok), int(not ok))
        b = self.handle.breaker
        if ok is None:
            b.abandon()
        else:
            b.record(ok)
        return True


class DecodeBook:
    """This process's streamed requests in flight, per worker, as a policy reads them (the TPOT
    victims of :mod:`router.policies.tpot_slo`): each open :class:`Lease` of a streamed request,
    added when taken and dropped when released. ``clock_s``: the leases' clock, seconds
    (``time.monotonic`` live, the virtual clock in the simulator)."""

    __slots__ = ("by_worker", "clock_s")

    def __init__(self, clock_s: Callable[[], float] = time.monotonic) -> None:
        self.clock_s = clock_s
        self.by_worker: dict[int, set[Lease]] = {}

    def add(self, lease: Lease) -> None:
        """Hold ``lease`` (its worker is ``lease.handle.worker_id``) until :meth:`discard`."""
        self.by_worker.setdefault(lease.handle.worker_id, set()).add(lease)

    def discard(self, lease: Lease) -> None:
        """Drop ``lease`` (no-op when not held)."""
        held = self.by_worker.get(lease.handle.worker_id)
        if held is not None:
            held.discard(lease)

    def has_requests(self, worker_id: int) -> bool:
        """Whether worker ``worker_id`` has any streamed request of this process in flight."""
        return bool(self.by_worker.get(worker_id))

    def requests(self, worker_id: int) -> list[tuple[int | None, int, float | None]]:
        """``(max_tokens or None, output tokens streamed so far, seconds since its first token or
        None before it)`` for each streamed request of this process in flight on ``worker_id``
        (one pass per routing decision)."""
        held = self.by_worker.get(worker_id)
        if not held:
            return []
        now = self.clock_s()
        out: list[tuple[int | None, int, float | None]] = []
        append = out.append
        for lease in held:
            tf = lease.account.t_first
            append((lease.max_tokens, lease.streamed(), None if tf is None else now - tf))
        return out

    def victim_rows(self, worker_id: int, tpot_slo_s: float, step_tokens: float,
                    default_output_tokens: int) -> list[tuple[float, float]]:
        """:func:`router.policies.tpot_slo.victim_rows` of :meth:`requests` in one pass over the
        leases (no tuple per request, a request without a TPOT or already done skipped before its
        progress is read): the same ``(slack_s, cap_tokens)`` rows in the same order, the same
        float operations (tests/router/test_tpot_slo.py checks it against the reference). Read at
        every routing decision for every offered worker with streams in flight: about 4 µs per
        stream through the reference on a busy 2-core machine. Raises ValueError as the
        reference does."""
        if tpot_slo_s <= 0 or step_tokens <= 0:
            raise ValueError(f"tpot_slo_s {tpot_slo_s} and step_tokens {step_tokens} must be > 0")
        rows: list[tuple[float, float]] = []
        held = self.by_worker.get(worker_id)
        if not held:
            return rows
        now = self.clock_s()
        append = rows.append
        for lease in held:
            o = lease.max_tokens
            if o is None:
                o = default_output_tokens
            if o <= 1:
                continue
            p = lease.progress
            k = p() if p is not None else lease.tokens
            if k >= o:
                continue
            tf = lease.account.t_first
            spent = now - tf if tf is not None else 0.0
            if not spent > 0.0:
                spent = 0.0
            if k > 1:
                slack = (o - 1) * (tpot_slo_s - spent / (k - 1))
                left = o - k
            else:
                slack = (o - 1) * tpot_slo_s - spent
                left = o - 1
            if slack >= 0.0:
                append((slack, left * step_tokens))
        return rows


class Scheduler:
    """Runs the pipeline for ``policy`` over ``registry`` (see module docstring)."""

    def __init__(self, registry: Registry, policy: Policy, seg: Segment, metrics: Metrics | None = None,
                 learn: LearnSettings | None = None, default_rate: float = 30_769.0,
                 health: HealthReporter | None = None, accounts: AccountedSegment | None = None,
                 clock_s: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        #: what leases account on: ``seg``, or a :class:`router.ledger.AccountedSegment` that also
        #: records this process's share so that it can be given back should the process die
        self.accounts = seg if accounts is None else accounts
        self.health: HealthReporter = health if health is not None else _NoHealth()
        self.policy = policy
        #: this process's streamed requests per worker, for policies that price their decodes
        #: (``clock_s``: the clock the leases are stamped with, seconds)
        self.decodes = DecodeBook(clock_s)
        policy.bind_decodes(self.decodes)
        self.seg = seg
        self.metrics = metrics
        self.learn = learn if learn is not None else LearnSettings()
        self.default_rate = default_rate
        #: leases of requests whose first token the router cannot see (non-streamed), until swept
        self.blind: set[Lease] = set()
        # what eligibility reads: the kernel re-reads live slots itself; load-blind baselines use
        # the last tick's snapshots; load-aware ones re-read every slot
        self.fresh: str = ("kernel" if policy.uses_kernel else "fresh" if policy.reads_load else "cached")

    def decide(self, req: RequestInfo, exclude: set[int] | frozenset[int] = frozenset(),
               explain: bool = False) -> tuple[WorkerHandle, Decision]:
        """Choose a worker without dispatching (``/dplb/route`` uses it with ``explain``).

        Raises NoEligibleWorker (reason ``no_workers``: none registered; ``none_eligible``: all
        excluded, unhealthy, open or busy)."""
        excl = set(exclude)
        handles = self.registry.handles
        for _ in range(len(handles) + 1):
            cands = self.candidates(req.model, excl, self.fresh)
            if not cands:
                break
            d = self.policy.choose(cands, req, explain)
            h = handles.get(d.worker_id)
            if h is None or not self.ready_now(h):
                excl.add(d.worker_id)
                continue
            return h, d
        if not handles:
            raise NoEligibleWorker("no worker is registered", reason="no_workers")
        raise NoEligibleWorker(self._why_none(req.model, excl), reason="none_eligible")

    def _why_none(self, model: str | None, exclude: set[int]) -> str:
        """The 503's message: why no worker took it, per worker serving ``model`` (at most 8
        named), e.g. ``no worker can take the request now (worker 0: draining, worker 1:
        unhealthy)``. Cold path: only when a request is refused."""
        why = []
        for wid, h in sorted(self.registry.handles.items()):
            if not h.serves(model):
                continue
            verdict = self.routing_state(h)
            if verdict == "eligible":
                verdict = "tried" if wid in exclude else "unavailable"   # tried by a retry, or not live at this read
            why.append(f"worker {wid}: {verdict}")
        if not why:
            return (f"no worker of model '{model}' is up (all of them left)" if model is not None
                    else "no worker can take the request now")
        more = f", {len(why) - 8} more" if len(why) > 8 else ""
        return f"no worker can take the request now ({', '.join(why[:8])}{more})"

    def select(self, req: RequestInfo, exclude: set[int] | frozenset[int] = frozenset(),
               now: float | None = None) -> tuple[Lease, Decision]:
        """:meth:`admit` then :meth:`lease`: choose, admit through the breaker, take the lease."""
        h, d = self.admit(req, exclude)
        return self.lease(h, d, req, now), d

    def admit(self, req: RequestInfo, exclude: set[int] | frozenset[int] = frozenset()) -> tuple[WorkerHandle, Decision]:
        """Choose a worker whose breaker admits the request (a half-open breaker's one probe is
        taken here); a worker the breaker refuses is left out and the choice made again. Nothing
        is recorded: :meth:`lease` must follow, before the caller yields to the event loop, so that
        the next decision of this process sees the load. Raises NoEligibleWorker."""
        excl = set(exclude)
        while True:
            h, d = self.decide(req, excl)
            if h.breaker.allow():
                return h, d
            excl.add(h.worker_id)

    def lease(self, h: WorkerHandle, d: Decision, req: RequestInfo, now: float | None = None) -> Lease:
        """Record the dispatch of ``req`` to ``h`` as decided by ``d``: take a :class:`Lease`, tell
        the policy (its prefix index), count the decision.

        The lease is charged ``d.uncached_tokens`` (the policy's estimate of what the worker must
        compute; the whole prompt when the policy has none). For a request the router will not see
        the first token of (not streamed), the lease is also registered for :meth:`sweep`."""
        t = time.monotonic() if now is None else now
        u = req.prompt_len if d.uncached_tokens is None else d.uncached_tokens
        deadline = None
        if not req.stream:
            est = d.est_s
            if est is None or not est < float("inf"):
                est = u / self.default_rate
            deadline = t + est
        lease = Lease(h, self.accounts, req.prompt_len, u, t, self.learn, deadline, self.health, req.max_tokens,
                      self.decodes)
        if deadline is not None:
            self.blind.add(lease)
        self.policy.on_dispatch(h.worker_id, req)
        if self.metrics is not None:
            self.metrics.decision(self.policy.name, d.reason)
        return lease

    def sweep(self, now: float | None = None) -> int:
        """Move non-streamed requests past their estimated TTFT from prefill to decode (the router
        never sees their first token; without this their prompt would count as queued prefill
        until the whole answer is back). Forgets released leases. Returns how many moved."""
        t = time.monotonic() if now is None else now
        moved = 0
        for lease in list(self.blind):
            if lease.released or lease.account.first_seen:
                self.blind.discard(lease)
            elif lease.deadline is not None and t >= lease.deadline:
                lease.first_token(t, observed=False)
                self.blind.discard(lease)
                moved += 1
        return moved

    # -- eligibility: the one definition (module docstring) -----------------------------------
    def live(self, s: WorkerSnapshot) -> bool:
        """Slot READY with a fresh heartbeat: ``heartbeat_age_ms`` (computed at read time), or the
        age on the registry's routing clock when it has one (the simulator's virtual clock); and
        read consistently (not ``stale``: a writer that stopped inside a write)."""
        clock = self.registry.clock
        if clock is None:
            age_ms = float(s.heartbeat_age_ms)
        else:
            age_ms = (clock() - int(s.heartbeat_ns)) / 1e6 if int(s.heartbeat_ns) > 0 else -1.0
        return (int(s.state) == READY and not s.stale
                and not heartbeat_stale(s.state, age_ms, self.registry.hb_timeout_ms))

    def ready_now(self, h: WorkerHandle) -> bool:
        """Is ``h``'s slot READY at this instant? One relaxed load of the live slot's state
        (``Segment.state_get``), the last check of a pick: a worker whose agent began draining (or
        an admin restart) since the last synced snapshot is never sent a request. The kernel makes
        the same check of every slot itself; this one covers the baselines that pick from synced
        snapshots and the ``dplb`` policy's fallback. True when the candidates were read just now
        (``fresh``) or there is no segment (unit tests of the pipeline alone)."""
        if self.fresh == "fresh" or self.seg is None:
            return True
        return int(self.seg.state_get(h.worker_id)) == READY

    @staticmethod
    def eligible_handle(h: WorkerHandle) -> bool:
        """What this router process knows of ``h`` allows it: probes pass, not drained, breaker
        closed or half-open with its probe free (slot state and heartbeat: :meth:`live`)."""
        return h.probe_ok and not h.drained and h.breaker.available()

    def candidates(self, model: str | None, exclude: set[int] | frozenset[int], fresh: bool | str) -> list[WorkerSnapshot]:
        """Snapshots of eligible workers for ``model``, ``exclude`` left out.

        ``fresh``: ``True``/``"fresh"`` re-reads each slot now (load-aware baselines, ~5 µs per
        slot); ``"cached"`` uses the last synced snapshot but still requires it READY and fresh
        (round_robin/random: no load read, liveness as of the last tick, ≤ one health interval old);
        ``False``/``"kernel"`` uses the last synced snapshot, leaving out a DEAD or DRAINING one (a
        draining slot never turns READY again: its agent releases it), the rest unchecked (the
        kernel re-reads state, heartbeat and circuit of the live slot itself).
        Whatever the mode, :meth:`decide` confirms the pick with :meth:`ready_now`."""
        out = []
        cached = fresh == "cached"
        if fresh == "kernel" or cached:
            fresh = False
        seg = self.seg
        for wid, h in self.registry.handles.items():
            if wid in exclude or not self.eligible_handle(h) or not h.serves(model):
                continue
            if cached:
                s = h.snap
                if s is not None and self.live(s) and int(s.circuit) != 1:
                    out.append(s)
            elif fresh:
                s = seg.read_slot(wid)
                # circuit 1: another router process opened it (the kernel skips it too)
                if not self.live(s) or s.endpoint != h.endpoint or int(s.circuit) == 1:
                    continue
                h.snap = s
                out.append(s)
            elif h.snap is not None and int(h.snap.state) not in (DEAD, DRAINING):
                out.append(h.snap)
        return out

    def has_candidates(self, model: str | None, exclude: set[int] | frozenset[int]) -> bool:
        """Would another worker be there for a retry (last synced snapshots)?"""
        return bool(self.candidates(model, exclude, False))

    def ready_handles(self) -> list[WorkerHandle]:
        """Handles that are eligible right now as far as the last synced snapshot shows."""
        return [h for h in self.registry.handles.values()
                if h.snap is not None and self.live(h.snap) and self.eligible_handle(h)]

    def models(self) -> list[str]:
        """The models this router knows (sorted): every model a slot has announced since the
        router started, whether its workers are up, down or gone (``/v1/models``; a request that
        names none is ambiguous when there are several)."""
        return sorted(self.registry.models_seen)

    def served(self) -> str:
        """The known models for an error message: ``a, b`` (``none`` when there is none)."""
        return ", ".join(self.models()) or "none"

    def knows_model(self, model: str | None) -> bool:
        """False only when ``model`` is named and no slot of this router ever served it (a 404);
        a known model whose workers are all out is a 503 (:meth:`decide`). True while no slot has
        announced anything yet, or a listed worker announces no model (it serves any)."""
        if model is None:
            return True
        reg = self.registry
        if model in reg.models_seen or not reg.models_seen:
            return True
        return any(not h.model for h in reg.handles.values())

    def model_rows(self) -> dict[str, dict[str, list[int]]]:
        """``/dplb/status``'s ``models``: for every known model (:meth:`models`), the listed workers
        serving it and those of them this router routes to now (``eligible``); both empty for a
        model whose workers all left."""
        out: dict[str, dict[str, list[int]]] = {m: {"workers": [], "eligible": []} for m in self.models()}
        for wid, h in sorted(self.registry.handles.items()):
            row = out.get(h.model)
            if row is None:
                continue
            row["workers"].append(wid)
            if self.routing_state(h) == "eligible":
                row["eligible"].append(wid)
        return out

    def routing_state(self, h: WorkerHandle, snap: WorkerSnapshot | None = None) -> str:
        """Why this router does or does not send requests to ``h``: ``eligible``; else the first of
        the slot's state when not ready (``starting``, ``draining``, ``dead``, ``unknown``),
        ``stale`` (heartbeat older than ``heartbeat_timeout_ms``, or the slot's writer stopped
        inside a write, whatever state the torn copy shows: the agent itself is gone or stuck),
        ``draining`` (an admin's drain: the one word for a drain, in the slot state, this verdict
        and the row's ``draining`` flag), ``unhealthy`` (probes failing), ``circuit_open``. ``snap``: a
        fresher read of the slot than the last synced one (``/metrics`` reads it at scrape time)."""
        s = h.snap if snap is None else snap
        if s is None:
            return "unknown"
        if s.stale:
            return "stale"
        st = int(s.state)
        if st != READY:
            return STATE_NAMES.get(st, "unknown")
        if not self.live(s):
            return "stale"
        if h.drained:
            return "draining"
        if not h.probe_ok:
            return "unhealthy"
        if not h.breaker.available():
            return "circuit_open"
        return "eligible"

    def status_rows(self) -> list[dict[str, object]]:
        """``/dplb/status`` rows: :meth:`router.workers.Registry.status_rows` with this verdict."""
        return self.registry.status_rows(self.routing_state)


__all__ = ["HealthReporter", "Lease", "Scheduler"]
