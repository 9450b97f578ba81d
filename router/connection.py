"""One pooled HTTP/1.1 connection to an engine (:class:`Connection`, an ``asyncio.Protocol`` with
httptools' C parser) and the idle keep-alive connections of one endpoint (:class:`Pool`), for
:class:`router.transport.Transport` (the module docstring there tells the design: one write per
request, one wake-up per network read, flow control at :data:`HIGH_WATER`, a body without framing
ending with its connection as RFC 9112 §6.3 says)."""
from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httptools

from router._relay import RelayProtocol

if TYPE_CHECKING:
    from router._relay import ChunkRelay

#: pause reading a connection once this many body bytes wait for the relay (flow control)
HIGH_WATER = 1 << 20


#: per thread, the event loop :func:`running_loop` last found running there
_LOOPS = threading.local()


def running_loop() -> asyncio.AbstractEventLoop:
    """``asyncio.get_running_loop()``, without its system call on the router's hot path: CPython
    3.11's makes a ``getpid()`` call each time (3.12 dropped the check; strace on the router at
    300 tiny requests/s: 1.6 per request, bench/results/long-prompts.md round 5). The loop found
    last in this thread is returned while it runs (one loop at a time runs in a thread, so a
    running loop found here is this thread's; a forked child forgets it); otherwise asyncio's
    lookup, whose RuntimeError (no running loop) passes through."""
    loop: asyncio.AbstractEventLoop | None = getattr(_LOOPS, "loop", None)
    if loop is None or not loop.is_running():
        loop = _LOOPS.loop = asyncio.get_running_loop()
    return loop


def _forget_loop() -> None:
    # a child forked while a loop ran: its copy of that loop still reads as running, but never
    # runs there (asyncio's own lookup checks getpid() for this case; here the fork says it once)
    _LOOPS.loop = None


os.register_at_fork(after_in_child=_forget_loop)


def endpoint_url(endpoint: str) -> str:
    """Base URL for ``endpoint``: a Unix socket path → ``http://localhost``; ``host:port`` →
    ``http://host:port`` (IPv6 hosts bracketed)."""
    if endpoint.startswith("/"):
        return "http://localhost"
    host, _, port = endpoint.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Connection(asyncio.Protocol):
    """One pooled HTTP/1.1 connection; one response at a time. The parser's callbacks fill
    ``status``/``headers``, then ``body`` (bytes not yet taken by the reader); ``waiter`` is the
    future the reader sleeps on."""

    __slots__ = ("body", "boundary", "buffered", "done", "error", "got_any", "handoff", "head_done", "headers", "held", "home",
                 "idle_since", "interim", "keep", "keep_hint", "last_rx", "lost", "on_whole", "parser", "paused", "proto",
                 "quick", "relay", "sink", "status", "timer", "transport", "waiter")

    def __init__(self) -> None:
        # Any: asyncio's transport (connection_made gets a BaseTransport; the socket one has pause_reading)
        self.transport: Any = None  # type: ignore[explicit-any]
        # Any: httptools' HttpResponseParser, None before the first request (read only from its callbacks)
        self.parser: Any = None  # type: ignore[explicit-any]
        self.waiter: asyncio.Future[bool | None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last_rx = 0.0
        self.lost = False
        self.idle_since = 0.0
        self.sink: Callable[[bytes], bool] | None = None
        self.handoff: Callable[[], ChunkRelay | None] | None = None   # see Upstream.pipe
        self.relay: ChunkRelay | None = None                          # a router._relay.ChunkRelay while it has the body
        self.on_whole: Callable[[Connection], None] | None = None   # see Transport.send
        #: while no task waits on this connection (router.quick.QuickAnswer): told of every network
        #: event instead of a waiter (a read, the end, a failure); it decides whether to act
        self.quick: Callable[[Connection], None] | None = None
        self.home: Pool | None = None                  # the pool of its endpoint (liveness: Pool.last_rx)
        # the transport's protocol when Pool.connect made it (for the connection's life): it hands the
        # reads to a native relay and back without set_protocol (see _hand_off); None: this is the protocol
        self.proto: RelayProtocol | None = None
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
    # Any: asyncio.Protocol's BaseTransport, used as the socket transport it is
    def connection_made(self, transport: Any) -> None:  # type: ignore[explicit-any]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.got_any = True
        self.last_rx = t = time.monotonic()   # the idle timer measures gaps from here
        r = self.relay
        if (r is not None or self.sink is not None) and self.home is not None:
            self.home.last_rx = t   # a stream's chunk: the engine is busy, not hung (router.health)
        if r is not None:
            # the native relay has the body: decode, meter and write to the client in one call
            # (where the transport took router._relay.RelayProtocol, reads go there instead)
            st = r.feed(data)
            if st or r.failed or r.done or self.held or self.error is not None:
                self.relay_settle(st)
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

    def relay_settle(self, st: int) -> None:
        """After the native relay fed a read (``st``: :meth:`router._relay.ChunkRelay.feed`'s
        result) that ended or broke the body or filled the client: drop a connection with invalid
        framing, mark the body done (reusable unless bytes followed it), pause reading while the
        client is full, and wake the reader for any of these. Called by :meth:`data_received` and
        by :class:`router._relay.RelayProtocol` (which skips the reads that change none of it)."""
        r = self.relay
        if r is None:
            return
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

    def _hand_off(self) -> None:
        """At a chunk boundary (``boundary``: the parser's last callback was a chunk's end and the
        read ended with that chunk's CRLF, so the parser holds no partial size line): give the
        rest of the body to the native relay if the pipe's ``handoff`` has one ready; the
        transport's reads then go through a :class:`router._relay.RelayProtocol` to the relay (no
        Python frame per read) until :meth:`end_relay`: the connection's own protocol
        (:attr:`proto`) takes the relay, else one is put on the transport."""
        r = self.handoff() if self.handoff is not None else None
        if r is not None:
            self.handoff = None
            self.relay = r
            t = self.transport
            if t is not None and not self.done and self.error is None and not t.is_closing():
                p = self.proto
                if p is not None:
                    p.take(r)
                else:
                    t.set_protocol(RelayProtocol(self, r))

    def end_relay(self) -> None:
        """The relayed body ended (or the pipe gave up on it): this connection reads its own
        transport again (a kept-alive connection's next answer goes through its parser); its
        :attr:`proto` gives the reads back, or the connection is put back on the transport."""
        self.relay = None
        p = self.proto
        if p is not None:
            p.take(None)
            return
        t = self.transport
        if t is not None and not t.is_closing() and t.get_protocol() is not self:
            t.set_protocol(self)

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
        elif self.quick is not None:
            self.quick(self)

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
        loop = running_loop()
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
        loop = running_loop()
        w = self.waiter = loop.create_future()
        if self.timer is None:
            self.timer = loop.call_later(idle_s, self._idle_check, idle_s)
        try:
            await w
            return w.result() is None
        finally:
            self.waiter = None

    def _idle_check(self, idle_s: float) -> None:
        loop = running_loop()
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


def _expire(w: asyncio.Future[bool | None]) -> None:
    if not w.done():
        w.set_result(False)


def _protocol() -> RelayProtocol:
    """A new connection's transport protocol: a :class:`Connection` behind the native
    :class:`router._relay.RelayProtocol`, which keeps it for the connection's life."""
    c = Connection()
    p = c.proto = RelayProtocol(c)
    return p


class Pool:
    """Idle keep-alive connections of one endpoint (LIFO)."""

    __slots__ = ("_tcp_host", "closed", "endpoint", "host", "idle", "keepalive_s", "last_rx", "path", "port")

    def __init__(self, endpoint: str, keepalive_s: float) -> None:
        self.endpoint = endpoint
        self.keepalive_s = keepalive_s
        self.idle: deque[Connection] = deque()
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

    def get(self) -> Connection | None:
        now = time.monotonic()
        idle = self.idle
        while idle:
            c = idle.pop()
            if c.lost or c.transport.is_closing() or now - c.idle_since > self.keepalive_s:
                c.transport.close()
                continue
            return c
        return None

    def put(self, c: Connection) -> None:
        c.parser = None
        if self.closed:   # the worker left meanwhile: its connections go
            c.transport.close()
            return
        c.idle_since = time.monotonic()
        self.idle.append(c)

    async def connect(self, timeout: float) -> Connection:
        loop = asyncio.get_running_loop()
        if self.path is not None:
            coro = loop.create_unix_connection(_protocol, self.path)
        else:
            coro = loop.create_connection(_protocol, self._tcp_host, self.port)
        _, p = await asyncio.wait_for(coro, timeout)
        c: Connection = p.conn   # type: ignore[assignment]
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


__all__ = ["HIGH_WATER", "Connection", "Pool", "endpoint_url"]
