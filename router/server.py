"""Request-head limits of the router: an exact ASGI check and a protocol guard for memory.

uvicorn's httptools protocol has no bound on a request head (``h11_max_incomplete_event_size``
applies to h11 only), and the httptools binding accumulates a header's name and value until the
header ends: one unfinished 64 MB header costs the router 64 MB. Two layers bound it:

1. :func:`check_headers` (called first thing by :class:`router.app.DPLBApp`, before any body
   byte is read): the total size of the header names and values must not exceed
   ``router.max_header_bytes`` and their count ``router.max_headers``; otherwise 431 Request
   Header Fields Too Large (RFC 6585 §5) with an OpenAI-shaped body.
2. :class:`LimitedHttpToolsProtocol` (uvicorn's ``http=``): while a request head is incomplete,
   the raw bytes it has taken are counted (every chunk after which the head is still incomplete
   is head bytes); past :func:`raw_head_limit` (twice ``max_header_bytes`` plus 16 KiB for the
   request line) it answers the same 431 itself and closes the connection. Memory per connection
   stays bounded by that limit plus one read, whatever a client sends.

The protocol also lends the proxy a way around the ASGI ``send`` for a streamed response
(:func:`start_chunked`, :func:`chunked_writer`): the head goes out with the stream's first chunk in
one write, each later chunk an engine sends is written to the client's transport from the upstream
connection's callback, framed as uvicorn frames it, instead of one ASGI message and one task
wake-up per chunk (``bench/results/router_profile.md``), and :meth:`ChunkedWriter.finish` ends the
body with the bookkeeping uvicorn's ``send`` does at a response's end (keep-alive, the next
pipelined request).

It also starts a request without waiting for a task when it can: a ``POST`` whose whole body came
in the same read as its head is handed to the app's ``start_request(scope, body)`` at the end of
that read (:meth:`LimitedHttpToolsProtocol._start_deferred`); the router's app writes it to its
worker from there and returns what the request's task then runs (``router.app.DPLBApp``). Only
the first request of a turn of the event loop is started that way: when several are ready at once
(a busy router), the others run from their tasks as a batch, which costs less CPU per request than
starting each from its read (about 12 % less at saturation, ``bench/results/router_profile.md``
section 9). A body still arriving, a pipelined request (started when the answer before it is
out) and any request the app declines go the usual way too: a task running the app.

A request head HTTP/1.1's parser refuses (a Content-Length with chunked framing, two
Content-Lengths, an obs-fold, a bare LF, an unknown version, ...) is answered 400 with the OpenAI
error body naming the parser's reason (:meth:`LimitedHttpToolsProtocol.send_400_response`, in place
of uvicorn's plain text), and the connection closed; nothing of it reaches the app.

The protocol reads its limits from ``$DPLB_ROUTER_MAX_HEADER_BYTES`` / ``$DPLB_ROUTER_MAX_HEADERS``
(set by ``router.__main__`` before uvicorn starts, so every ``--workers`` process sees them).
"""
from __future__ import annotations

import asyncio
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from dplb_protocol.wire import WORKER_HEADER_B, error_body
from router._relay import ChunkRelay
from router.asgi import ASGIApp, Scope
from router.connection import running_loop
from router.errors import HeadersTooLarge
from router.logtext import text

ENV_BYTES = "DPLB_ROUTER_MAX_HEADER_BYTES"
ENV_COUNT = "DPLB_ROUTER_MAX_HEADERS"
DEFAULT_MAX_HEADER_BYTES = 32 * 1024
DEFAULT_MAX_HEADERS = 100
REQUEST_LINE_ALLOWANCE = 16 * 1024


def raw_head_limit(max_header_bytes: int) -> int:
    """Raw bytes an incomplete request head may take before the protocol refuses it: the header
    limit twice over (the exact check is the ASGI one) plus 16 KiB for the request line."""
    return 2 * max_header_bytes + REQUEST_LINE_ALLOWANCE


def check_headers(headers: list[tuple[bytes, bytes]], max_bytes: int, max_count: int) -> None:
    """Raise :class:`HeadersTooLarge` (431) when ``headers`` (ASGI ``scope["headers"]``) hold more
    than ``max_count`` fields or more than ``max_bytes`` bytes of names plus values."""
    if len(headers) > max_count:
        raise HeadersTooLarge(f"the request has {len(headers)} header fields; the limit is {max_count} "
                              "(router.max_headers)")
    total = 0
    for k, v in headers:
        total += len(k) + len(v)
    if total > max_bytes:
        raise HeadersTooLarge(f"the request headers hold {total} bytes; the limit is {max_bytes} "
                              "(router.max_header_bytes)")


def _431(message: str) -> bytes:
    body = error_body(message, HeadersTooLarge.type, 431)
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n" +
            WORKER_HEADER_B + b": none\r\n\r\n" + body)


#: the ``scope["extensions"]`` keys under which the protocol puts the request's uvicorn cycle (a
#: weak reference: the cycle holds the scope, so a strong one made each request a reference cycle,
#: ten objects per request left to the cyclic collector, a young-generation pass every ~60
#: requests) and itself
CYCLE_KEY = "dplb.uvicorn_cycle"
PROTOCOL_KEY = "dplb.protocol"


# Any: uvicorn's RequestResponseCycle (or None), read across uvicorn versions
def _cycle_in(ext: Any) -> Any:  # type: ignore[explicit-any]
    """The uvicorn cycle the protocol put in ``ext`` (a scope's ``extensions``, may be None), or
    None (none put there, or the request's task is over)."""
    ref = ext.get(CYCLE_KEY) if ext else None
    return ref() if ref is not None else None


class ClientGone(ConnectionResetError):
    """The client's connection closed while the router was writing its response."""


class ChunkedWriter:
    """Writes body chunks of a started chunked response straight to the client's transport (one
    HTTP/1.1 chunk per call, the framing uvicorn's ``send`` would write), and ends the response
    (:meth:`finish`). Made by :func:`start_chunked` or :func:`chunked_writer`; once there is one,
    nothing more of the response goes through ``send``."""

    __slots__ = ("_cycle", "_flow", "_relay", "_write", "ended")

    # Any: uvicorn's RequestResponseCycle, read across uvicorn versions (AttributeError guarded)
    def __init__(self, cycle: Any) -> None:  # type: ignore[explicit-any]
        self._cycle = cycle
        self._flow = cycle.flow
        self._write = cycle.transport.write
        self._relay: ChunkRelay | None = None
        #: the terminating chunk was written (by :meth:`write` with ``end``, or by the native relay)
        self.ended = False

    def write(self, data: bytes, end: bool = False) -> bool:
        """Write ``data`` (non-empty) as one chunk (``end``: the body's last, followed by the
        terminating chunk in the same write); False when the client's transport is above its
        high-water mark (call :meth:`drain` before writing more) or the client left (nothing is
        written then). Nothing is written after the end (a confused engine's bytes past its body)."""
        if self._cycle.disconnected:
            return False
        if self.ended:
            return True
        if end:
            self.ended = True
            self._write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        else:
            self._write(b"%x\r\n%s\r\n" % (len(data), data))
        return not self._flow.write_paused

    @property
    def gone(self) -> bool:
        """The client's connection closed (nothing is written to it any more)."""
        return bool(self._cycle.disconnected)

    def body_ended(self) -> bool:
        """The body's terminating chunk was written to the client (by :meth:`write` with ``end``,
        :func:`start_chunked`, :meth:`finish` or the native relay): the client has the whole body."""
        r = self._relay
        return self.ended or (r is not None and r.ended)

    def native_relay(self, carry: bytes = b"", before: bytes = b"") -> ChunkRelay:
        """A :class:`router._relay.ChunkRelay` writing to this client (``carry``: the stream
        meter's last byte; ``before``: the last bytes it relayed before, see the relay's
        docstring). It writes the terminating chunk with the body's last bytes; :meth:`finish`
        then writes none."""
        r = self._relay = ChunkRelay(self._write, self._cycle, self._flow, carry, True, before)
        return r

    async def finish(self, last: bytes = b"") -> None:
        """End the response: ``last`` (an SSE error event, or b"") as a chunk and the terminating
        chunk in one write (none when :meth:`write` or the native relay wrote it already), then
        uvicorn's end-of-response bookkeeping, as its ``send`` of the final ``http.response.body``
        does it: waits while the client's transport is above its high-water mark, writes nothing
        once the client left, closes a connection that is not kept alive, starts the next
        pipelined request."""
        c = self._cycle
        if self._flow.write_paused and not c.disconnected:
            await self._flow.drain()
        if c.disconnected or c.response_complete:
            return
        r = self._relay
        if not self.ended and (r is None or not r.ended):
            self.ended = True
            self._write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n")
        c.response_complete = True
        c.message_event.set()
        if not c.keep_alive:
            c.transport.close()
        c.on_response()

    async def drain(self) -> None:
        """Until the client's transport can take more. Raises :class:`ClientGone` when the client
        left (before or while waiting)."""
        if self._flow.write_paused and not self._cycle.disconnected:
            await self._flow.drain()
        if self._cycle.disconnected:
            raise ClientGone("the client closed the connection")


def chunked_writer(scope: Scope) -> ChunkedWriter | None:
    """A :class:`ChunkedWriter` for the request of ``scope`` once its response head went out with
    chunked framing (uvicorn frames every response without a Content-Length that way); None
    otherwise (a response with a Content-Length, a server other than
    :class:`LimitedHttpToolsProtocol`, a cycle of another uvicorn version without these
    attributes): the caller then sends every chunk through ASGI."""
    cycle = _cycle_in(scope.get("extensions"))
    if cycle is None:
        return None
    try:
        if (not cycle.response_started or cycle.response_complete or cycle.chunked_encoding is not True
                or cycle.disconnected or cycle.scope is not scope):
            return None
        return ChunkedWriter(cycle)
    except AttributeError:
        return None


# Any: uvicorn's RequestResponseCycle, read across uvicorn versions (AttributeError guarded)
def _our_cycle(scope: Scope) -> Any:  # type: ignore[explicit-any]
    """The uvicorn cycle of ``scope``'s request when :class:`LimitedHttpToolsProtocol` serves it
    and no response started yet; else None."""
    cycle = _cycle_in(scope.get("extensions"))
    if cycle is None or cycle.scope is not scope or cycle.response_started:
        return None
    return cycle


# Any: uvicorn's RequestResponseCycle (read across versions) and the scope its helpers type HTTPScope
def _head(cycle: Any, scope: Any, status: int,  # type: ignore[explicit-any]
          headers: list[tuple[bytes, bytes]]) -> tuple[list[bytes], bool] | None:
    """The response head's pieces up to (not including) its framing header and the blank line,
    and whether the connection closes after the response; None for a status uvicorn has no status
    line for. Logs the access line as uvicorn's ``send`` does. ``headers`` are trusted (see
    :func:`write_response`)."""
    line = STATUS_LINE.get(status)
    if line is None:
        return None
    if cycle.access_log:
        cycle.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                 get_path_with_query_string(scope), scope["http_version"], status)
    content = [line]
    close = not cycle.keep_alive
    for name, value in (*cycle.default_headers, *headers):
        if name == b"connection" and b"close" in value.lower():
            close = True
        content += (name, b": ", value, b"\r\n")
    if close:
        cycle.keep_alive = False
        content.append(b"connection: close\r\n")
    return content, close


def start_chunked(scope: Scope, status: int, headers: list[tuple[bytes, bytes]],
                  first: bytes, end: bool = False) -> ChunkedWriter | None:
    """Start a chunked response to ``scope``'s request: the status line, ``headers``,
    ``Transfer-Encoding: chunked`` and ``first`` (the body's first chunk, b"" for none; ``end``:
    the whole body, then followed by the terminating chunk) in one write, with the bookkeeping
    uvicorn's ``send`` does for an ``http.response.start``. Returns the
    :class:`ChunkedWriter` for the rest of the body, which ends it with :meth:`ChunkedWriter.finish`.
    ``headers`` are trusted as in :func:`write_response` and must not hold a Transfer-Encoding.

    None when the caller must start the response through ASGI: not
    :class:`LimitedHttpToolsProtocol`'s request, a response already started, the client gone or
    its transport above its high-water mark (``send`` waits for it to drain), ``headers`` with a
    Content-Length (not chunked), a HEAD request or a 204/304 (no body), a status uvicorn has no
    line for, a cycle of another uvicorn version without these attributes."""
    try:
        cycle = _our_cycle(scope)
        if cycle is None or cycle.disconnected or cycle.flow.write_paused or scope["method"] == "HEAD" or \
                status in (204, 304) or any(k == b"content-length" for k, _ in headers):
            return None
        head = _head(cycle, scope, status, headers)
        if head is None:
            return None
        content = head[0]
        content.append(b"transfer-encoding: chunked\r\n\r\n")
        if first:
            content += (b"%x\r\n" % len(first), first, b"\r\n")
        if end:
            content.append(b"0\r\n\r\n")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = True
        cycle.expected_content_length = 0
        cycle.transport.write(b"".join(content))
        w = ChunkedWriter(cycle)
        w.ended = end
        return w
    except AttributeError:
        return None


def write_response(scope: Scope, status: int, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> bool:
    """Write a whole response (status line, ``headers``, a Content-Length and ``body``) to the
    client of ``scope``'s request in one write, with the bookkeeping uvicorn's ``send`` does for an
    ``http.response.start`` and a final ``http.response.body`` (keep-alive, the response's end, the
    next pipelined request). One write instead of two and no per-header checks: ``headers`` come
    from the engine's response as httptools parsed it (no CR, LF or NUL can be in them) and from
    the router's constants; they must not hold a Content-Length or Transfer-Encoding.

    Returns True when written (or when the client already left: nothing is written then, as
    uvicorn's ``send`` does); False when the caller must send the response through ASGI (not
    :class:`LimitedHttpToolsProtocol`'s request, a response already started, the client's
    transport above its high-water mark, which ``send`` waits out, a cycle of another uvicorn
    version without these attributes)."""
    try:
        cycle = _our_cycle(scope)
        if cycle is None:
            return False
        if cycle.disconnected:
            return True
        if cycle.flow.write_paused:
            # the client is not reading; uvicorn's send waits for it to drain before the head,
            # and so before the next pipelined request is started (memory stays bounded)
            return False
        head = _head(cycle, scope, status, headers)
        if head is None:
            return False
        content, close = head
        content += (b"content-length: %d\r\n\r\n" % len(body), body)
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        cycle.chunked_encoding = False
        cycle.expected_content_length = 0
        cycle.transport.write(b"".join(content))
        cycle.response_complete = True
        cycle.message_event.set()
        if close:
            cycle.transport.close()
        cycle.on_response()
        return True
    except AttributeError:
        return False


def current_task() -> asyncio.Task[None] | None:
    """``asyncio.current_task()`` without the ``getpid()`` call of CPython 3.11's running-loop
    lookup (:func:`router.connection.running_loop`); None outside a task. Raises RuntimeError
    when no event loop runs."""
    return asyncio.current_task(running_loop())


def watch_disconnect(scope: Scope, on_gone: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``on_gone()`` once, from the protocol's ``connection_lost``, if the client's connection
    closes before the returned ``unwatch()`` is called (at once when it closed already). One
    callback instead of a task per request waiting on ASGI ``receive()`` for ``http.disconnect``.
    None when ``scope`` does not come from :class:`LimitedHttpToolsProtocol`: watch ``receive()``
    then."""
    ext = scope.get("extensions")
    proto = ext.get(PROTOCOL_KEY) if ext else None
    cycle = _cycle_in(ext)
    if proto is None or cycle is None or not hasattr(cycle, "disconnected"):
        return None
    if cycle.disconnected:
        on_gone()
        return _nothing

    def lost() -> None:
        # uvicorn marks only its newest cycle disconnected; with a pipelined request behind this
        # one that is not this request's, which would then be answered a 500 on a closed
        # transport (an error logged for every such client)
        cycle.disconnected = True
        cycle.message_event.set()
        if not cycle.response_complete:
            # (a whole answer already written, e.g. from the engine connection's callback before a
            # ``connection: close``, has nothing left to abort: its task only does bookkeeping)
            on_gone()

    proto.on_lost = lost

    def unwatch() -> None:
        if proto.on_lost is lost:   # not a later pipelined request's
            proto.on_lost = None

    return unwatch


def _nothing() -> None:
    return None


class LaterTask:
    """A request :meth:`LimitedHttpToolsProtocol._start_deferred` started without a task: the app's
    ``start_request`` returned this instead of an ASGI callable. The request is served from
    callbacks (:class:`router.quick.QuickAnswer`) until :meth:`spawn` runs ``app`` as its task
    after all (anything but the plain outcome) or :meth:`done` says it ended. Meanwhile it stands
    in uvicorn's task set, so that a stop waits for it and, at its drain limit, cancels it:
    :meth:`cancel` spawns the task, then cancels it once it has taken its first step (the
    request's task is then cut as any other, ``router.drain``)."""

    __slots__ = ("_cycle", "_proto", "app", "ended")

    def __init__(self, app: ASGIApp) -> None:
        #: the request's task (an ASGI callable, run as uvicorn runs one)
        self.app = app
        self._proto: LimitedHttpToolsProtocol | None = None
        self._cycle: RequestResponseCycle | None = None
        #: spawned or done: nothing more to do here
        self.ended = False

    def bind(self, proto: LimitedHttpToolsProtocol, cycle: RequestResponseCycle) -> None:
        """Called by the protocol once the request is started: listed among its tasks."""
        self._proto, self._cycle = proto, cycle
        proto.tasks.add(self)  # type: ignore[arg-type]

    def spawn(self) -> asyncio.Task[None] | None:
        """Run ``app`` as the request's task now, as uvicorn would have (once; None after
        :meth:`done` or a first spawn)."""
        proto, cycle = self._proto, self._cycle
        if self.ended or proto is None or cycle is None:
            return None
        self.ended = True
        tasks = proto.tasks
        tasks.discard(self)
        task = proto.loop.create_task(cycle.run_asgi(self.app))  # type: ignore[arg-type]
        task.add_done_callback(tasks.discard)
        tasks.add(task)
        return task

    def done(self) -> None:
        """The request ended without a task."""
        self.ended = True
        if self._proto is not None:
            self._proto.tasks.discard(self)

    def cancel(self, msg: str | None = None) -> bool:
        """uvicorn's stop at its drain limit (it iterates its task set: nothing is changed here):
        spawn the task at the next callback, cancelled after its first step."""
        if self.ended or self._proto is None:
            return False
        self._proto.loop.call_soon(self._cut, msg)
        return True

    def _cut(self, msg: str | None) -> None:
        task = self.spawn()
        if task is not None and self._proto is not None:
            self._proto.loop.call_soon(task.cancel, msg)


#: the event loop that started a request from a protocol callback in its current turn (see
#: LimitedHttpToolsProtocol._start_deferred); cleared by the turn's ready callbacks
_busy_loop: asyncio.AbstractEventLoop | None = None


def _turn_over(loop: asyncio.AbstractEventLoop) -> None:
    global _busy_loop
    if _busy_loop is loop:
        _busy_loop = None


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on the raw size of an incomplete request head
    (module docstring). Limits: class attributes, from the environment at import."""

    max_header_bytes = int(os.environ.get(ENV_BYTES, DEFAULT_MAX_HEADER_BYTES))
    max_headers = int(os.environ.get(ENV_COUNT, DEFAULT_MAX_HEADERS))

    # Any: uvicorn's protocol arguments (config, server state...), passed through unchanged
    def __init__(self, *args: Any, **kw: Any) -> None:  # type: ignore[explicit-any]
        super().__init__(*args, **kw)
        self._in_head = False
        self._head_raw = 0
        self._refused = False
        self._raw_limit = raw_head_limit(self.max_header_bytes)
        self.on_lost: Callable[[], None] | None = None   # see watch_disconnect
        self._feeding = False    # inside data_received: a request may be started from there
        # Any: uvicorn's cycle and ASGI app, as _start_asgi_task gets them; (cycle, app) to start at the read's end
        self._deferred: tuple[Any, Any] | None = None   # type: ignore[explicit-any]

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._head_raw = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            # Any: uvicorn types the scope an HTTPScope TypedDict, "extensions" dict[str, dict[object, object]]
            scope: Any = self.scope   # type: ignore[explicit-any]
            ext = scope.get("extensions")
            ref = weakref.ref(cycle)
            if ext is None:
                scope["extensions"] = {CYCLE_KEY: ref, PROTOCOL_KEY: self}
            else:
                ext[CYCLE_KEY] = ref
                ext[PROTOCOL_KEY] = self

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        cb, self.on_lost = self.on_lost, None
        if cb is not None:
            cb()

    # Any: uvicorn's cycle and its app (an override of uvicorn's method)
    def _start_asgi_task(self, cycle: Any, app: Any) -> None:  # type: ignore[explicit-any]
        # a POST whose head arrives in this read waits for the read's end: when its whole body
        # came with it, the app may start it from here (see _start_deferred), unless another
        # request was started that way in this turn of the event loop
        if self._feeding and self._deferred is None and _busy_loop is not self.loop and \
                cycle.scope.get("method") == "POST" and hasattr(app, "start_request"):
            self._deferred = (cycle, app)
            return
        super()._start_asgi_task(cycle, app)

    # Any: uvicorn's cycle and an app with start_request (checked by hasattr)
    def _start_deferred(self, cycle: Any, app: Any) -> None:  # type: ignore[explicit-any]
        """Start the request of ``cycle``, deferred to the end of the read that brought its head.
        When its whole body is in and the connection is open, the app's ``start_request(scope,
        body)`` may write it to its worker now, without waiting for the event loop to run a task
        (:meth:`router.app.DPLBApp.start_request`); the task then runs what it returns, with the
        body taken as ``receive()`` would take it. Otherwise (a body still arriving, an error to
        answer, another path, or a request already started this way in this turn of the event
        loop) the task runs the app as uvicorn runs it."""
        started = None
        if not cycle.more_body and not cycle.disconnected and not self._refused and cycle.scope is not None:
            try:
                started = app.start_request(cycle.scope, cycle.body)
            except Exception:   # a fault in the router's own code: the task path answers it (a 500)
                self.logger.exception("could not start a request from the protocol; serving it from its task")
                started = None
        if started is None:
            super()._start_asgi_task(cycle, app)
            return
        global _busy_loop
        _busy_loop = self.loop
        self.loop.call_soon(_turn_over, self.loop)
        cycle.body = b""
        cycle.message_event.clear()
        cycle.waiting_for_100_continue = False   # the body is here: no 100 Continue to send
        self.flow.resume_reading()               # as receive() does
        if isinstance(started, LaterTask):
            started.bind(self, cycle)            # served from callbacks; a task only if needed
            return
        super()._start_asgi_task(cycle, started)

    def send_400_response(self, msg: str) -> None:
        """Answer a request head HTTP's parser refused (uvicorn calls this from ``data_received``
        while handling the parser's error: a Content-Length with chunked framing, two
        Content-Lengths, an obs-fold, a bare LF, an unknown HTTP version, a space in a header
        name, ...) in the OpenAI error shape every other error of the router has, naming the
        parser's reason, instead of uvicorn's plain text; then close the connection (bytes after a
        broken frame cannot be told apart from a smuggled request). Nothing of such a request
        reaches the app, so nothing is forwarded to an engine."""
        exc = sys.exc_info()[1]
        reason = str(exc.args[0]) if isinstance(exc, httptools.HttpParserError) and exc.args else msg
        body = error_body(f"malformed HTTP/1.1 request: {reason}", "invalid_request_error", 400)
        content = [STATUS_LINE[400]]
        for name, value in self.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        content += (b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % len(body),
                    WORKER_HEADER_B, b": none\r\n\r\n", body)
        self.transport.write(b"".join(content))
        self.transport.close()

    def _unsupported_upgrade_warning(self) -> None:
        # (uvicorn's own warning blames a missing WebSocket library.) The router upgrades nothing
        # (``ws="none"``); the request is answered over HTTP (the proxy refuses one asking to
        # upgrade, 400), and since the parser takes every byte after this head for the other
        # protocol, the connection closes after that answer instead of hanging on the next request
        self.logger.debug("a request asked to upgrade the connection to %s; answered over HTTP/1.1, then closed",
                          text(repr(self._get_upgrade())))
        if self.cycle is not None:
            self.cycle.keep_alive = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        self._feeding = True
        try:
            super().data_received(data)
        finally:
            self._feeding = False
        d = self._deferred
        if d is not None:
            self._deferred = None
            self._start_deferred(*d)
        if self._in_head and self.parser is not None:
            # the head is still incomplete after this chunk: every byte of it was head
            self._head_raw += len(data)
            if self._head_raw > self._raw_limit:
                self._refused = True
                self.logger.warning("refused a request head of more than %d bytes from %s", self._raw_limit,
                                    self.client)
                self.transport.write(_431(f"the request head exceeds {self._raw_limit} bytes "
                                          f"(router.max_header_bytes={self.max_header_bytes})"))
                self.transport.close()
