"""Request control, apart from the protocols that carry the request (llm-d's ``Director``,
``pkg/epp/requestcontrol/director.go``, beside its ext_proc handlers): the one place both edges
call, the HTTP router's hot path (:class:`router.proxy.Proxy`) and the gateway's endpoint picker
(``epp``'s ext_proc stream). An edge speaks its protocol (headers, bodies, retries, Envoy's
messages); the :class:`Director` decides and keeps the books:

==================  ===========================================================================
step                what it does (and what the client gets when it fails)
==================  ===========================================================================
parse               the body, once, for what routing reads (:func:`dplb_protocol.wire.parse_request`)
                    and the session id: :meth:`Director.parse` (400)
model check         :meth:`Director.check_model`: 400 when several models are served and none is
                    named, 404 for a model no slot of this router ever served (a known model whose
                    workers are all out is a 503 at dispatch)
admission           the point where a request may **wait** before it is dispatched:
                    :meth:`Director.may_dispatch` (synchronous: the hot path dispatches from the
                    connection's callback when it says yes) and :meth:`Director.admit` (awaited by
                    an edge otherwise). The :class:`Admission` in place decides: the router's
                    queue (:class:`router.admission_gate.AdmissionGate`, docs/admission.md: 429 +
                    ``Retry-After`` for a request it sheds), or :class:`OpenAdmission`, which
                    lets every request through at once
dispatch            admit-then-lease (:meth:`Director.pick`, then :meth:`Director.lease`; the HTTP
                    edge writes the request to a pooled connection between the two, so the engine
                    reads while the lease is taken): eligibility → policy → breaker admission
                    (:class:`router.scheduling.Scheduler`); 503 + ``Retry-After``
                    (:class:`router.errors.NoEligibleWorker`) when no worker can take it
first content       :meth:`Director.first_content`: the TTFT histogram, the lease leaves prefill
                    (router accounting, learned prefill rate), the routing and queue/prefill phases
stream end          :meth:`Director.stream_end`: the stream's token counts on the worker, its decode
                    phase, the lease released with the output token count (the TPOT EWMA and the
                    TPOT-SLO term learn from it)
answer              :meth:`Director.answer`: a non-streamed answer's token counts (its ``usage``)
the request's end   :meth:`Director.finished` (the answer's status, under the worker's label and
                    so its model), :meth:`Director.client_left` (status **499**, nginx's "client
                    closed request", and a ``client_disconnect`` error on the worker),
                    :meth:`Director.refused` (an error answered before any worker was chosen,
                    under ``none``): ``dplb_router_requests_total`` and the duration histogram,
                    and the access line where the edge keeps one (the HTTP router's)
the drain limit     the router's own stop cut a request at its drain limit (uvicorn cancels what
                    is still in flight; the client is still connected): a stream already started
                    ends with an SSE error event (:meth:`Director.drain_cut_stream`), a request
                    not yet answered gets a 503 + ``Retry-After`` (:meth:`Director.drain_cut`);
                    both counted 503 with a ``drain_cut`` error, never 499
==================  ===========================================================================

The 499 rule both edges apply: a client that leaves before its whole answer is counted 499 and
its lease finished without a breaker verdict; a stream whose end (the chunked terminator, or its
SSE ``data: [DONE]``) reached the client is complete (200) whatever the client does afterwards
(the official ``openai`` client closes its connection at ``[DONE]``).

The Director holds no per-request state (no allocation per request): an edge passes what each
step needs. Its collaborators are the :class:`~router.scheduling.Scheduler`, the
:class:`~router.metrics.Metrics` and an optional :class:`~router.access_log.AccessLog`.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from dplb_protocol.wire import parse_request
from router.access_log import AccessLog
from router.errors import (
    BadRequest,
    DrainCut,
    NotFound,
    RouterError,
    UpstreamError,
    sse_error_event,
)
from router.metrics import Metrics
from router.policies.base import Decision, RequestInfo
from router.scheduling import Lease, Scheduler
from router.stream_meter import (
    StreamMeter,
    body_aborted,
    event_json,
    events_aborted,
    has_content,
    usage_from_body,
)
from router.workers import WorkerHandle

#: the status a request the client left before its answer is counted with (nginx's 499, "client
#: closed request"; never sent: nobody is there to read it)
CLIENT_CLOSED = 499
#: the ``errors`` kind of an engine-side abort the client did not ask for (an engine's 499, a
#: ``finish_reason: "abort"``): the request was dropped by the engine, not by its client
ENGINE_ABORT = "engine_abort"
#: the ``errors`` kind of a request the router's own stop cut at its drain limit (503: a stream
#: ends with an SSE error event, a request not yet answered gets a 503 + ``Retry-After``)
DRAIN_CUT = "drain_cut"
#: the worker label of a request answered before any worker was chosen
NO_WORKER = "none"
#: the paths counted under their own name (``route`` label of the request metrics); any other
#: proxied path is counted as ``/v1/other`` (:func:`route_of`): the label's values stay bounded
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings"})


def route_of(path: str) -> str:
    """The bounded ``route`` metric label of a request to ``path`` (:data:`ROUTES`)."""
    return path if path in ROUTES else "/v1/other"


class Admission(Protocol):
    """Decides when a parsed, known request may be dispatched (the :class:`Director`'s admission
    step). :meth:`ready` is asked first, synchronously, on the hot path; only when it says no does
    an edge await :meth:`wait`, which returns when the request may go (a fresh routing decision
    follows) or raises a :class:`~router.errors.RouterError` to refuse it (e.g. a 429 with
    ``Retry-After`` for one that waited its budget); a client that leaves cancels the wait."""

    def ready(self, info: RequestInfo) -> bool:
        """May ``info`` be dispatched now, without waiting?"""
        ...

    async def wait(self, info: RequestInfo) -> None:
        """Wait until ``info`` may be dispatched; raises RouterError to refuse it."""
        ...

    def tag(self, info: RequestInfo, headers: Iterable[tuple[bytes, bytes]], auth: bytes | None) -> None:
        """Read what admission orders by (class, tenant, budget) from the request's headers."""
        ...

    def take_pick(self, info: RequestInfo, exclude: set[int] | frozenset[int]) -> tuple[WorkerHandle, Decision] | None:
        """The choice admission already made for ``info`` (None: the edge's pick makes it)."""
        ...

    def take_lease(self, info: RequestInfo, handle: WorkerHandle) -> Lease | None:
        """The lease admission already took for ``info`` on ``handle`` (None: the edge takes it)."""
        ...

    def kick(self) -> None:
        """A request ended or got its first token: capacity may have freed."""
        ...


class OpenAdmission:
    """Every request may be dispatched at once (no queue): :meth:`ready` is always True."""

    __slots__ = ()

    def ready(self, info: RequestInfo) -> bool:
        """Always True."""
        return True

    async def wait(self, info: RequestInfo) -> None:
        """Returns at once (never called while :meth:`ready` says yes)."""
        return

    def tag(self, info: RequestInfo, headers: Iterable[tuple[bytes, bytes]], auth: bytes | None) -> None:
        """Nothing to read."""
        return

    def take_pick(self, info: RequestInfo, exclude: set[int] | frozenset[int]) -> tuple[WorkerHandle, Decision] | None:
        """None: the edge picks."""
        return None

    def take_lease(self, info: RequestInfo, handle: WorkerHandle) -> Lease | None:
        """None: the edge takes the lease."""
        return None

    def kick(self) -> None:
        """Nothing waits."""
        return


class Director:
    """Request control for one router process or picker (module docstring). ``needs_text``: the
    policy reads the prompt's text (:attr:`router.policies.base.Policy.needs_text`);
    ``access``: the access log the edge keeps (None: none, the picker's case); ``admission``: the
    admission step (default :class:`OpenAdmission`; it may be replaced at any time). ``open``:
    True while the admission in place is an :class:`OpenAdmission` (the hot path then skips the
    admission step without a call)."""

    __slots__ = ("_admission", "access", "metrics", "needs_text", "open", "scheduler")

    def __init__(self, scheduler: Scheduler, metrics: Metrics, needs_text: bool = True,
                 access: AccessLog | None = None, admission: Admission | None = None) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self.needs_text = needs_text
        self.access = access
        self.open = True
        self._admission: Admission = OpenAdmission()
        if admission is not None:
            self.admission = admission

    @property
    def admission(self) -> Admission:
        """The admission step in place (:class:`Admission`)."""
        return self._admission

    @admission.setter
    def admission(self, adm: Admission) -> None:
        self._admission = adm
        self.open = type(adm) is OpenAdmission   # a subclass may hold requests: asked

    # -- parse and model check -------------------------------------------------------------------
    def parse(self, path: str, body: bytes, session: bytes | None = None) -> RequestInfo:
        """``body`` (the request's JSON, posted to ``path``) parsed for routing
        (:func:`dplb_protocol.wire.parse_request`), with ``session`` (the session header's value, if
        any). Raises BadRequest (400) for a body that is no JSON object or a field of a wrong type."""
        info = parse_request(path, body, self.needs_text)
        if session:
            info.session = session.decode("latin-1")
        return info

    def check_model(self, info: RequestInfo) -> None:
        """Check ``info``'s model against the known ones (:meth:`Scheduler.models`). Raises BadRequest
        (no model named where several are known) or NotFound (a model no slot of this router ever
        served; a known one whose workers are all out is a 503, raised by :meth:`pick`)."""
        sched = self.scheduler
        sched.registry.refresh_if_changed()
        if info.model is None and len(sched.models()) > 1:
            raise BadRequest(f"name the model: this endpoint serves {', '.join(sched.models())}",
                             param="model")
        if not sched.knows_model(info.model):
            raise NotFound(f"the model '{info.model}' does not exist (served: {sched.served()})", param="model")

    def request(self, path: str, body: bytes, session: bytes | None = None) -> RequestInfo:
        """:meth:`parse` then :meth:`check_model`: the request as routing sees it. Raises
        BadRequest or NotFound."""
        info = self.parse(path, body, session)
        self.check_model(info)
        return info

    # -- admission -------------------------------------------------------------------------------
    def may_dispatch(self, info: RequestInfo, headers: Iterable[tuple[bytes, bytes]] | None = None,
                     auth: bytes | None = None) -> bool:
        """May ``info`` be dispatched now without waiting (:meth:`Admission.ready`)? An edge that
        gets False awaits :meth:`admit` before :meth:`pick`. ``headers`` (and ``auth``): the
        request's, read first for its class, tenant and budget (:meth:`tag`) when given."""
        if self.open:
            return True
        if headers is not None:
            self._admission.tag(info, headers, auth)
        return self._admission.ready(info)

    async def admit(self, info: RequestInfo) -> None:
        """The admission step: returns when ``info`` may be dispatched (at once when
        :meth:`may_dispatch`), else waits its turn (:meth:`Admission.wait`). Raises RouterError
        when admission refuses it; a client that leaves cancels the wait (CancelledError)."""
        adm = self._admission
        if not self.open and not adm.ready(info):
            await adm.wait(info)

    # -- dispatch --------------------------------------------------------------------------------
    def pick(self, info: RequestInfo, exclude: set[int] | frozenset[int] = frozenset()) -> tuple[WorkerHandle, Decision]:
        """Choose a worker for ``info``, leaving out the workers of ``exclude`` (tried already, or
        unreachable from the edge): :meth:`Scheduler.admit` (eligibility, policy, breaker admission).
        The admission step's own choice when it made one (:meth:`Admission.take_pick`: the request
        was judged, or dispatched from the queue, on that decision). Raises NoEligibleWorker (503 +
        ``Retry-After``)."""
        if not self.open:
            got = self._admission.take_pick(info, exclude)
            if got is not None:
                return got
        return self.scheduler.admit(info, exclude)

    def lease(self, handle: WorkerHandle, decision: Decision, info: RequestInfo) -> Lease:
        """Take the lease of ``info`` on ``handle`` (chosen by :meth:`pick` with ``decision``): the
        request's load in the segment until the lease is finished, exactly once (the one admission
        took when it dispatched the request from its queue: :meth:`Admission.take_lease`)."""
        if not self.open:
            pre = self._admission.take_lease(info, handle)
            if pre is not None:
                return pre
        return self.scheduler.lease(handle, decision, info)

    def dispatch(self, info: RequestInfo, exclude: set[int] | frozenset[int] = frozenset()) -> tuple[WorkerHandle, Lease]:
        """:meth:`pick` then :meth:`lease` (an edge with nothing to do between). Raises
        NoEligibleWorker."""
        h, d = self.pick(info, exclude)
        return h, self.lease(h, d, info)

    def tag(self, info: RequestInfo, headers: Iterable[tuple[bytes, bytes]], auth: bytes | None = None) -> None:
        """Set ``info``'s priority class, tenant and queue budget from the request's ``headers``
        (lower-case names, raw bytes) and ``Authorization`` value (:meth:`Admission.tag`)."""
        if not self.open:
            self._admission.tag(info, headers, auth)

    # -- bookkeeping at first content and at the end ---------------------------------------------
    def first_content(self, route: str, t0: float, lease: Lease | None) -> float:
        """A stream's first content reached the client: the TTFT histogram (from the request's
        arrival, ``t0`` on ``time.perf_counter``; labelled with the worker's model), the lease
        leaves prefill (router accounting, learned prefill rate, TTFT EWMA), and the request's
        routing and queueing/prefill phases. Returns the TTFT, s."""
        metrics = self.metrics
        ttft = time.perf_counter() - t0
        if not self.open:
            self._admission.kick()
        if lease is None:
            metrics.observe_ttft(route, ttft)
            return ttft
        model = lease.handle.model or ""
        metrics.observe_ttft(route, ttft, model)
        since_dispatch = lease.first_token()
        if since_dispatch is not None:
            metrics.observe_phase("routing", model, max(0.0, ttft - since_dispatch))
            metrics.observe_phase("queue_prefill", model, since_dispatch)
        return ttft

    def stream_end(self, meter: StreamMeter, lease: Lease | None, complete: bool) -> tuple[int, int] | None:
        """A relayed stream ended (``complete``: its whole answer reached the client): count its
        tokens on the worker (``meter``'s output events; its ``usage``, else the router's prompt
        estimate), the decode phase of a complete one, and release the lease with the output
        token count (the TPOT EWMA learns from a complete one). Returns ``(prompt tokens, output
        tokens)`` (None without a lease)."""
        if lease is None:
            return None
        out = meter.output_tokens()
        prompt, _ = meter.usage()
        h = lease.handle
        model = h.model or ""
        prompt_n = lease.account.prompt_tokens if prompt is None else prompt
        self.metrics.count_tokens(h.worker_id, model, prompt_n, out)
        t_first = lease.account.t_first
        if complete and t_first is not None:
            self.metrics.observe_phase("decode", model, max(0.0, time.monotonic() - t_first))
        lease.release(output_tokens=out if complete else None)
        return prompt_n, out

    # -- engine-side aborts: a truncated answer is a failure ------------------------------------
    @staticmethod
    def aborted_before_content(body: bytes, stream: bool) -> bool:
        """Did the engine abort a request before anything of its answer could reach the client:
        a non-streamed answer (``body``, whole) that reports ``finish_reason: "abort"``, or a
        stream whose first bytes (``body``) report it with no content event before? Then the
        edge tries it on another worker (the client has seen none of it), or answers 502."""
        if not stream:
            return body_aborted(body)
        if not events_aborted(body):
            return False
        return not any((obj := event_json(e)) is not None and has_content(obj) for e in body.split(b"\n\n"))

    @staticmethod
    def aborted_anywhere(body: bytes, stream: bool) -> bool:
        """Does ``body`` (a whole answer, or a stream's bytes) report an engine-side abort at all
        (then it is not answered whole from the connection's callback)?"""
        return events_aborted(body) if stream else body_aborted(body)

    def abort_error(self, wid: int) -> UpstreamError:
        """The error for a request worker ``wid``'s engine aborted before anything reached the
        client (counted as an ``engine_abort`` error there)."""
        self.metrics.errors.labels(str(wid), ENGINE_ABORT).inc()
        return UpstreamError(f"worker {wid}'s engine aborted the request (finish_reason \"abort\") before its "
                             "answer began", worker_id=wid)

    def aborted_stream(self, meter: StreamMeter, wid: int) -> tuple[int, str, bytes] | None:
        """A relayed stream whose last events report an engine-side abort (``meter``): the client
        read a truncated answer. Returns ``(502, cause, the OpenAI-shaped SSE error event that
        ends the stream)`` and counts an ``engine_abort`` error on worker ``wid``; None when the
        stream was not aborted."""
        if not meter.aborted():
            return None
        self.metrics.errors.labels(str(wid), ENGINE_ABORT).inc()
        cause = (f"worker {wid}'s engine aborted the stream (finish_reason \"abort\") after "
                 f"{meter.output_tokens()} output tokens: the answer is truncated")
        return 502, cause, sse_error_event(cause, "upstream_error", 502)

    # -- the router's own stop: the drain limit cut the request ----------------------------------
    def drain_cut_stream(self, meter: StreamMeter, label: str) -> tuple[int, str, bytes]:
        """A relayed stream the router's stop cut at its drain limit (``--drain-timeout``): the
        client read a truncated answer. Returns ``(503, cause, the OpenAI-shaped SSE error event
        that ends the stream)`` and counts a ``drain_cut`` error on the worker labelled ``label``."""
        self.metrics.errors.labels(label, DRAIN_CUT).inc()
        cause = (f"the router stopped and its drain limit cut the stream after {meter.output_tokens()} output "
                 "tokens: the answer is truncated; retry the request")
        return 503, cause, sse_error_event(cause, DrainCut.type, 503)

    def drain_cut(self, label: str) -> DrainCut:
        """The error for a request the router's stop cut at its drain limit before anything was
        answered (counted as a ``drain_cut`` error under ``label``): a 503 with ``Retry-After``."""
        self.metrics.errors.labels(label, DRAIN_CUT).inc()
        return DrainCut("the router stopped and its drain limit came before the answer; retry the request")

    def answer(self, lease: Lease, body: bytes) -> tuple[int, int]:
        """A non-streamed answer ``body`` was relayed: count its tokens on the worker (its
        ``usage``; the router's prompt estimate when it has none). Returns ``(prompt tokens,
        output tokens)``."""
        prompt, out = usage_from_body(body)
        h = lease.handle
        prompt_n = lease.account.prompt_tokens if prompt is None else prompt
        self.metrics.count_tokens(h.worker_id, h.model or "", prompt_n, out or 0)
        return prompt_n, out or 0

    def finished(self, label: str, status: int, route: str, t0: float, rid: bytes = b"", method: str = "",
                 path: str = "", model: str | None = None, ttft: float | None = None, prompt: int | None = None,
                 out: int | None = None, attempts: int = 1, cause: str | None = None, queue_s: float = 0.0) -> float:
        """The request ended with ``status`` on the worker labelled ``label`` (``none``: no
        worker): ``dplb_router_requests_total`` and the duration histogram (``route``: the bounded
        path label; the model is the worker's) and, where the edge keeps one, the access line
        (request id, method, path, the model named, TTFT s, token counts, tries, the cause of a
        5xx, ``queue_s``: the time it waited in the admission queue). Returns the duration, s, since ``t0``
        (``time.perf_counter``)."""
        dt = time.perf_counter() - t0
        if not self.open:
            self._admission.kick()
        self.metrics.observe_request(label, status, route, dt)
        if self.access is not None:
            self.access.emit(rid, method, path, model, label, status, dt, ttft, prompt, out, attempts, cause, queue_s)
        return dt

    def client_left(self, label: str, route: str, t0: float, rid: bytes = b"", method: str = "", path: str = "",
                    model: str | None = None, ttft: float | None = None, prompt: int | None = None,
                    out: int | None = None, attempts: int = 1, queue_s: float = 0.0) -> float:
        """The client left before its whole answer (the 499 rule, module docstring): a
        ``client_disconnect`` error on the worker ``label`` and the request counted 499
        (:meth:`finished`; ``out``: the output tokens a cut stream had sent). Returns the duration, s."""
        self.metrics.errors.labels(label, "client_disconnect").inc()
        return self.finished(label, CLIENT_CLOSED, route, t0, rid, method, path, model, ttft, prompt, out, attempts,
                             queue_s=queue_s)

    def refused(self, e: RouterError, route: str, t0: float, rid: bytes = b"", method: str = "", path: str = "",
                model: str | None = None) -> float:
        """``e`` was answered before any worker was chosen (a bad request, an unknown model, no
        eligible worker, admission's refusal): counted under ``none`` with ``e``'s status, no tries.
        Returns the duration, s."""
        return self.finished(NO_WORKER, e.status, route, t0, rid, method, path, model, attempts=0, cause=e.message)


__all__ = ["CLIENT_CLOSED", "DRAIN_CUT", "ENGINE_ABORT", "NO_WORKER", "ROUTES", "Admission", "Director", "OpenAdmission", "route_of"]
