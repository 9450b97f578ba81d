"""A non-streamed request answered without a task: the plain outcome served from callbacks.

A request :meth:`router.proxy.Proxy.start` wrote to an idle pooled connection of its worker from
the router's protocol callback usually ends one way: the engine's whole answer (head and a body
with a Content-Length) comes in one read, it is written to the client from the engine
connection's callback (:func:`router.server.write_response`), then counted and logged. Its task
(created, stepped twice, woken by a future, through the proxy's coroutine chain) then does only
that bookkeeping. :class:`QuickAnswer` does it from the same callback instead, and runs the
request's task only when anything else happens, at that moment (:meth:`LaterTask.spawn`):

- the answer is not that plain: a stream or a body still arriving, a status the proxy retries
  (``retries.retry_on_status``), relays as the worker's error (5xx) or refuses (1xx, 499), an
  engine-side abort, a client transport above its high-water mark;
- the engine's connection fails or ends before the answer;
- the first-byte deadline (``router.first_byte_timeout_s``, from the write) passes;
- the client leaves (the protocol's callback, :func:`router.server.watch_disconnect`);
- the router's stop reaches its drain limit (:meth:`LaterTask.cancel`).

The task then finds everything where it would have found it (the connection with whatever came
in, the deadline of the write, the client's state) and serves the request as before: retries,
504, the 499 of a client that left, the 503 of a drain cut, a stream's relay
(:meth:`router.proxy.Proxy.forward`). The bookkeeping of a plain answer is the task path's own
(``settle``: :meth:`router.proxy.Proxy.settle_whole`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from router.asgi import ASGIApp, Scope
from router.connection import Connection
from router.director import CLIENT_CLOSED, Director
from router.exchange import Attempt, Exchange, relayed_headers
from router.logtext import text
from router.server import (
    LaterTask,
    LimitedHttpToolsProtocol,
    watch_disconnect,
    write_response,
)
from router.upstream import Upstream

log = logging.getLogger("dplb.router.quick")


class QuickAnswer(LaterTask):
    """The taskless serving of ``ex``, already written on ``att.written`` (module docstring).
    ``app``: the request's task, run only if needed; ``first_byte_s``: the first-byte timeout (s,
    from now: ``router.first_byte_timeout_s``); ``retry_status``: the statuses the proxy retries; ``settle(ex, att,
    status, body)``: the task path's bookkeeping of a whole answer written to the client."""

    __slots__ = ("_first_byte_s", "_timer", "_unwatch", "att", "director", "ex", "retry_status", "settle")

    def __init__(self, app: ASGIApp, ex: Exchange, att: Attempt, first_byte_s: float, retry_status: frozenset[int],
                 director: Director, settle: Callable[[Exchange, Attempt, int, bytes], None]) -> None:
        super().__init__(app)
        self.ex = ex
        self.att = att
        self._first_byte_s = first_byte_s
        self.retry_status = retry_status
        self.director = director
        self.settle = settle
        self._timer: asyncio.TimerHandle | None = None
        self._unwatch: Callable[[], None] | None = None

    def bind(self, proto: LimitedHttpToolsProtocol, cycle: RequestResponseCycle) -> None:
        """Listed among the protocol's tasks; then watch the engine's connection, the deadline and
        the client."""
        super().bind(proto, cycle)
        scope: Scope = cycle.scope  # type: ignore[assignment]
        self.ex.scope = scope
        att = self.att
        c = att.written
        assert c is not None
        loop = proto.loop
        att.deadline = loop.time() + self._first_byte_s
        self._timer = loop.call_at(att.deadline, self._late)
        c.quick = self._engine
        self._unwatch = watch_disconnect(scope, self._gone)
        if self.ended:              # the client had left already: its task took over
            return
        if self._unwatch is None:   # (not this protocol's request: cannot happen) the task watches
            self._escalate()
        elif c.error is not None or c.head_done:   # (nothing was read yet in this callback)
            self._engine(c)

    def _stop_watching(self) -> None:
        c = self.att.written
        if c is not None and c.quick is not None:
            c.quick = None
        t, self._timer = self._timer, None
        if t is not None:
            t.cancel()
        u, self._unwatch = self._unwatch, None
        if u is not None:
            u()

    def spawn(self) -> asyncio.Task[None] | None:
        """Stop watching, then run the request's task (:meth:`LaterTask.spawn`): from here on only
        the task reads the engine's connection, also when the stop's drain limit spawns it
        (:meth:`LaterTask.cancel`); an answer read meanwhile is the task's, never written and
        pooled a second time from here."""
        self._stop_watching()
        return super().spawn()

    def _escalate(self) -> None:
        """Anything but the plain outcome: the request's task takes over from here."""
        self.spawn()

    def _late(self) -> None:
        self._timer = None
        self._escalate()        # the task finds the deadline passed: a timeout, as before

    def _gone(self) -> None:
        self._escalate()        # the task finds its client gone: cancelled, counted 499

    def _engine(self, c: Connection) -> None:
        """A network event on the engine's connection (``Connection.quick``)."""
        if self.ended:
            return              # (the task has it)
        if c.error is None and not c.head_done:
            return              # the head is not complete yet
        if c.error is None and c.done and self._answer(c):
            return
        self._escalate()

    def _answer(self, c: Connection) -> bool:
        """Write the whole answer in ``c`` to the client and settle the request, when it is the
        plain outcome (else False: nothing taken from ``c``, nothing written)."""
        st = c.status
        if not 200 <= st < 500 or st in self.retry_status or st == CLIENT_CLOSED:
            return False
        ex, att = self.ex, self.att
        h, pool = att.handle, c.home
        if pool is None:
            return False
        up = Upstream(c, pool, h.endpoint)
        if up.is_stream:
            return False
        body = c.body
        data = body[0] if len(body) == 1 else b"".join(body)
        if self.director.aborted_before_content(data, False) or ex.scope is None or \
                not write_response(ex.scope, st, relayed_headers(up, ex.rid, h.label_b), data):
            return False
        c.take()
        self._stop_watching()
        up.release()
        att.lease.head_seen()
        att.outcome = True
        try:
            self.settle(ex, att, st, data)
        except Exception:   # a bug: logged as uvicorn logs an ASGI app's exception; the answer is out
            log.exception("request %s: settling its answer failed", text(ex.rid))
        finally:
            att.lease.finish(True)
            self.done()
        return True
