"""The forwarding hot path, as a raw ASGI handler (no FastAPI dependency machinery per request).

For ``POST /v1/chat/completions``, ``/v1/completions``, ``/generate`` and other ``POST /v1/*``:

1. check the API key (when configured) and the body size (413 above ``max_body_bytes``);
2. read the body once and parse only what routing needs (:mod:`router.protocol`); 400 if malformed,
   404 if no slot of this router ever served the named model (a known model whose workers are
   all out is a 503 at step 3);
3. pick a worker through the scheduling pipeline (:meth:`~router.scheduling.Scheduler.admit`);
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
   death must not take the fleet down; ``dplb_router_query_of_death_total``). A timeout is
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
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from router.access_log import AccessLog
from router.config import Config
from router.errors import (
    BadRequest,
    BodyTooLarge,
    GatewayTimeout,
    NoEligibleWorker,
    NotFound,
    RouterError,
    TransportError,
    Unauthorized,
    UnsupportedMediaType,
    UpstreamError,
    sse_error_event,
)
from router.metrics import Metrics
from router.policies.base import RequestInfo
from router.protocol import HOP_BY_HOP, parse_request
from router.scheduling import Lease, Scheduler
from router.server import (
    ChunkedWriter,
    ClientGone,
    chunked_writer,
    start_chunked,
    watch_disconnect,
    write_response,
)
from router.stream_meter import (
    StreamMeter,
    is_event_stream,
    on_answer,
    on_first_content,
    on_stream_end,
)
from router.transport import Transport, Upstream

log = logging.getLogger("dplb.router.proxy")

_XRID = b"x-request-id"
_XWID = b"x-dplb-worker-id"
_JSON = (b"content-type", b"application/json")
_NONE = b"none"
ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings"})
#: a request whose connection broke on this many workers after they read it, before any byte
#: reached the client, is answered 502 and not tried again (a query of death: each try crashed an engine)
BROKEN_ENGINES_LIMIT = 2
#: the status a request the client left before its answer is counted with (nginx's 499, "client
#: closed request"; never sent: nobody is there to read it)
CLIENT_CLOSED = 499

Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


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


async def send_json(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None,
                    worker: bytes = _NONE) -> None:
    """Send a complete JSON response (router-made: ``X-DPLB-Worker-ID: none`` unless given)."""
    hs = [_JSON, (b"content-length", str(len(body)).encode()), (_XWID, worker)]
    if headers:
        hs.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": hs})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, e: RouterError, request_id: bytes | None = None, worker: bytes = _NONE) -> None:
    """Render a RouterError at the edge (status, OpenAI body, its headers, request id;
    ``worker``: the ``X-DPLB-Worker-ID`` of the worker the error is about, ``none`` otherwise)."""
    hs = [(k.encode(), v.encode()) for k, v in e.headers.items()]
    if request_id:
        hs.append((_XRID, request_id))
    await send_json(send, e.status, e.body(), hs, worker)


def relayed_headers(up: Upstream, rid: bytes, wid_b: bytes) -> list[tuple[bytes, bytes]]:
    """The headers a client gets with ``up``'s answer (a new list): the engine's, plus
    ``X-Request-Id: rid`` when the engine sent none, plus ``X-DPLB-Worker-ID: wid_b``."""
    if up.request_id is not None:
        return [*up.headers, (_XWID, wid_b)]
    return [*up.headers, (_XRID, rid), (_XWID, wid_b)]


_UNSAFE_IN_TARGET = frozenset(b" \r\n\x00")


def request_target(scope: MutableMapping[str, Any]) -> str:
    """The request target to forward to the engine: the path as the client sent it (``raw_path``,
    still percent-encoded) and its query string. Forwarding the decoded ``path`` instead would
    turn a client's ``%0d%0a`` into a line break of the engine's request line, i.e. headers or a
    whole request of the client's choosing. Raises BadRequest when the target holds a space, CR,
    LF or NUL (a server other than the router's own may hand over what httptools refuses)."""
    raw = scope.get("raw_path")
    if raw is None:
        raw = urllib.parse.quote(scope["path"]).encode("latin-1")
    qs = scope.get("query_string")
    target = raw + b"?" + qs if qs else raw
    if not _UNSAFE_IN_TARGET.isdisjoint(target):
        raise BadRequest("the request target holds a space, CR, LF or NUL")
    return target.decode("latin-1")


async def read_body(receive: Receive, limit: int, declared: int | None) -> bytes:
    """Read the whole request body; BodyTooLarge beyond ``limit`` bytes (checked on the declared
    Content-Length first, then while reading)."""
    if declared is not None and declared > limit:
        raise BodyTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    msg = await receive()
    body = msg.get("body", b"")
    if len(body) > limit:   # a chunked body (no Content-Length) that came in whole
        raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
    if not msg.get("more_body", False):
        return body
    parts = [body]
    size = len(body)
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            raise asyncio.CancelledError()  # client left while sending
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)


def delivered(meter: StreamMeter, writer: ChunkedWriter | None) -> bool:
    """Did the client of a stream relayed through ``writer`` get its whole answer: the body's
    terminating chunk written (by the writer or its native relay), or, for an event stream, a last
    event written that is ``data: [DONE]`` (OpenAI's end of stream; the official sync ``openai``
    client closes its connection there, before the engine's terminating chunk follows)? The meter
    has seen exactly what was written to the client (the sink feeds it only while the client is
    there, the native relay meters what it wrote). False without a writer (behind another ASGI
    server ``send`` does not say what reached the client)."""
    if writer is None:
        return False
    return writer.body_ended() or meter.ended_with_done()


class Proxy:
    """ASGI callable for the proxied paths. Collaborators: the :class:`Scheduler` (eligibility,
    policy, breaker admission, leases), the :class:`Transport` (forwarding to engines), the
    :class:`Metrics` and the :class:`ProxySettings`. It decides nothing about health: each
    attempt's outcome goes to its lease (``head_seen``, ``refused``, ``finish(ok)``)."""

    def __init__(self, scheduler: Scheduler, transport: Transport, metrics: Metrics, settings: ProxySettings) -> None:
        self.scheduler = scheduler
        self.transport = transport
        self.metrics = metrics
        self.settings = settings
        self.access = AccessLog(settings.access_log)
        # minted request ids: a random per-process prefix + a counter (one urandom call per process)
        self._prefix = uuid.uuid4().hex[:16].encode()
        self._n = 0

    def _head(self, scope: MutableMapping[str, Any]) -> tuple[bytes, int | None, bytes | None, bytes | None,
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
            self._n += 1
            rid = b"%s%08x" % (self._prefix, self._n)
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

    def request_info(self, path: str, body: bytes, session: bytes | None) -> RequestInfo:
        """Parse ``body`` (:func:`router.protocol.parse_request`) and check its model against the
        known ones (:meth:`Scheduler.models`). Raises BadRequest (malformed; no model named where
        several are known) or NotFound (a model no slot of this router ever served; a known one
        whose workers are all out is a 503, raised by the pipeline)."""
        info = parse_request(path, body, self.settings.needs_text)
        if session:
            info.session = session.decode("latin-1")
        sched = self.scheduler
        sched.registry.refresh_if_changed()
        if info.model is None and len(sched.models()) > 1:
            raise BadRequest(f"name the model: this endpoint serves {', '.join(sched.models())}",
                             param="model")
        if not sched.knows_model(info.model):
            raise NotFound(f"the model '{info.model}' does not exist (served: {sched.served()})", param="model")
        return info

    def _dispatch(self, info: RequestInfo, tried: set[int], method: str, target: str,
                  headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[Any, Lease, Any]:
        """Choose a worker (:meth:`Scheduler.admit`), write the request to it when an idle pooled
        connection is at hand, then take the lease: ``(worker handle, lease, written connection
        or None)``. The lease is written while the engine already reads the request, with no
        await in between, so this process's next decision still sees the load. Raises
        NoEligibleWorker (nothing written then)."""
        sched = self.scheduler
        h, d = sched.admit(info, tried)
        written = self.transport.write_pooled(h.endpoint, method, target, headers, body)
        try:
            lease = sched.lease(h, d, info)
        except BaseException:
            if written is not None:
                written.transport.close()
            raise
        return h, lease, written

    def start(self, scope: MutableMapping[str, Any], body: bytes) -> Callable[..., Awaitable[None]] | None:
        """Start a request whose whole ``body`` came in with its head, without a task: check, parse,
        choose and write it to its worker now, from the router's protocol callback
        (:class:`router.server.LimitedHttpToolsProtocol`), before the event loop turns. Returns
        the ASGI callable that serves the rest (the answer, retries, bookkeeping), to be run as
        the request's task; None when the request is not a plain success so far (an error to
        answer, no eligible worker, a body above the limit): then nothing was sent or recorded
        and the caller serves the request through :meth:`__call__`, which answers the error."""
        t0 = time.perf_counter()
        try:
            rid, _declared, auth, ctype, fwd, session, upgrade = self._head(scope)
            self._check(auth, ctype, upgrade)
            if len(body) > self.settings.max_body_bytes:
                return None
            path = scope["path"]
            info = self.request_info(path, body, session)
            target = request_target(scope)
            method = scope["method"]
            pre = self._dispatch(info, set(), method, target, fwd, body)
        except RouterError:
            return None
        route = path if path in ROUTES else "/v1/other"

        async def rest(scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
            # (run as the request's task in the same turn of the event loop; nothing cancels a task
            # before its first step but the loop's own shutdown)
            await self._serve(scope, receive, send, method, route, target, fwd, body, info, rid, t0, pre)

        return rest

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        rid, declared, auth, ctype, fwd, session, upgrade = self._head(scope)
        path = scope["path"]
        route = path if path in ROUTES else "/v1/other"  # bounded metric label
        try:
            self._check(auth, ctype, upgrade)
            body = await read_body(receive, self.settings.max_body_bytes, declared)
            info = self.request_info(path, body, session)
            target = request_target(scope)
        except RouterError as e:
            await send_error(send, e, rid)
            dt = time.perf_counter() - t0
            self.metrics.observe_request("none", e.status, route, dt)
            self.access.emit(rid, scope["method"], path, None, "none", e.status, dt, attempts=0, cause=e.message)
            return
        except asyncio.CancelledError:   # the client left while sending its body
            dt = time.perf_counter() - t0
            self.metrics.observe_request("none", CLIENT_CLOSED, route, dt)
            self.access.emit(rid, scope["method"], path, None, "none", CLIENT_CLOSED, dt, attempts=0)
            return
        await self._serve(scope, receive, send, scope["method"], route, target, fwd, body, info, rid, t0, None)

    async def _serve(self, scope: MutableMapping[str, Any], receive: Receive, send: Send, method: str, route: str,
                     target: str, fwd: list[tuple[bytes, bytes]], body: bytes, info: RequestInfo, rid: bytes,
                     t0: float, pre: tuple[Any, Lease, Any] | None) -> None:
        """Watch for the client leaving, then :meth:`forward` (``pre``: the first attempt, already
        dispatched by :meth:`start`)."""
        task = asyncio.current_task()
        gone = False

        def on_gone() -> None:
            nonlocal gone
            if task is not None and not task.done():
                gone = True
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
            await self.forward(method, route, target, fwd, body, info, rid, send, t0, scope, pre)
        except asyncio.CancelledError:
            if not gone:
                raise
        except OSError:
            # ClientGone from a piped stream, or uvicorn's send once the client socket is gone (upstream
            # errors arrive wrapped as TransportError); the lease and the upstream connection were
            # released on the way out
            pass
        finally:
            if watch is not None:
                watch.remove_done_callback(on_message)
                watch.cancel()
            elif unwatch is not None:
                unwatch()

    def retryable(self, e: TransportError, broken: int) -> bool:
        """May a request whose attempt failed with ``e`` before its first byte reached the client go
        to another worker? ``broken``: how many workers' connections it broke after they read it,
        this attempt's included (:meth:`breaks`). Never read by the worker (refused, reset before
        reading): always; a timeout: only with ``retries.retry_on_timeout``; a connection that
        broke after the worker read the request (the engine exited or reset it): with
        ``retries.retry_on_disconnect`` (the default) while fewer than
        :data:`BROKEN_ENGINES_LIMIT` broke."""
        if e.kind == "timeout":
            return self.settings.retry_on_timeout
        if e.kind == "connect" and (e.refused or e.unsent):
            return True
        return self.settings.retry_on_disconnect and broken < BROKEN_ENGINES_LIMIT

    @staticmethod
    def breaks(e: TransportError) -> bool:
        """Did ``e`` break a worker's connection after the worker read the request (not refused, not
        unread, not a timeout)? Such a request may have crashed its engine."""
        return e.kind != "timeout" and not (e.kind == "connect" and (e.refused or e.unsent))

    def final_error(self, e: Exception | None, wid: int | None, tried: int, mid_body: bool = False,
                    broken: int = 0, no_worker: NoEligibleWorker | None = None) -> RouterError:
        """The error a client gets when no attempt succeeded. ``e``: the last attempt's failure, on
        worker ``wid``; ``tried``: the workers tried; ``mid_body``: a non-streamed body stalled or
        broke after its first byte; ``broken``: the workers whose connection it broke after they
        read it; ``no_worker``: the pipeline found no worker for another attempt.

        504 after a timeout; 502 when the request broke :data:`BROKEN_ENGINES_LIMIT` workers (a
        query of death) or failed in a way that is not retried; otherwise no worker was left to
        take it, or every one tried refused it: 503 + Retry-After (:class:`NoEligibleWorker`)."""
        if isinstance(e, TransportError) and e.kind == "timeout" and mid_body:
            return GatewayTimeout(f"worker {wid} stalled mid-response: no data within the idle timeout "
                                  f"(router.idle_timeout_s={self.settings.idle_timeout_s:g})", worker_id=wid)
        if isinstance(e, TransportError) and e.kind == "timeout":
            return GatewayTimeout(f"worker {wid} sent no response within the first-byte timeout "
                                  f"(router.first_byte_timeout_s={self.settings.first_byte_timeout_s:g}); a timed-out "
                                  "request is not retried on another worker (retries.retry_on_timeout)",
                                  worker_id=wid)
        if broken >= BROKEN_ENGINES_LIMIT:
            return UpstreamError(f"the request broke the connection of {broken} workers after they read it, before "
                                 f"the first byte (last: worker {wid}: {e}); it is not tried again: a request that "
                                 "crashes engines would crash the next one", worker_id=wid)
        if no_worker is not None or (isinstance(e, TransportError) and (e.refused or e.unsent)):
            why = no_worker.message if no_worker is not None else "no worker can take the request now"
            return NoEligibleWorker(f"{why}; {tried} worker(s) tried failed before the first byte (last: worker "
                                    f"{wid}: {e})", reason="all_failed")
        if tried > 1:
            return UpstreamError(f"all {tried} worker(s) tried failed before the first byte: {e}", worker_id=wid)
        return UpstreamError(f"worker {wid} failed before the first byte: {e}", worker_id=wid)

    async def forward(self, method: str, route: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes,
                      info: RequestInfo, rid: bytes, send: Send, t0: float,
                      scope: MutableMapping[str, Any] | None = None, pre: tuple[Any, Lease, Any] | None = None) -> None:
        """Choose, send, retry what may be retried, relay (module docstring, steps 3-7). Never
        raises RouterError to the caller; a client that left is counted (status 499) and its
        CancelledError / ClientGone re-raised. ``scope``: the request's ASGI scope (lets a stream's
        chunks bypass ``send``, :func:`router.server.chunked_writer`); ``pre``: the first attempt
        when :meth:`start` dispatched it already (:meth:`_dispatch`'s result)."""
        sched = self.scheduler
        metrics = self.metrics
        retry_status = self.settings.retry_status
        tried: set[int] = set()
        last: Exception | None = None
        last_wid: int | None = None
        mid_body = False
        broken = 0      # workers whose connection this request broke after they read it
        no_worker: NoEligibleWorker | None = None
        label = "none"  # the worker of the current attempt (metric label)
        try:
            for attempt in range(self.settings.max_attempts):
                if attempt:
                    delay = min(self.settings.backoff_max_s, self.settings.backoff_base_s * (2 ** (attempt - 1))) \
                        * random.uniform(0.5, 1.5)
                    if delay > 0:
                        await asyncio.sleep(delay)
                if pre is not None:
                    h, lease, written = pre
                    pre = None
                else:
                    try:
                        h, lease, written = self._dispatch(info, tried, method, target, headers, body)
                    except NoEligibleWorker as e:
                        if last is None:
                            await send_error(send, e, rid)
                            dt = time.perf_counter() - t0
                            metrics.observe_request("none", e.status, route, dt)
                            self.access.emit(rid, method, info.path, info.model, "none", e.status, dt, None,
                                             info.prompt_len, None, attempt, e.message)
                            return
                        no_worker = e
                        break
                wid = h.worker_id
                wid_b = h.label_b
                label = h.label
                mid_body = False
                outcome: bool | None = None  # breaker outcome of this attempt; None = no verdict (client left)
                answer = None
                if scope is not None:
                    def answer(u: Upstream, wid_b: bytes = wid_b) -> bool:
                        # a whole non-streamed answer that needs no retry leaves from the engine
                        # connection's callback, in one write (the task does the bookkeeping after)
                        st = u.status
                        if not 200 <= st <= 599 or st in retry_status or u.whole is None:
                            return False
                        return write_response(scope, st, relayed_headers(u, rid, wid_b), u.whole)
                up = None
                try:
                    try:
                        up = await self.transport.send(h.endpoint, method, target, headers, body, written=written,
                                                       on_whole=answer)
                        status = up.status
                        if not 200 <= status <= 599:
                            # an interim (1xx) or made-up status is no answer to relay: uvicorn cannot
                            # write a status line above 599, and a client takes a 1xx for "more to come"
                            outcome = False
                            up.release(abort=True)
                            metrics.errors.labels(label, "status_5xx").inc()
                            last, last_wid = UpstreamError(f"worker {wid} answered with HTTP status {status}, which "
                                                           "is not a final status (200-599)", worker_id=wid), wid
                            tried.add(wid)
                            break
                        if status < 500:
                            lease.head_seen()  # liveness evidence for the health monitor
                        if status in self.settings.retry_status and attempt + 1 < self.settings.max_attempts and \
                                sched.has_candidates(info.model, tried | {wid}):
                            outcome = status < 500
                            up.release(abort=True)
                            if status >= 500:
                                metrics.errors.labels(label, "status_5xx").inc()
                            last, last_wid = UpstreamError(f"worker {wid} answered {status}", worker_id=wid), wid
                            tried.add(wid)
                            metrics.retries.labels(f"status_{status}").inc()
                            continue
                        # the first body byte, within the first-byte deadline, before anything reaches the client
                        first = up.whole if up.whole is not None else await up.first_chunk()
                        if not up.is_stream:
                            # the rest of the body: the client has seen none of it yet either (a
                            # non-streamed answer reaches it whole), so a failure here is one before
                            # the first byte too (a whole body taken in the callback: nothing to read)
                            mid_body = True
                            data = first if up.whole is not None else await up.read(first)
                    except TransportError as e:
                        outcome = False
                        if up is None:
                            if e.refused:  # down for sure: out now, not after max_failures probes (a probe brings it back)
                                lease.refused()
                        else:
                            up.release(abort=True)
                        metrics.errors.labels(label, e.kind).inc()
                        last, last_wid = e, wid
                        tried.add(wid)
                        broken += self.breaks(e)
                        if self.retryable(e, broken):
                            metrics.retries.labels(e.kind).inc()
                            continue
                        break
                    resp_headers = relayed_headers(up, rid, wid_b)
                    if not up.is_stream:
                        outcome = status < 500
                        # one write of head and body where the router's protocol serves the request
                        # (already done from the engine connection's callback when ``up.answered``)
                        if not up.answered and (scope is None or not write_response(scope, status, resp_headers, data)):
                            resp_headers.append((b"content-length", b"%d" % len(data)))
                            await send({"type": "http.response.start", "status": status, "headers": resp_headers})
                            await send({"type": "http.response.body", "body": data, "more_body": False})
                        prompt_n, out_n = on_answer(metrics, lease, data)
                        dt = time.perf_counter() - t0
                        metrics.observe_request(label, status, route, dt)
                        self.access.emit(rid, method, info.path, info.model, label, status, dt, None, prompt_n, out_n,
                                         attempt + 1, None if status < 500 else f"the engine answered {status}")
                        return
                    ok = await self.relay_stream(up, first, status, resp_headers, send, route, t0, wid, lease, scope,
                                                 (rid, method, info, attempt + 1))
                    outcome = ok and status < 500
                    return
                except (asyncio.CancelledError, ClientGone):
                    outcome = None
                    raise
                finally:
                    lease.finish(outcome)
        except (asyncio.CancelledError, ClientGone) as e:
            # the client left before its answer was complete (see relay_stream for one that had it all)
            metrics.errors.labels(label, "client_disconnect").inc()
            dt = time.perf_counter() - t0
            metrics.observe_request(label, CLIENT_CLOSED, route, dt)
            meter, ttft = getattr(e, "dplb_stream", (None, ()))   # a stream cut: the tokens it was sent
            self.access.emit(rid, method, info.path, info.model, label, CLIENT_CLOSED, dt, ttft[0] if ttft else None,
                             info.prompt_len, None if meter is None else meter.output_tokens(), len(tried) + 1)
            raise
        err = self.final_error(last, last_wid, len(tried), mid_body, broken, no_worker)
        if broken >= BROKEN_ENGINES_LIMIT and err.status == 502:
            metrics.query_of_death.inc()
            log.warning("request %s broke the connection of %d workers (last: worker %s); answered 502, not tried "
                        "again", rid.decode("latin-1"), broken, last_wid)
        wb = str(last_wid).encode() if last_wid is not None and err.status != 503 else _NONE
        await send_error(send, err, rid, wb)
        dt = time.perf_counter() - t0
        metrics.observe_request(wb.decode(), err.status, route, dt)
        self.access.emit(rid, method, info.path, info.model, wb.decode(), err.status, dt, None, info.prompt_len, None,
                         len(tried), err.message)

    async def relay_stream(self, up: Upstream, first: bytes, status: int, headers: list[tuple[bytes, bytes]],
                           send: Send, route: str, t0: float, wid: int, lease: Lease | None = None,
                           scope: MutableMapping[str, Any] | None = None,
                           access: tuple[bytes, str, RequestInfo, int] | None = None) -> bool:
        """Relay a streamed body chunk by chunk, starting with ``first`` (already read); a broken or
        stalled upstream ends with an SSE error event. The first chunk that carries content
        (:mod:`router.stream_meter`) is the TTFT and ends the request's prefill in the lease's
        accounting. Returns False when the stream broke (a breaker failure).

        When the router's own uvicorn protocol serves the request (``scope``), the head leaves
        with the first chunk in one write (:func:`router.server.start_chunked`), the chunks after
        it are written to the client from the upstream connection's callback
        (:meth:`Upstream.pipe` into :class:`router.server.ChunkedWriter`): no ASGI message and no
        task wake-up per chunk, and the last one carries the body's end. Otherwise each chunk goes
        through ``send``. ``access``: ``(request id, method, request info, attempts)`` for its
        access-log line."""
        metrics = self.metrics
        meter = StreamMeter(is_event_stream(headers))
        ttft: list[float] = []   # the TTFT once seen (set from the connection's callback too)
        if first and meter.feed(first):
            ttft.append(on_first_content(metrics, route, t0, lease))
        writer = start_chunked(scope, status, headers, first, up.complete()) if scope is not None else None
        if writer is None:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            if first:
                await send({"type": "http.response.body", "body": first, "more_body": True})
                writer = chunked_writer(scope) if scope is not None else None
        ok = True
        complete = False
        final = status
        last = b""
        cause = None
        tokens: tuple[int, int] | None = None
        try:
            if first:
                if writer is not None:
                    write = writer.write
                    relays = []

                    def sink(chunk: bytes) -> bool:
                        # the body's last bytes carry its end (one write, not two); the meter sees
                        # what the client was written, nothing after it left (see delivered)
                        sent = write(chunk, up.complete())
                        if (sent or not writer.gone) and meter.feed(chunk):
                            ttft.append(on_first_content(metrics, route, t0, lease))
                        return sent

                    def handoff() -> Any:
                        # after the first content the meter only counts events and keeps the
                        # tail, which the native relay does as it writes
                        if not meter.first_seen:
                            return None
                        r = writer.native_relay(meter.carry)
                        relays.append(r)
                        return r

                    try:
                        await up.pipe(sink, writer.drain, handoff)
                    finally:
                        for r in relays:
                            meter.absorb(r.events, r.tail(), r.last_byte())
                else:
                    async for chunk in up.chunks():
                        if meter.feed(chunk):
                            ttft.append(on_first_content(metrics, route, t0, lease))
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            complete = True
        except (asyncio.CancelledError, ClientGone) as e:
            if not delivered(meter, writer):
                e.dplb_stream = (meter, ttft)  # type: ignore[union-attr]  # what reached it, for the 499 line
                raise
            # the client had the whole answer when it left: a complete stream, not a disconnect
            complete = True
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()
        except TransportError as e:
            ok = False
            if e.kind == "timeout":
                final = 504
                metrics.errors.labels(str(wid), "timeout").inc()
                cause = (f"worker {wid} stream stalled: no data within the idle timeout "
                         f"(router.idle_timeout_s={self.settings.idle_timeout_s:g})")
                ev = sse_error_event(cause, "timeout_error", 504)
            else:
                final = 502
                metrics.errors.labels(str(wid), "stream_broken").inc()
                cause = f"worker {wid} stream broke: {e.kind}"
                ev = sse_error_event(cause, "upstream_error", 502)
            last = ev
        finally:
            up.release(abort=not complete)
            tokens = on_stream_end(metrics, meter, lease, complete)
        if writer is not None:
            await writer.finish(last)
        else:
            if last:
                await send({"type": "http.response.body", "more_body": True, "body": last})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        dt = time.perf_counter() - t0
        metrics.observe_request(str(wid), final, route, dt)
        if access is not None:
            rid, method, info, attempts = access
            self.access.emit(rid, method, info.path, info.model, str(wid), final, dt, ttft[0] if ttft else None,
                             None if tokens is None else tokens[0], None if tokens is None else tokens[1], attempts,
                             cause or (None if final < 500 else f"the engine answered {final}"))
        return ok
