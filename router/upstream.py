"""A worker's response after its head arrived (:class:`Upstream`), as
:meth:`router.transport.Transport.send` returns it: its status and headers, then its body through
:meth:`Upstream.first_chunk` / :meth:`~Upstream.read` / :meth:`~Upstream.chunks` /
:meth:`~Upstream.pipe`, within the first-byte and idle timeouts; :meth:`Upstream.release` gives
its connection back to the pool (or drops it: how the engine learns to abort)."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from dplb_protocol.wire import HOP_BY_HOP
from router.connection import Connection, Pool, running_loop
from router.errors import TransportError

if TYPE_CHECKING:
    from router._relay import ChunkRelay


class Upstream:
    """A worker's response after its head arrived. ``status`` int; ``headers``: list of
    (name, value) bytes pairs without hop-by-hop ones (names lower-case); ``is_stream``: SSE or
    chunked without length. Call :meth:`release` exactly once (``read`` does it for you).
    ``deadline``: event-loop time (s) by which the first body byte must arrive; ``idle_s``: the
    longest gap (s) between two later chunks."""

    __slots__ = ("_conn", "_first", "_on_done", "_pool", "answered", "deadline", "endpoint", "headers", "idle_s",
                 "is_stream", "request_id", "status", "whole")

    def __init__(self, conn: Connection, pool: Pool, endpoint: str, on_done: Callable[[], None] | None = None,
                 deadline: float | None = None, idle_s: float | None = None) -> None:
        self._conn = conn
        self._pool: Pool | None = pool
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
                wait = None if self.deadline is None else self.deadline - running_loop().time()
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
                   handoff: Callable[[], ChunkRelay | None] | None = None) -> None:
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
            c.end_relay()

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


__all__ = ["Upstream"]
