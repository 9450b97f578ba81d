"""Forwarding over Unix sockets (local agents) or TCP (remote agents), behind two methods.

    t = Transport(connect_timeout_s=2, first_byte_timeout_s=600, idle_timeout_s=120)
    up = await t.send(endpoint, "POST", "/v1/chat/completions", headers, body)   # after the response head
    ... up.status, up.headers, up.is_stream
    first = await up.first_chunk()          # the first body bytes (b"" for an empty body)
    ... await up.read() / async for chunk in up.chunks()   # the rest
    up.release()            # always (returns or drops the pooled connection)
    await t.close()

Two timeouts, measured by the router itself (not aiohttp's ``sock_read``, which would apply one
value to both): the **first-byte** timeout runs from dispatch until the first body byte (the
response head and a stream's first token after the prefill, or a whole non-streamed generation)
and the **idle** timeout bounds every gap between two later body chunks.

One pooled ``aiohttp.ClientSession`` per endpoint (``aiohttp.UnixConnector`` for a path, a TCP
connector for ``host:port``), created on first use. Bodies and headers are forwarded byte for
byte: no auto headers (User-Agent, Content-Type, Accept-Encoding) are added and responses are not
decompressed. Hop-by-hop headers (RFC 9110 §7.6.1) are dropped both ways.

Failures raise :class:`router.errors.TransportError` with ``kind`` ``connect``/``timeout``
before the response head, ``timeout`` (first byte or idle gap) or ``stream_broken`` while reading
the body. Route handlers never see aiohttp objects.
"""
from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp

from router.errors import TransportError

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_SKIP_AUTO = frozenset({"User-Agent", "Content-Type", "Accept-Encoding", "Accept"})


def endpoint_url(endpoint: str) -> str:
    """Base URL for ``endpoint``: a Unix socket path → ``http://localhost``; ``host:port`` →
    ``http://host:port`` (IPv6 hosts bracketed)."""
    if endpoint.startswith("/"):
        return "http://localhost"
    host, _, port = endpoint.rpartition(":")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class Upstream:
    """A worker's response after its head arrived. ``status`` int; ``headers``: list of
    (name, value) bytes pairs without hop-by-hop ones (names lower-case); ``is_stream``: SSE or
    chunked without length. Call :meth:`release` exactly once (``read`` does it for you).
    ``on_done`` is called once, when the response is released (the transport's in-use count).
    ``deadline``: event-loop time (s) by which the first body byte must arrive; ``idle_s``: the
    longest gap (s) between two later chunks."""

    __slots__ = ("_first", "_on_done", "_resp", "deadline", "endpoint", "headers", "idle_s", "is_stream",
                 "status")

    def __init__(self, resp: aiohttp.ClientResponse, endpoint: str, on_done: Callable[[], None] | None = None,
                 deadline: float | None = None, idle_s: float | None = None) -> None:
        self._resp = resp
        self._on_done = on_done
        self.endpoint = endpoint
        self.status = resp.status
        self.deadline = deadline
        self.idle_s = idle_s
        self._first = True
        hs = []
        stream = False
        has_len = False
        for k, v in resp.raw_headers:
            lk = k.lower()
            if lk == b"content-length":
                has_len = True
            if lk in HOP_BY_HOP:
                continue
            if lk == b"content-type" and v.startswith(b"text/event-stream"):
                stream = True
            hs.append((lk, v))
        self.headers = hs
        self.is_stream = stream or not has_len

    async def _next(self) -> bytes:
        """The next body bytes (b"" at the end), within the first-byte deadline for the first read
        and the idle timeout for later ones. Raises TransportError (timeout / stream_broken)."""
        content = self._resp.content
        try:
            while True:
                data = content.read_nowait(-1)
                if not data:
                    if content.is_eof():
                        self._first = False
                        return b""
                    if self._first:
                        wait = None if self.deadline is None else self.deadline - asyncio.get_running_loop().time()
                        what = "first byte"
                    else:
                        wait, what = self.idle_s, "idle gap between chunks"
                    try:
                        async with asyncio.timeout(wait):
                            data = await content.readany()
                    except TimeoutError:
                        self._resp.close()
                        raise TransportError("timeout", self.endpoint, f"no {what} within the timeout") from None
                    if not data and not content.is_eof():
                        continue
                self._first = False
                return data
        except (aiohttp.ClientError, ConnectionError) as e:
            self._resp.close()
            raise TransportError("stream_broken", self.endpoint, repr(e)) from None

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

    def _done(self) -> None:
        cb, self._on_done = self._on_done, None
        if cb is not None:
            cb()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive (no re-framing); raises TransportError on a broken or
        stalled stream (kind ``timeout`` when a gap exceeded the idle timeout)."""
        while True:
            chunk = await self._next()
            if not chunk:
                return
            yield chunk

    def complete(self) -> bool:
        """True when the whole body was received (the connection can be reused)."""
        return self._resp.content.is_eof()

    def release(self, abort: bool = False) -> None:
        """Give the connection back to the pool, or close it (``abort``: client left mid-stream,
        which also tells the worker to stop generating). Idempotent."""
        if abort or not self._resp.content.is_eof():
            self._resp.close()
        else:
            self._resp.release()
        self._done()


class Transport:
    """Pooled HTTP/1.1 forwarding to workers; see the module docstring.

    ``connect_timeout_s``: connect timeout (s); ``first_byte_timeout_s``: longest wait (s) from
    sending a request until the first body byte; ``idle_timeout_s``: longest gap (s) between two
    later body chunks; ``limit_per_endpoint``: pooled connections per worker (0 = no limit).
    """

    def __init__(self, connect_timeout_s: float = 2.0, first_byte_timeout_s: float = 600.0,
                 idle_timeout_s: float = 120.0, limit_per_endpoint: int = 0) -> None:
        self.timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=connect_timeout_s,
                                             sock_read=None)
        self.first_byte_timeout_s = first_byte_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.limit = limit_per_endpoint
        self._sessions: dict[str, tuple[aiohttp.ClientSession, str]] = {}
        # responses not yet released, per session; sessions of departed workers close when theirs hit 0
        self._active: dict[int, int] = {}
        self._retired: dict[int, aiohttp.ClientSession] = {}
        self._closing: set[asyncio.Task] = set()

    def _session(self, endpoint: str) -> tuple[aiohttp.ClientSession, str]:
        s = self._sessions.get(endpoint)
        if s is None or s[0].closed:
            if endpoint.startswith("/"):
                conn: aiohttp.BaseConnector = aiohttp.UnixConnector(path=endpoint, limit=self.limit,
                                                                    keepalive_timeout=30)
            else:
                conn = aiohttp.TCPConnector(limit=self.limit, keepalive_timeout=30, ttl_dns_cache=300)
            sess = aiohttp.ClientSession(connector=conn, timeout=self.timeout, auto_decompress=False,
                                         skip_auto_headers=_SKIP_AUTO, cookie_jar=aiohttp.DummyCookieJar())
            s = self._sessions[endpoint] = (sess, endpoint_url(endpoint))
        return s

    async def send(self, endpoint: str, method: str, path: str, headers: Iterable[tuple[str, str]],
                   body: bytes | None, timeout_s: float | None = None) -> Upstream:
        """Send one request (``path`` includes any query string) and return once the head is in.

        The head must arrive within the first-byte timeout (``timeout_s``, when given, bounds the
        whole request instead: health probes and control calls). Raises TransportError
        (``connect``, with ``refused`` when nothing accepted the connection, or ``timeout``)."""
        sess, base = self._session(endpoint)
        kw: dict[str, Any] = {}
        loop = asyncio.get_running_loop()
        if timeout_s is not None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
            deadline = None
        else:
            deadline = loop.time() + self.first_byte_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                resp = await sess.request(method, base + path, data=body, headers=list(headers),
                                          allow_redirects=False, compress=None, **kw)
        except aiohttp.ConnectionTimeoutError as e:
            # no connection within connect_timeout_s: nothing was sent, the worker is unreachable
            err = TransportError("connect", endpoint, repr(e))
            err.refused = True
            raise err from None
        except (TimeoutError, aiohttp.ServerTimeoutError) as e:
            raise TransportError("timeout", endpoint, f"no response head within the timeout ({e!r})") from None
        except (aiohttp.ClientError, ConnectionError, OSError) as e:
            err = TransportError("connect", endpoint, repr(e))
            # nothing listens (socket file gone, port closed): the worker is down, not slow
            err.refused = isinstance(e, (aiohttp.ClientConnectorError, ConnectionRefusedError, FileNotFoundError))
            # reset / broken pipe before any response byte: the request reached a socket its process
            # no longer reads (a pooled connection of a worker that just died): it never saw it
            err.unsent = err.refused or getattr(e, "errno", None) in (errno.ECONNRESET, errno.EPIPE)
            raise err from None
        key = id(sess)
        self._active[key] = self._active.get(key, 0) + 1
        return Upstream(resp, endpoint, lambda: self._finished(key), deadline,
                        None if timeout_s is not None else self.idle_timeout_s)

    def _finished(self, key: int) -> None:
        n = self._active.get(key, 1) - 1
        if n > 0:
            self._active[key] = n
            return
        self._active.pop(key, None)
        sess = self._retired.pop(key, None)
        if sess is not None:
            t = asyncio.get_running_loop().create_task(sess.close())
            self._closing.add(t)
            t.add_done_callback(self._closing.discard)

    async def get(self, endpoint: str, path: str, timeout_s: float, method: str = "GET") -> tuple[int, bytes]:
        """Small control request (probes, state mirroring, an agent's ``POST /dplb/restart``):
        ``(status, body)`` within ``timeout_s`` seconds. Raises TransportError."""
        up = await self.send(endpoint, method, path, (), None, timeout_s=timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                body = await up.read()
        except TimeoutError:
            up.release(abort=True)
            raise TransportError("timeout", endpoint, "reading body") from None
        return up.status, body

    async def forget(self, endpoint: str) -> None:
        """Close the pool of a worker that left (removed, restarted, gone). Requests still in flight
        on it keep their connections: the pool closes when the last of them is released (closing it
        under a live stream would cut — or hang — a request the worker is still answering)."""
        s = self._sessions.pop(endpoint, None)
        if s is None:
            return
        if self._active.get(id(s[0])):
            self._retired[id(s[0])] = s[0]
        else:
            await s[0].close()

    async def close(self) -> None:
        """Close every pooled connection."""
        sessions, self._sessions = list(self._sessions.values()), {}
        retired, self._retired = list(self._retired.values()), {}
        for s in [x for x, _ in sessions] + retired:
            await s.close()
