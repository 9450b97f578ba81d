"""Forwarding to engines over Unix sockets or TCP, behind two methods: a small HTTP/1.1 client.

    t = Transport(connect_timeout_s=2, first_byte_timeout_s=600, idle_timeout_s=120)
    up = await t.send(endpoint, "POST", "/v1/chat/completions", headers, body)   # after the response head
    ... up.status, up.headers, up.is_stream
    first = await up.first_chunk()          # the first body bytes (b"" for an empty body)
    ... await up.read() / async for chunk in up.chunks()   # the rest
    ... or await up.pipe(sink, drain, handoff)              # the rest, from the connection's callback
    up.release()            # always (returns or drops the pooled connection)
    await t.close()

Why not aiohttp (the first client): profiled under load (``bench/results/router_profile.md``),
aiohttp's ``ClientSession._request`` machinery (URL building, auto headers, payload objects,
timers, stream reader) took about a fifth of the router's CPU per request. This client is one
``asyncio.Protocol`` per pooled connection with httptools' C parser (already a dependency of
uvicorn): the request goes out in one ``write``; the parser's callbacks collect the head and the
(de-chunked) body; the reader is woken once per network read, and everything that arrived by then
is handed on at once. The measurement that chose it is in ``bench/results/router_profile.md``.
A body with neither a Content-Length nor chunked framing (an HTTP/1.0-style server) ends with the
connection and is complete there (RFC 9112 §6.3); any other connection end before the body's end
is a broken answer.

Two timeouts, measured here (not per socket read): the **first-byte** timeout runs from dispatch
until the first body byte (the response head and a stream's first token after the prefill, or a
whole non-streamed generation) and the **idle** timeout bounds every gap between two later body
chunks.

Connections are pooled per endpoint (a socket path, or ``host:port``), reused last-in first-out,
and dropped after ``keepalive_s`` idle (4 s: below the 5 s keep-alive of uvicorn-based engines,
so the engine never closes a connection we are about to reuse). Bodies and headers are forwarded
byte for byte; hop-by-hop headers (:data:`router.protocol.HOP_BY_HOP`) are dropped both ways and
``host``/``content-length`` recomputed. Dropping a connection (:meth:`Upstream.release` with
``abort``, or the client leaving) is how the engine learns to abort the generation.

Failures raise :class:`router.errors.TransportError`: ``connect`` before the response head
(``refused`` when nothing accepted the connection; ``unsent`` when the peer reset it or the pipe
broke before any response byte: it never read the request), ``timeout``, or ``stream_broken``
while reading the body. Route handlers never see sockets.
"""
from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import httptools

from router.errors import TransportError
from router.protocol import HOP_BY_HOP

log = logging.getLogger("dplb.router.transport")

#: pause reading a connection once this many body bytes wait for the relay (flow control)
HIGH_WATER = 1 << 20
_UNREAD = (errno.ECONNRESET, errno.EPIPE)


def endpoint_url(endpoint: str) -> str:
    """Base URL for ``endpoint``: a Unix socket path → ``http://localhost``; ``host:port`` →
    ``http://host:port`` (IPv6 hosts bracketed)."""
    if endpoint.startswith("/"):
        return "http://localhost"
    host, _, port = endpoint.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class _Conn(asyncio.Protocol):
    """One pooled HTTP/1.1 connection; one response at a time. The parser's callbacks fill
    ``status``/``headers``, then ``body`` (bytes not yet taken by the reader); ``waiter`` is the
    future the reader sleeps on."""

    __slots__ = ("body", "boundary", "buffered", "done", "error", "got_any", "handoff", "head_done", "headers", "held", "home",
                 "idle_since", "interim", "keep", "keep_hint", "last_rx", "lost", "on_whole", "parser", "paused", "relay", "sink",
                 "status", "timer", "transport", "waiter")

    def __init__(self) -> None:
        self.transport: Any = None
        self.parser: Any = None
        self.waiter: asyncio.Future[bool | None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last_rx = 0.0
        self.lost = False
        self.idle_since = 0.0
        self.sink: Callable[[bytes], bool] | None = None
        self.handoff: Callable[[], Any] | None = None   # see Upstream.pipe
        self.relay: Any = None                          # a router._relay.ChunkRelay while it has the body
        self.on_whole: Callable[[_Conn], None] | None = None   # see Transport.send
        self.home: _Pool | None = None                  # the pool of its endpoint (liveness: _Pool.last_rx)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.interim = False   # inside an interim (1xx) answer, which is skipped
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.buffered = 0
        self.head_done = False
        self.done = False
        self.keep = False
        self.got_any = False
        self.error: BaseException | None = None
        self.paused = False
        self.held = False     # reading paused because the sink's client was slow (see Upstream.pipe)
        self.keep_hint = False
        self.boundary = False  # the parser stopped right after a chunk's closing CRLF (see data_received)

    def start(self) -> None:
        """A new request goes out on this connection: a fresh parser and state."""
        self._reset()
        self.parser = httptools.HttpResponseParser(self)

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_any = True
        self.last_rx = t = time.monotonic()   # the idle timer measures gaps from here
        r = self.relay
        if (r is not None or self.sink is not None) and self.home is not None:
            self.home.last_rx = t   # a stream's chunk: the engine is busy, not hung (router.health)
        if r is not None:
            # the native relay has the body: decode, meter and write to the client in one call
            st = r.feed(data)
            if r.failed:
                self.error = ValueError("invalid chunked framing from the worker")
                self.transport.close()
            elif r.done:
                self.keep = self.keep_hint and not r.extra
                self.done = True
            if st:
                self.held = True
                self.transport.pause_reading()
            if self.done or self.held or self.error is not None:
                self._wake()
            return
        p = self.parser
        if p is None:   # bytes while idle: the peer is confused; never reuse this connection
            self.transport.close()
            return
        try:
            p.feed_data(data)
        except httptools.HttpParserError as e:
            self.error = e
            self.transport.close()
        if self.boundary and not data.endswith(b"\r\n"):
            self.boundary = False   # bytes of the next size line follow the chunk's end
        s = self.sink
        if s is not None:
            # piped: hand the body on from here, without waking the reader per chunk
            if self.body and not s(self.take()):
                self.held = True
                self.transport.pause_reading()
            if self.done or self.held or self.error is not None:
                self._wake()
            elif self.handoff is not None and self.boundary:
                self._hand_off()
            return
        # wake the task first: what the answer's write schedules (the client's next pipelined
        # request) then runs after the task's bookkeeping (the lease released), not before it
        self._wake()
        if self.done and self.on_whole is not None and self.error is None:
            cb, self.on_whole = self.on_whole, None
            cb(self)

    def _hand_off(self) -> None:
        """At a chunk boundary (``boundary``: the parser's last callback was a chunk's end and the
        read ended with that chunk's CRLF, so the parser holds no partial size line): give the
        rest of the body to the native relay if the pipe's ``handoff`` has one ready."""
        r = self.handoff() if self.handoff is not None else None
        if r is not None:
            self.handoff = None
            self.relay = r

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        if not self.done and self.error is None:
            self.error = exc if exc is not None else ConnectionResetError("connection closed by the worker")
        self._wake()

    def eof_received(self) -> bool | None:
        # a body with neither a Content-Length nor chunked framing ends with the connection (RFC
        # 9112 §6.3, rule 8): complete, not broken. httptools cannot be told that its input ended,
        # so that ending is recognised here (the framing is read only then: a cold path); any other
        # EOF is a broken answer (connection_lost)
        if self.head_done and not self.done and self.error is None and self.status not in (204, 304) and not any(
                k == b"content-length" or (k == b"transfer-encoding" and b"chunked" in v.lower())
                for k, v in self.headers):
            self.done = True
            self.keep = False
            self._wake()
        return None

    # -- httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # an interim answer (100 Continue, 103 Early Hints): not the response; the final one
            # follows on the same connection (RFC 9110 §15.2)
            self.interim = True
            self.headers.clear()
            return
        self.status = status
        self.keep_hint = self.parser.should_keep_alive()
        self.head_done = True

    def on_chunk_header(self) -> None:
        self.boundary = False

    def on_chunk_complete(self) -> None:
        self.boundary = True

    def on_body(self, body: bytes) -> None:
        self.boundary = False
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.keep = self.parser.should_keep_alive()   # read now: the parser forgets it after the message
        self.done = True

    # -- reader side ------------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def take(self) -> bytes:
        """Every body byte that arrived so far (b"" when none)."""
        b = self.body
        if not b:
            return b""
        data = b[0] if len(b) == 1 else b"".join(b)
        b.clear()
        self.buffered = 0
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        return data

    async def wait(self, timeout: float | None) -> bool:
        """Sleep until the next network event; False when ``timeout`` (s) passed first."""
        loop = asyncio.get_running_loop()
        w = self.waiter = loop.create_future()
        h = loop.call_later(timeout, _expire, w) if timeout is not None else None
        try:
            await w
            return w.result() is None
        finally:
            self.waiter = None
            if h is not None:
                h.cancel()

    async def wait_idle(self, idle_s: float) -> bool:
        """Sleep until the next network event; False when no byte arrived for ``idle_s`` seconds.
        One timer serves a whole stream (re-armed only when it fires early), not one per chunk."""
        loop = asyncio.get_running_loop()
        w = self.waiter = loop.create_future()
        if self.timer is None:
            self.timer = loop.call_later(idle_s, self._idle_check, idle_s)
        try:
            await w
            return w.result() is None
        finally:
            self.waiter = None

    def _idle_check(self, idle_s: float) -> None:
        loop = asyncio.get_running_loop()
        left = self.last_rx + idle_s - time.monotonic()
        if left > 0:
            self.timer = loop.call_later(left, self._idle_check, idle_s)
            return
        self.timer = None
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(False)

    def stop_timer(self) -> None:
        """The response ended (or was dropped): no idle timer any more."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def _expire(w: asyncio.Future[Any]) -> None:
    if not w.done():
        w.set_result(False)


class Upstream:
    """A worker's response after its head arrived. ``status`` int; ``headers``: list of
    (name, value) bytes pairs without hop-by-hop ones (names lower-case); ``is_stream``: SSE or
    chunked without length. Call :meth:`release` exactly once (``read`` does it for you).
    ``deadline``: event-loop time (s) by which the first body byte must arrive; ``idle_s``: the
    longest gap (s) between two later chunks."""

    __slots__ = ("_conn", "_first", "_on_done", "_pool", "answered", "deadline", "endpoint", "headers", "idle_s",
                 "is_stream", "request_id", "status", "whole")

    def __init__(self, conn: _Conn, pool: _Pool, endpoint: str, on_done: Callable[[], None] | None = None,
                 deadline: float | None = None, idle_s: float | None = None) -> None:
        self._conn = conn
        self._pool: _Pool | None = pool
        self._on_done = on_done
        self.endpoint = endpoint
        self.status = conn.status
        self.deadline = deadline
        self.idle_s = idle_s
        self._first = True
        #: the whole body, when it was in before the caller woke up (``Transport.send``'s ``on_whole``)
        self.whole: bytes | None = None
        #: ``on_whole`` answered the client with it already
        self.answered = False
        hs = []
        stream = False
        has_len = False
        rid = None
        for k, v in conn.headers:
            if k == b"content-length":
                has_len = True
            if k in HOP_BY_HOP:
                continue
            if k == b"content-type" and v.startswith(b"text/event-stream"):
                stream = True
            elif k == b"x-request-id":
                rid = v
            hs.append((k, v))
        self.headers = hs
        #: the engine's ``X-Request-Id`` answer header, None when it sent none
        self.request_id: bytes | None = rid
        self.is_stream = stream or not has_len

    async def _next(self) -> bytes:
        """The next body bytes (b"" at the end), within the first-byte deadline for the first read
        and the idle timeout for later ones. Raises TransportError (timeout / stream_broken)."""
        c = self._conn
        while True:
            data = c.take()
            if data:
                self._first = False
                return data
            if c.done:
                self._first = False
                return b""
            if c.error is not None:
                c.transport.close()
                raise TransportError("stream_broken", self.endpoint, repr(c.error))
            if self._first:
                wait = None if self.deadline is None else self.deadline - asyncio.get_running_loop().time()
                if (wait is not None and wait <= 0) or not await c.wait(wait):
                    c.transport.close()
                    raise TransportError("timeout", self.endpoint, "no first byte within the timeout")
            elif self.idle_s is None:
                await c.wait(None)
            elif not await c.wait_idle(self.idle_s):
                c.transport.close()
                raise TransportError("timeout", self.endpoint, "no idle gap between chunks within the timeout")

    async def first_chunk(self) -> bytes:
        """The first body bytes (b"" for an empty body), waited for until the first-byte deadline.
        Raises TransportError (``timeout``: the worker sent its head but no body in time;
        ``stream_broken``)."""
        return await self._next()

    async def read(self, prefix: bytes = b"") -> bytes:
        """The rest of the body joined after ``prefix`` (usually the first chunk); raises
        TransportError(stream_broken / timeout); releases the connection either way."""
        parts = [prefix] if prefix else []
        try:
            while True:
                chunk = await self._next()
                if not chunk:
                    return b"".join(parts)
                parts.append(chunk)
        finally:
            self.release()

    async def pipe(self, sink: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]],
                   handoff: Callable[[], Any] | None = None) -> None:
        """Relay the rest of the body through ``sink(bytes) -> bool``, called from the
        connection's ``data_received`` with everything one network read brought (de-chunked):
        no task wakes up per chunk. ``sink`` returns False when its client cannot take more for
        now; reading then pauses until ``drain()`` returns. Returns once the body ended; raises
        TransportError (``stream_broken``, or ``timeout`` when a gap exceeded the idle timeout)
        like :meth:`chunks`. The caller still calls :meth:`release`.

        ``handoff() -> ChunkRelay | None`` (a chunked body only): asked at every chunk boundary
        until it returns a :class:`router._relay.ChunkRelay`, which then gets every later read
        (decoded, metered and written to its client natively; ``sink`` is not called again)."""
        c = self._conn
        data = c.take()
        if data and not sink(data):
            await drain()
        c.sink = sink
        if handoff is not None and any(k == b"transfer-encoding" and b"chunked" in v.lower() for k, v in c.headers):
            c.handoff = handoff
            if c.boundary and not c.done and not c.body:
                c._hand_off()
        try:
            while True:
                if c.held:
                    await drain()
                    c.held = False
                    c.last_rx = time.monotonic()   # the pause was the client's, not the engine's gap
                    c.transport.resume_reading()
                data = c.take()
                if data and not sink(data):
                    c.held = True
                    c.transport.pause_reading()
                    continue
                if c.done:
                    self._first = False
                    return
                if c.error is not None:
                    c.transport.close()
                    raise TransportError("stream_broken", self.endpoint, repr(c.error))
                if self.idle_s is None:
                    await c.wait(None)
                elif not await c.wait_idle(self.idle_s):
                    c.transport.close()
                    raise TransportError("timeout", self.endpoint, "no idle gap between chunks within the timeout")
        finally:
            c.sink = None
            c.handoff = None
            c.relay = None

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (everything that arrived by one wake-up at once; no
        re-framing); raises TransportError on a broken or stalled stream (kind ``timeout`` when a
        gap exceeded the idle timeout)."""
        while True:
            chunk = await self._next()
            if not chunk:
                return
            yield chunk

    def complete(self) -> bool:
        """True when the whole body was received (the connection can be reused)."""
        return self._conn.done

    def release(self, abort: bool = False) -> None:
        """Give the connection back to the pool, or close it (``abort``: the client left
        mid-stream, which also tells the engine to stop generating). Idempotent."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        c = self._conn
        c.stop_timer()
        if abort or not c.done or c.error is not None or not c.keep:
            c.transport.close()
        else:
            if c.held or c.paused:
                # reading was paused for this answer (its client was slow, or left at [DONE] while
                # the pipe waited to drain): the next answer on this connection must be read
                c.held = c.paused = False
                c.transport.resume_reading()
            pool.put(c)
        cb, self._on_done = self._on_done, None
        if cb is not None:
            cb()


class _Pool:
    """Idle keep-alive connections of one endpoint (LIFO)."""

    __slots__ = ("_tcp_host", "closed", "endpoint", "host", "idle", "keepalive_s", "last_rx", "path", "port")

    def __init__(self, endpoint: str, keepalive_s: float) -> None:
        self.endpoint = endpoint
        self.keepalive_s = keepalive_s
        self.idle: deque[_Conn] = deque()
        self.closed = False
        self.last_rx = 0.0   # time.monotonic() of the last stream chunk a connection of this endpoint received
        self._tcp_host = ""
        if endpoint.startswith("/"):
            self.path: str | None = endpoint
            self.host = b"localhost"
            self.port = 0
        else:
            self.path = None
            h, _, p = endpoint.rpartition(":")
            self.host = endpoint.encode("latin-1")
            self.port = int(p)
            self._tcp_host = h.strip("[]")

    def get(self) -> _Conn | None:
        now = time.monotonic()
        idle = self.idle
        while idle:
            c = idle.pop()
            if c.lost or c.transport.is_closing() or now - c.idle_since > self.keepalive_s:
                c.transport.close()
                continue
            return c
        return None

    def put(self, c: _Conn) -> None:
        c.parser = None
        if self.closed:   # the worker left meanwhile: its connections go
            c.transport.close()
            return
        c.idle_since = time.monotonic()
        self.idle.append(c)

    async def connect(self, timeout: float) -> _Conn:
        loop = asyncio.get_running_loop()
        if self.path is not None:
            coro = loop.create_unix_connection(_Conn, self.path)
        else:
            coro = loop.create_connection(_Conn, self._tcp_host, self.port)
        _, c = await asyncio.wait_for(coro, timeout)
        c.home = self
        sock = c.transport.get_extra_info("socket")
        if self.path is None and sock is not None:
            import socket as _socket

            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
        return c

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().transport.close()


class Transport:
    """Pooled HTTP/1.1 forwarding to engines; see the module docstring.

    ``connect_timeout_s``: connect timeout (s); ``first_byte_timeout_s``: longest wait (s) from
    sending a request until the first body byte; ``idle_timeout_s``: longest gap (s) between two
    later body chunks; ``keepalive_s``: idle pooled connections are dropped after this long.
    """

    def __init__(self, connect_timeout_s: float = 2.0, first_byte_timeout_s: float = 600.0,
                 idle_timeout_s: float = 120.0, keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.keepalive_s = keepalive_s
        self._pools: dict[str, _Pool] = {}

    def _pool(self, endpoint: str) -> _Pool:
        p = self._pools.get(endpoint)
        if p is None:
            p = self._pools[endpoint] = _Pool(endpoint, self.keepalive_s)
        return p

    def write_pooled(self, endpoint: str, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
                     body: bytes | None) -> _Conn | None:
        """Write one request now, without suspending, on an idle pooled connection to ``endpoint``
        and return that connection (hand it to :meth:`send` as ``written``); None when the pool
        has none (then :meth:`send` connects and writes). Lets the caller do its bookkeeping
        while the engine already reads the request. Arguments as for :meth:`send`."""
        pool = self._pool(endpoint)
        c = pool.get()
        if c is not None:
            self._write(c, pool, method, path, headers, body)
        return c

    @staticmethod
    def _write(c: _Conn, pool: _Pool, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
               body: bytes | None) -> None:
        c.start()
        body = body or b""
        parts = [method.encode("latin-1"), b" ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", pool.host,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts.append(b"\r\n")
        parts.append(body)
        c.transport.write(b"".join(parts))

    async def send(self, endpoint: str, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
                   body: bytes | None, timeout_s: float | None = None, written: _Conn | None = None,
                   on_whole: Callable[[Upstream], bool] | None = None) -> Upstream:
        """Send one request (``path`` includes any query string; ``headers`` lower-case byte
        pairs, hop-by-hop ones already dropped) and return once the head is in. ``written``: the
        connection :meth:`write_pooled` already wrote this request on (then only the head is
        awaited).

        ``on_whole(upstream) -> answered``: called from the connection's callback, before the
        caller wakes up, when the whole response (head and a body with a Content-Length) came in
        with the head; ``upstream.whole`` then holds the body. It may answer the client at once
        (saving the task's wake-up on the way back) and returns whether it did; the returned
        :class:`Upstream` carries ``whole`` and ``answered``, and its connection is already back
        in the pool. An exception in it is logged and counts as not answered.

        The head must arrive within the first-byte timeout (``timeout_s``, when given, bounds the
        head instead and the body's gaps too: health probes and control calls). Raises
        TransportError (``connect``, with ``refused`` when nothing accepted the connection and
        ``unsent`` when the worker never read the request, or ``timeout``)."""
        loop = asyncio.get_running_loop()
        if timeout_s is not None:
            deadline = loop.time() + timeout_s
        else:
            deadline = loop.time() + self.first_byte_timeout_s
        pool = self._pool(endpoint)
        c = written
        if c is None:
            c = pool.get()
        if c is None:
            try:
                c = await pool.connect(min(self.connect_timeout_s, max(0.0, deadline - loop.time())))
            except TimeoutError as e:
                err = TransportError("connect", endpoint, f"no connection within the connect timeout ({e!r})")
                err.refused = err.unsent = True   # nothing was sent: the worker is unreachable
                raise err from None
            except OSError as e:
                # nothing listens (socket file gone, port closed): the worker is down, not slow
                err = TransportError("connect", endpoint, repr(e))
                err.refused = err.unsent = True
                raise err from None
        if c is not written:
            self._write(c, pool, method, path, headers, body)
        up_deadline = deadline if timeout_s is None else None
        idle = timeout_s if timeout_s is not None else self.idle_timeout_s
        made: list[Upstream] = []
        if on_whole is not None:
            def whole(conn: _Conn) -> None:
                u = Upstream(conn, pool, endpoint, None, up_deadline, idle)
                made.append(u)
                if u.is_stream:
                    return
                u.whole = conn.take()
                try:
                    u.answered = bool(on_whole(u))
                except Exception:   # a bug: the caller answers through its own path instead
                    log.exception("answering from the connection callback failed; answering from the task")
            c.on_whole = whole
        try:
            while not c.head_done:
                if c.error is not None:
                    cause = c.error
                    err = TransportError("connect", endpoint, repr(cause))
                    # reset / broken pipe before any response byte: the request reached a socket its
                    # process no longer reads (a pooled connection of a worker that just died)
                    err.unsent = not c.got_any and getattr(cause, "errno", None) in _UNREAD
                    raise err
                left = deadline - loop.time()
                if left <= 0 or not await c.wait(left):
                    raise TransportError("timeout", endpoint, "no response head within the timeout")
        except BaseException:
            c.transport.close()   # cancelled (the client left), timed out or broken: the engine must stop
            raise
        finally:
            c.on_whole = None
        if made:
            up = made[0]
            if up.whole is not None:
                up.release()
            return up
        return Upstream(c, pool, endpoint, None, up_deadline, idle)

    async def get(self, endpoint: str, path: str, timeout_s: float, method: str = "GET") -> tuple[int, bytes]:
        """Small control request (probes, state mirroring, an agent's ``POST /dplb/restart``):
        ``(status, body)`` within ``timeout_s`` seconds. Raises TransportError."""
        loop = asyncio.get_running_loop()
        t_end = loop.time() + timeout_s
        up = await self.send(endpoint, method, path, (), None, timeout_s=timeout_s)
        up.deadline = t_end
        up.idle_s = max(0.0, t_end - loop.time())
        try:
            body = await up.read()
        except TransportError as e:
            if e.kind == "timeout":
                raise TransportError("timeout", endpoint, "reading body") from None
            raise
        return up.status, body

    def last_rx(self, endpoint: str) -> float:
        """``time.monotonic()`` when a connection to ``endpoint`` last received a chunk of a
        streamed answer being relayed (not a probe's answer, not a head: the lease reports those);
        0.0 when none did. Liveness evidence for :mod:`router.health`: a worker streaming answers is
        busy, not hung."""
        p = self._pools.get(endpoint)
        return p.last_rx if p is not None else 0.0

    async def forget(self, endpoint: str) -> None:
        """Close the idle connections of a worker that left (removed, restarted, gone). Requests
        still in flight keep theirs: each is closed when released (its pool is gone)."""
        p = self._pools.pop(endpoint, None)
        if p is not None:
            p.close()

    async def close(self) -> None:
        """Close every pooled connection."""
        pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.close()


__all__ = ["HIGH_WATER", "Transport", "TransportError", "Upstream", "endpoint_url"]
