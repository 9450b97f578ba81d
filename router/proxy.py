"""The forwarding hot path, as a raw ASGI handler (no FastAPI dependency machinery per request).

For ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate`` and other ``POST /v1/*``:

1. check the API key (when configured) and the body size (413 above ``max_body_bytes``);
2. read the body once and parse only what routing needs (:mod:`dplb_protocol.wire`); 400 if malformed,
   404 if no slot of this router ever served the named model (a known model whose workers are
   all out is a 503 at step 3); then admission, where a request may wait
   (:meth:`~router.director.Director.admit`);
3. pick a worker through the scheduling pipeline (:meth:`~router.director.Director.pick`);
4. forward the original bytes and headers (plus a minted ``X-Request-Id`` when absent) and take
   the worker's :class:`~router.scheduling.Lease` (on a pooled connection the request is written
   first, the lease while the engine reads it);
5. wait for the worker's response head and first body byte (``router.first_byte_timeout_s``
   from dispatch: a long prefill, or a whole non-streamed generation); nothing reaches the client
   before that byte, so until then a failure can still be answered with a clean status;
6. retry on another worker (bounded attempts, jittered exponential backoff) what cost the client
   nothing, i.e. failed before the first response byte reached it (a non-streamed answer reaches
   the client whole, so until its last byte): a refused connection or one the worker never read
   (always), a status in ``retries.retry_on_status`` (429, 503), and a connection that broke
   after the worker read the request (the engine exited or reset it; ``retries.retry_on_disconnect``,
   on by default) once: a request that has broken the connections of
   :data:`BROKEN_ENGINES_LIMIT` (2) workers is answered **502** and not tried again (a query of
   death must not take the fleet down; ``dplb_router_query_of_death_total``). An engine's 499 to a
   client still connected (it dropped the request: aborted at shutdown) is retried, never relayed
   (kind ``engine_abort``; 502 when no attempt is left). A timeout is
   answered **504** on the worker that timed out (retried only with ``retries.retry_on_timeout``).
   When no worker is left to take the request (none eligible, or every one tried refused it),
   the answer is **503** with ``Retry-After``, whatever made them fail; 502 and 504 name the
   worker in ``X-DPLB-Worker-ID``;
7. relay the response (whole for non-streamed bodies: one write, from the engine connection's
   callback when no retry is possible, ``Transport.send(on_whole=...)``; chunk by chunk for streams, each gap
   bounded by ``router.idle_timeout_s``; a stream's head leaves with its first chunk, the rest is
   piped from the engine connection's callback and, after its first content, by the native relay,
   the body's end with its last bytes: one client write per engine read, ``relay_stream``)
   with ``X-DPLB-Worker-ID``; a stream that breaks or stalls after its first byte ends with an
   SSE error event (504 ``timeout_error`` for a stall, counted as kind ``timeout``; 502
   otherwise, kind ``stream_broken``); release the lease exactly once in ``finally`` — on
   success, error or client disconnect (the router's protocol calls back when the client's
   connection closes, :func:`router.server.watch_disconnect`; behind another server a watcher
   on ``receive()``; either cancels the work and closes the upstream connection, which makes
   the worker abort the generation). A client that leaves is counted in
   ``dplb_router_requests_total`` with status **499** (nginx's "client closed request"), unless
   it had its whole answer: a stream whose chunked terminator, or whose SSE ``data: [DONE]``, was
   written to it is complete (200) whatever the client does afterwards (the official sync
   ``openai`` client closes its connection at ``[DONE]``, before the engine's last chunk).

The Proxy speaks HTTP; what it decides and records (parse, model check, admission, the
admit-then-lease dispatch, the bookkeeping at first content and at the end) is request control's
(:class:`router.director.Director`), which the gateway's endpoint picker calls too.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from dplb_protocol.wire import HOP_BY_HOP
from router.access_log import AccessLog, text
from router.answers import send_error
from router.asgi import ASGIApp, Scope
from router.config import Config
from router.director import CLIENT_CLOSED, NO_WORKER, ROUTES, Director
from router.drain import settle_cut
from router.errors import (
    BadRequest,
    NoEligibleWorker,
    RouterError,
    TransportError,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamError,
)
from router.exchange import (
    Attempt,
    Exchange,
    Receive,
    Send,
    read_body,
    relayed_headers,
    request_target,
)
from router.failures import BROKEN_ENGINES_LIMIT, breaks, final_error, retryable
from router.metrics import Metrics
from router.policies.base import RequestInfo
from router.quick import QuickAnswer
from router.relay import relay_stream
from router.scheduling import Scheduler
from router.server import (
    ClientGone,
    LaterTask,
    current_task,
    watch_disconnect,
    write_response,
)
from router.transport import Transport
from router.upstream import Upstream

log = logging.getLogger("dplb.router.proxy")

_XRID = b"x-request-id"
_MINTED = "dplb.minted_request_id"   # scope key: the id minted for this request
_NONE = b"none"


class Step(enum.Enum):
    """How one attempt ended (:meth:`Proxy._attempt`): answered, to be retried on another
    worker, or failed with no other try."""

    DONE = "done"
    RETRY = "retry"
    STOP = "stop"


_DONE, _RETRY, _STOP = Step.DONE, Step.RETRY, Step.STOP


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the proxy reads from the config, once: body limit (bytes), API key (the expected
    ``Authorization`` value, None = open), the session header (lower-case bytes), whether the
    policy needs the prompt text, and the retry and timeout settings (``retries.*``,
    ``router.first_byte_timeout_s``/``idle_timeout_s``; backoffs in seconds)."""

    max_body_bytes: int = 64 * 1024 * 1024
    api_key: bytes | None = None
    session_header: bytes = b"x-session-id"
    needs_text: bool = True
    max_attempts: int = 3
    retry_status: frozenset[int] = frozenset({429, 503})
    backoff_base_s: float = 0.01
    backoff_max_s: float = 0.1
    retry_on_timeout: bool = False
    retry_on_disconnect: bool = True
    first_byte_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    access_log: str = "text"

    @classmethod
    def from_config(cls, cfg: Config, needs_text: bool = True) -> ProxySettings:
        """The settings of ``cfg`` (``needs_text``: the policy's)."""
        r = cfg.retries
        return cls(max_body_bytes=cfg.router.max_body_bytes,
                   api_key=f"Bearer {cfg.router.api_key}".encode() if cfg.router.api_key else None,
                   session_header=cfg.routing_policy.session_header.lower().encode("latin-1"),
                   needs_text=needs_text, max_attempts=r.max_attempts, retry_status=frozenset(r.retry_on_status),
                   backoff_base_s=r.backoff_base_ms / 1000.0, backoff_max_s=r.backoff_max_ms / 1000.0,
                   retry_on_timeout=r.retry_on_timeout, retry_on_disconnect=r.retry_on_disconnect,
                   first_byte_timeout_s=cfg.router.first_byte_timeout_s, idle_timeout_s=cfg.router.idle_timeout_s,
                   access_log=cfg.router.access_log)


class Proxy:
    """ASGI callable for the proxied paths: the HTTP edge of request control. Collaborators: the
    :class:`Scheduler` (eligibility, policy, breaker admission, leases), the :class:`Transport`
    (forwarding to engines), the :class:`Metrics`, the :class:`ProxySettings` and the
    :class:`~router.director.Director` (parse, model check, admission, dispatch, bookkeeping; one
    is built from the others when none is given). It decides nothing about health: each
    attempt's outcome goes to its lease (``head_seen``, ``refused``, ``finish(ok)``)."""

    def __init__(self, scheduler: Scheduler, transport: Transport, metrics: Metrics, settings: ProxySettings,
                 director: Director | None = None) -> None:
        self.scheduler = scheduler
        self.transport = transport
        self.metrics = metrics
        self.settings = settings
        self.director = director if director is not None else \
            Director(scheduler, metrics, settings.needs_text, AccessLog(settings.access_log))
        # minted request ids: a random per-process prefix + a counter (one urandom call per process)
        self._prefix = uuid.uuid4().hex[:16].encode()
        self._n = 0

    def _head(self, scope: Scope) -> tuple[bytes, int | None, bytes | None, bytes | None,
                                                              list[tuple[bytes, bytes]], bytes | None, bytes | None]:
        """One pass over the request's headers: ``(request id, declared Content-Length,
        Authorization, Content-Type, headers to forward, session id, Upgrade)``. The request id is
        the client's ``X-Request-Id`` or a minted one, which is then added to the forwarded
        headers; ``Upgrade`` is its value when ``Connection`` asks for it (else None)."""
        upgrade = None
        conn_upgrade = False
        rid: bytes | None = None
        declared = None
        auth = None
        ctype = None
        fwd: list[tuple[bytes, bytes]] = []
        session = None
        sh = self.settings.session_header
        for k, v in scope["headers"]:
            if k == b"content-type":
                ctype = v
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = None
            elif k == b"authorization":
                auth = v
            elif k == _XRID:
                rid = v
            elif k == sh:
                session = v
            if k not in HOP_BY_HOP:
                fwd.append((k, v))
            elif k == b"upgrade":
                upgrade = v
            elif k == b"connection" and b"upgrade" in v.lower():
                conn_upgrade = True
        if rid is None:
            rid = scope.get(_MINTED)   # one id per request, however often its head is read
            if rid is None:
                self._n += 1
                rid = scope[_MINTED] = b"%s%08x" % (self._prefix, self._n)
            fwd.append((_XRID, rid))
        return rid, declared, auth, ctype, fwd, session, upgrade if conn_upgrade else None

    def _check(self, auth: bytes | None, ctype: bytes | None, upgrade: bytes | None = None) -> None:
        """Raise Unauthorized (API key), BadRequest (a request asking to upgrade the connection:
        HTTP's parser hands whatever follows its head, the body included, to the new protocol,
        which the router does not speak) or UnsupportedMediaType (a body that is not JSON)."""
        if self.settings.api_key is not None and auth != self.settings.api_key:
            raise Unauthorized("invalid or missing API key (Authorization: Bearer <key>)")
        if upgrade is not None:
            raise BadRequest(f"the router does not upgrade connections (Upgrade: {upgrade.decode('latin-1')}); "
                             "send the request over HTTP/1.1 without 'Connection: upgrade'")
        if ctype is not None and ctype != b"application/json" and \
                ctype.split(b";", 1)[0].strip().lower() != b"application/json":
            # a body sent as a form or text (curl -d, a misconfigured client); no header at all is accepted
            raise UnsupportedMediaType(f"unsupported Content-Type '{ctype.decode('latin-1')}': send the body "
                                       "as JSON with 'Content-Type: application/json'")

    def _dispatch(self, ex: Exchange, number: int) -> Attempt:
        """Choose a worker for try ``number`` of ``ex`` (:meth:`Scheduler.admit`, the workers
        tried left out), write the request to it when an idle pooled connection is at hand, then take
        the lease, while the engine already reads it (no await between: this process's next decision
        sees the load). Raises NoEligibleWorker (nothing written then)."""
        director = self.director
        info = ex.info
        h, d = director.pick(info, ex.tried)
        written = self.transport.write_pooled(h.endpoint, ex.method, ex.target, ex.headers, ex.body)
        try:
            lease = director.lease(h, d, info)
        except BaseException:
            if written is not None:
                written.transport.close()
            raise
        return Attempt(h, lease, written, number)

    def start(self, scope: Scope, body: bytes) -> ASGIApp | LaterTask | None:
        """Start a request whose whole ``body`` came in with its head, without a task: check, parse,
        choose and write it to its worker now, from the router's protocol callback
        (:class:`router.server.LimitedHttpToolsProtocol`), before the event loop turns. Returns the
        ASGI callable that serves the rest (answer, retries, bookkeeping) as the request's task, or,
        when it went out on a pooled connection, a :class:`router.quick.QuickAnswer` that serves a
        plain whole answer without a task and runs that callable only for anything else; None
        when it is no plain success so far (an error, no eligible worker, a body above the limit, a
        request admission holds back: :meth:`Director.may_dispatch`): nothing was sent or recorded,
        and :meth:`__call__` serves it (answers the error, awaits admission)."""
        t0 = time.perf_counter()
        try:
            rid, _declared, auth, ctype, fwd, session, upgrade = self._head(scope)
            self._check(auth, ctype, upgrade)
            if len(body) > self.settings.max_body_bytes:
                return None
            path = scope["path"]
            director = self.director
            info = director.parse(path, body, session)
            director.check_model(info)
            if not director.open and not director.may_dispatch(info, fwd, auth):
                return None
            ex = Exchange(scope["method"], path if path in ROUTES else "/v1/other", request_target(scope), fwd, body,
                          info, rid, t0)
            pre = self._dispatch(ex, 0)
        except RouterError:
            return None

        async def rest(scope: Scope, receive: Receive, send: Send) -> None:
            # the request's task (at once, or when the taskless serving hands over: router.quick)
            await self._serve(scope, receive, send, ex, pre)

        if pre.written is None:   # (connecting first: the task path)
            return rest
        return QuickAnswer(rest, ex, pre, self.transport.first_byte_timeout_s, self.settings.retry_status,
                           director, self.settle_whole)

    async def refuse(self, scope: Scope, send: Send, error: RouterError) -> None:
        """Answer ``error`` (a ``GET`` on a ``POST``-only path: 405) as any refusal: with an id, counted, logged."""
        await self._refused(send, error, scope["method"], scope["path"], self._head(scope)[0], time.perf_counter(), None)

    async def _refused(self, send: Send, e: RouterError, method: str, path: str, rid: bytes, t0: float,
                       model: str | None) -> None:
        """Answer ``e`` before any worker was chosen, under ``rid``; count it and log it (``model``: as named)."""
        await send_error(send, e, rid)
        self.director.refused(e, path if path in ROUTES else "/v1/other", t0, rid, method, path, model)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        rid, declared, auth, ctype, fwd, session, upgrade = self._head(scope)
        path = scope["path"]
        route = path if path in ROUTES else "/v1/other"  # bounded metric label
        info: RequestInfo | None = None
        try:
            self._check(auth, ctype, upgrade)
            body = await read_body(receive, self.settings.max_body_bytes, declared)
            info = self.director.parse(path, body, session)   # the access line names the model of a 404
            self.director.check_model(info)
            self.director.tag(info, fwd, auth)
            target = request_target(scope)
        except RouterError as e:
            await self._refused(send, e, scope["method"], path, rid, t0, None if info is None else info.model)
            return
        except asyncio.CancelledError:   # the client left while sending its body
            self.director.finished(NO_WORKER, CLIENT_CLOSED, route, t0, rid, scope["method"], path, attempts=0)
            return
        await self._serve(scope, receive, send, Exchange(scope["method"], route, target, fwd, body, info, rid, t0), None)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, ex: Exchange,
                     pre: Attempt | None) -> None:
        """Watch for the client leaving, then :meth:`forward` ``ex`` to ``send`` (``pre``: the
        first attempt, already dispatched by :meth:`start`)."""
        ex.send, ex.scope = send, scope
        task = current_task()
        gone = False

        def on_gone() -> None:
            nonlocal gone
            if task is not None and not task.done():
                gone = ex.gone = True
                task.cancel()

        def on_message(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is None and t.result().get("type") == "http.disconnect":
                on_gone()

        # the client leaving cancels the work (and so closes the upstream connection): told by the
        # router's protocol, else by a task waiting on receive() for http.disconnect
        unwatch = watch_disconnect(scope, on_gone)
        watch = None
        if unwatch is None:
            watch = asyncio.ensure_future(receive())
            watch.add_done_callback(on_message)
        try:
            await self.forward(ex, pre)
        except asyncio.CancelledError:
            if not gone:
                raise
        except OSError as e:
            # ClientGone, or uvicorn's send once the client socket is gone (upstream errors arrive as
            # TransportError; lease and upstream released on the way out); anything else is logged
            if not isinstance(e, ClientGone):
                log.warning("request %s: %s while answering it", text(ex.rid), text(repr(e), 1024), exc_info=True)
        finally:
            if watch is not None:
                watch.remove_done_callback(on_message)
                watch.cancel()
            elif unwatch is not None:
                unwatch()

    async def forward(self, ex: Exchange, pre: Attempt | None = None) -> None:
        """Choose, send, retry what may be retried, relay (module docstring, steps 3-7). Never
        raises RouterError to the caller; a client that left is counted (status 499) and its
        CancelledError / ClientGone re-raised. ``pre``: the first attempt when :meth:`start`
        dispatched it already; else the request passes admission first (:meth:`Director.admit`,
        where it may wait; a refusal is answered with its status)."""
        label = "none"  # the worker of the current attempt (metric label)
        director = self.director
        try:
            if pre is None and not director.open and not director.may_dispatch(ex.info):
                try:
                    await director.admit(ex.info)
                except RouterError as e:
                    await self._answer_error(ex, e, NO_WORKER, 0)
                    return
            for n in range(self.settings.max_attempts):
                if n:
                    await self._backoff(n)
                if pre is not None:
                    att, pre = pre, None
                else:
                    try:
                        att = self._dispatch(ex, n)
                    except NoEligibleWorker as e:
                        if ex.last is None:
                            await self._answer_error(ex, e, "none", n)
                            return
                        ex.no_worker = e
                        break
                label = att.handle.label
                step = await self._attempt(ex, att)
                if step is _DONE:
                    return
                if step is _STOP:
                    break
        except (asyncio.CancelledError, ClientGone) as e:
            # the client left (499; relay_stream: a whole stream), or the stop's drain limit cut it (503, router.drain)
            if not await settle_cut(ex, label, director, e):
                raise
            return
        st = self.settings
        err = final_error(ex.last, ex.last_wid, len(ex.tried), ex.mid_body, ex.broken, ex.no_worker,
                          st.idle_timeout_s, st.first_byte_timeout_s)
        if ex.broken >= BROKEN_ENGINES_LIMIT and err.status == 502:
            self.metrics.query_of_death.inc()
            log.warning("request %s broke the connection of %d workers (last: worker %s); answered 502, not tried "
                        "again", text(ex.rid), ex.broken, ex.last_wid)
        wb = str(ex.last_wid).encode() if ex.last_wid is not None and err.status != 503 else _NONE
        await self._answer_error(ex, err, wb.decode(), len(ex.tried), wb)

    async def _backoff(self, n: int) -> None:
        """Sleep before try ``n`` (> 0): jittered exponential backoff, capped (``retries.*``)."""
        st = self.settings
        delay = min(st.backoff_max_s, st.backoff_base_s * (2 ** (n - 1))) * random.uniform(0.5, 1.5)
        if delay > 0:
            await asyncio.sleep(delay)

    async def _answer_error(self, ex: Exchange, e: RouterError, label: str, attempts: int,
                            worker: bytes = _NONE) -> None:
        """Answer ``ex`` with the router's error ``e`` (``worker``: its ``X-DPLB-Worker-ID``),
        count it under ``label`` and write its access-log line (``attempts`` tries)."""
        await send_error(ex.send, e, ex.rid, worker)
        self.director.finished(label, e.status, ex.route, ex.t0, ex.rid, ex.method, ex.info.path, ex.info.model,
                               None, ex.info.prompt_len, None, attempts, e.message, queue_s=ex.info.queued_s)

    def _failed(self, ex: Exchange, att: Attempt, e: Exception, kind: str | None, up: Upstream | None) -> None:
        """Attempt ``att`` failed before its first byte reached the client: its upstream (if any)
        is dropped, the error counted (``kind``; None: not an error of the worker's) and recorded
        on ``ex`` (:meth:`Exchange.failed`)."""
        if up is not None:
            up.release(abort=True)
        if kind is not None:
            self.metrics.errors.labels(att.handle.label, kind).inc()
        ex.failed(att.handle.worker_id, e)

    async def _attempt(self, ex: Exchange, att: Attempt) -> Step:
        """Try ``ex`` on ``att``'s worker: :data:`_DONE` (answered), :data:`_RETRY` (failed before
        the first byte, may go to another worker) or :data:`_STOP` (failed, no other try). The
        lease is finished with the attempt's outcome whatever happens."""
        try:
            got = await self._response(ex, att)
            if isinstance(got, Step):
                return got
            up, first, data = got
            resp_headers = relayed_headers(up, ex.rid, att.handle.label_b)
            if data is None:
                ok = await relay_stream(ex, att, up, first, resp_headers, self.director,
                                        self.settings.idle_timeout_s)
                att.outcome = ok and up.status < 500
                return _DONE
            att.outcome = up.status < 500
            await self._answer_whole(ex, att, up, resp_headers, data)
            return _DONE
        except (asyncio.CancelledError, ClientGone):
            att.outcome = None
            raise
        finally:
            att.lease.finish(att.outcome)

    async def _response(self, ex: Exchange, att: Attempt) -> tuple[Upstream, bytes, bytes | None] | Step:
        """Send ``ex`` on ``att`` and wait for what may still be retried: the head, the first
        body byte and, for a non-streamed answer, the whole body (the client has seen none of it).
        Returns ``(upstream, first bytes, whole body or None for a stream)``, or :data:`_RETRY` /
        :data:`_STOP` after recording the failure (:meth:`_failed`)."""
        h, settings = att.handle, self.settings
        wid = h.worker_id
        ex.mid_body = False
        up = None
        try:
            up = await self.transport.send(h.endpoint, ex.method, ex.target, ex.headers, ex.body, written=att.written,
                                           on_whole=self._whole_answer(ex, h.label_b), deadline=att.deadline)
            status = up.status
            if not 200 <= status <= 599:
                # an interim (1xx) or made-up status is no answer to relay: uvicorn cannot
                # write a status line above 599, and a client takes a 1xx for "more to come"
                att.outcome = False
                self._failed(ex, att, UpstreamError(f"worker {wid} answered with HTTP status {status}, which is "
                                                    "not a final status (200-599)", worker_id=wid), "status_5xx", up)
                return _STOP
            if status == CLIENT_CLOSED:  # to a client still here (else this task is cancelled): the engine dropped it
                att.outcome = False
                self._failed(ex, att, UpstreamError(f"worker {wid} answered 499 (client closed request) to a client "
                                                    "still connected: the engine dropped the request", worker_id=wid),
                             "engine_abort", up)
                if att.number + 1 < settings.max_attempts:
                    self.metrics.retries.labels("engine_abort").inc()
                    return _RETRY
                return _STOP
            if status < 500:
                att.lease.head_seen()  # liveness evidence for the health monitor
            if status in settings.retry_status and att.number + 1 < settings.max_attempts and \
                    self.scheduler.has_candidates(ex.info.model, ex.tried | {wid}):
                att.outcome = status < 500
                self._failed(ex, att, UpstreamError(f"worker {wid} answered {status}", worker_id=wid),
                             "status_5xx" if status >= 500 else None, up)
                self.metrics.retries.labels(f"status_{status}").inc()
                return _RETRY
            if status >= 500:  # relayed as answered (no retry left, or not a retried status): still the worker's error
                self.metrics.errors.labels(att.handle.label, "status_5xx").inc()
            # the first body byte, within the first-byte deadline, before anything reaches the client
            first = up.whole if up.whole is not None else await up.first_chunk()
            # the rest of a non-streamed body: the client has seen none of it (a non-streamed answer
            # reaches it whole), so a failure here is before the first byte too (a body taken whole: nothing to read)
            ex.mid_body = not up.is_stream
            data = None if up.is_stream else first if up.whole is not None else await up.read(first)
            if not self.director.aborted_before_content(first if data is None else data, up.is_stream):
                return up, first, data
            att.outcome = False   # the engine aborted it before anything reached the client: another worker's turn
            self._failed(ex, att, self.director.abort_error(wid), None, up)
            if att.number + 1 < settings.max_attempts and self.scheduler.has_candidates(ex.info.model, ex.tried):
                self.metrics.retries.labels("engine_abort").inc()
                return _RETRY
            return _STOP
        except asyncio.CancelledError:
            if up is not None:   # the client left before the first byte (queued at the engine): abort it there
                up.release(abort=True)
            raise
        except TransportError as e:
            att.outcome = False
            if up is None and e.refused:  # down for sure: out now, not after max_failures probes (a probe brings it back)
                att.lease.refused()
            self._failed(ex, att, e, e.kind, up)
            ex.broken += breaks(e)
            if retryable(e, ex.broken, settings.retry_on_timeout, settings.retry_on_disconnect):
                self.metrics.retries.labels(e.kind).inc()
                return _RETRY
            return _STOP

    def _whole_answer(self, ex: Exchange, wid_b: bytes) -> Callable[[Upstream], bool] | None:
        """The ``on_whole`` hook of :meth:`Transport.send` where the router's protocol serves the
        request (else None): a whole non-streamed answer that needs no retry leaves from the
        engine connection's callback, in one write (the task does the bookkeeping after)."""
        scope = ex.scope
        if scope is None:
            return None
        retry_status, rid, aborted = self.settings.retry_status, ex.rid, self.director.aborted_anywhere

        def answer(u: Upstream) -> bool:
            st = u.status
            if not 200 <= st <= 599 or st in retry_status or st == CLIENT_CLOSED or u.whole is None \
                    or aborted(u.whole, u.is_stream):
                return False
            return write_response(scope, st, relayed_headers(u, rid, wid_b), u.whole)
        return answer

    async def _answer_whole(self, ex: Exchange, att: Attempt, up: Upstream, headers: list[tuple[bytes, bytes]],
                            data: bytes) -> None:
        """Answer ``ex`` with ``up``'s whole non-streamed body ``data``: one write of head and body
        where the router's protocol serves the request (already done from the engine connection's
        callback when ``up.answered``), else two ASGI messages; then count it and log it."""
        status = up.status
        if not up.answered and (ex.scope is None or not write_response(ex.scope, status, headers, data)):
            headers.append((b"content-length", b"%d" % len(data)))
            await ex.send({"type": "http.response.start", "status": status, "headers": headers})
            await ex.send({"type": "http.response.body", "body": data, "more_body": False})
        self.settle_whole(ex, att, status, data)

    def settle_whole(self, ex: Exchange, att: Attempt, status: int, data: bytes) -> None:
        """Count and log ``ex``'s whole answer ``data`` (``status``), written to its client from ``att``."""
        prompt_n, out_n = self.director.answer(att.lease, data)
        self.director.finished(att.handle.label, status, ex.route, ex.t0, ex.rid, ex.method, ex.info.path, ex.info.model,
                               None, prompt_n, out_n, att.number + 1,
                               None if status < 500 else f"the engine answered {status}", queue_s=ex.info.queued_s)
