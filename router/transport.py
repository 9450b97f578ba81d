"""Forwarding to engines over Unix sockets or TCP, behind two methods: a small HTTP/1.1 client.

Three modules: :mod:`router.connection` (one connection, one endpoint's pool), :mod:`router.upstream`
(a response after its head) and this one (:class:`Transport`: pools per endpoint, writing a
request, waiting for its head).

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
byte for byte; hop-by-hop headers (:data:`dplb_protocol.wire.HOP_BY_HOP`) are dropped both ways and
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
from collections.abc import Callable, Iterable

from router.connection import HIGH_WATER, Connection, Pool, endpoint_url, running_loop
from router.errors import TransportError
from router.upstream import Upstream

log = logging.getLogger("dplb.router.transport")

_UNREAD = (errno.ECONNRESET, errno.EPIPE)


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
        self._pools: dict[str, Pool] = {}

    def _pool(self, endpoint: str) -> Pool:
        p = self._pools.get(endpoint)
        if p is None:
            p = self._pools[endpoint] = Pool(endpoint, self.keepalive_s)
        return p

    def write_pooled(self, endpoint: str, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
                     body: bytes | None) -> Connection | None:
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
    def _write(c: Connection, pool: Pool, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
               body: bytes | None) -> None:
        c.start()
        body = body or b""
        parts = [method.encode("latin-1"), b" ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", pool.host,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts.append(b"\r\n")
        if len(body) < 16384:
            parts.append(body)
            c.transport.write(b"".join(parts))
        else:   # a long prompt: head and body in one vectored write (uvloop), the body not copied
            c.transport.writelines((b"".join(parts), body))

    async def send(self, endpoint: str, method: str, path: str, headers: Iterable[tuple[bytes, bytes]],
                   body: bytes | None, timeout_s: float | None = None, written: Connection | None = None,
                   on_whole: Callable[[Upstream], bool] | None = None, deadline: float | None = None) -> Upstream:
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
        head instead and the body's gaps too: health probes and control calls), or by ``deadline``
        (event-loop time, s) when given: the first-byte deadline of a request written earlier. Raises
        TransportError (``connect``, with ``refused`` when nothing accepted the connection and
        ``unsent`` when the worker never read the request, or ``timeout``)."""
        loop = running_loop()
        if deadline is None:
            deadline = loop.time() + (timeout_s if timeout_s is not None else self.first_byte_timeout_s)
        pool = self._pool(endpoint)
        c = written or pool.get() or await self._connect(pool, max(0.0, deadline - loop.time()))
        if c is not written:
            self._write(c, pool, method, path, headers, body)
        up_deadline = deadline if timeout_s is None else None
        idle = timeout_s if timeout_s is not None else self.idle_timeout_s
        made: list[Upstream] = []
        if on_whole is not None:
            c.on_whole = _whole_hook(pool, up_deadline, idle, on_whole, made)
        try:
            while not c.head_done:
                if c.error is not None:
                    raise _broken_before_head(c, endpoint)
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

    async def _connect(self, pool: Pool, left_s: float) -> Connection:
        """A new connection to ``pool``'s endpoint within the connect timeout (or ``left_s``, the
        time left of the request's, when shorter). Raises TransportError (``connect``, ``refused``
        and ``unsent``: nothing was sent, the worker is unreachable)."""
        try:
            return await pool.connect(min(self.connect_timeout_s, left_s))
        except TimeoutError as e:
            err = TransportError("connect", pool.endpoint, f"no connection within the connect timeout ({e!r})")
            err.refused = err.unsent = True   # nothing was sent: the worker is unreachable
            raise err from None
        except OSError as e:
            # nothing listens (socket file gone, port closed): the worker is down, not slow
            err = TransportError("connect", pool.endpoint, repr(e))
            err.refused = err.unsent = True
            raise err from None

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



def _whole_hook(pool: Pool, deadline: float | None, idle: float, on_whole: Callable[[Upstream], bool],
                made: list[Upstream]) -> Callable[[Connection], None]:
    """The connection's ``on_whole`` callback for :meth:`Transport.send`: makes the
    :class:`Upstream` (appended to ``made``) and, for a whole non-streamed answer, hands it to
    ``on_whole`` from the connection's callback (an exception there is logged: not answered)."""
    def whole(conn: Connection) -> None:
        u = Upstream(conn, pool, pool.endpoint, None, deadline, idle)
        made.append(u)
        if u.is_stream:
            return
        u.whole = conn.take()
        try:
            u.answered = bool(on_whole(u))
        except Exception:   # a bug: the caller answers through its own path instead
            log.exception("answering from the connection callback failed; answering from the task")
    return whole


def _broken_before_head(c: Connection, endpoint: str) -> TransportError:
    """The ``connect`` error of a connection that failed before its response head; ``unsent`` when
    it was reset (or the pipe broke) before any response byte: the request reached a socket its
    process no longer reads (a pooled connection of a worker that just died)."""
    cause = c.error
    err = TransportError("connect", endpoint, repr(cause))
    err.unsent = not c.got_any and getattr(cause, "errno", None) in _UNREAD
    return err

__all__ = ["HIGH_WATER", "Transport", "TransportError", "Upstream", "endpoint_url"]
