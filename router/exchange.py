"""The request as the router holds it (:class:`Exchange`) and one try of it on one worker
(:class:`Attempt`), with the request-side helpers of the hot path (:func:`request_target`,
:func:`read_body`) and the headers a client gets with a worker's answer (:func:`relayed_headers`).

An :class:`Exchange` is made once per request, by :meth:`router.proxy.Proxy.start` or
:meth:`router.proxy.Proxy.__call__`, and carries what every attempt needs (method, target,
forwarded headers, body, the parsed :class:`~router.policies.base.RequestInfo`, request id,
arrival time, the ASGI ``send`` and ``scope``) and what the attempts so far left (the workers
tried, the last failure, the workers whose connection the request broke). An :class:`Attempt` is
the worker chosen for one try, its :class:`~router.scheduling.Lease`, the pooled connection the
request was already written on (or None) and the breaker verdict the lease is finished with.
"""
from __future__ import annotations

import asyncio
import urllib.parse
from dataclasses import dataclass, field

from dplb_protocol.wire import WORKER_HEADER_B as _XWID
from router.asgi import Message, Receive, Scope, Send
from router.connection import Connection
from router.errors import BadRequest, BodyTooLarge, NoEligibleWorker
from router.policies.base import RequestInfo
from router.scheduling import Lease
from router.upstream import Upstream
from router.workers import WorkerHandle

_XRID = b"x-request-id"

async def _no_send(message: Message) -> None:
    raise RuntimeError("the exchange has no client to answer yet")   # set by Proxy._serve


@dataclass(slots=True, eq=False)
class Exchange:
    """The request as the router holds it (module docstring). ``route``: the bounded metric label
    (a known path, else ``/v1/other``); ``target``: the request target forwarded to the engine
    (:func:`request_target`); ``headers``: the forwarded ones (hop-by-hop dropped, a minted
    ``X-Request-Id`` added); ``rid``: the request id; ``t0``: ``time.perf_counter()`` at arrival;
    ``scope``: the ASGI scope when the router's own protocol serves the request (its answers
    then bypass ``send``). The attempts' record: ``tried`` (worker ids), ``last`` and
    ``last_wid`` (the last failure and its worker), ``broken`` (workers whose connection the
    request broke after they read it), ``mid_body`` (the last attempt failed inside a
    non-streamed body) and ``no_worker`` (the pipeline had no worker for another attempt).
    ``cut``: a stream its client cut, ``(output tokens sent, TTFT s or None)`` for the 499 line;
    ``gone``: the client's connection closed (set by :meth:`router.proxy.Proxy._serve`): a
    cancellation of the request's task without it is the server's (the drain limit of a stop)."""

    method: str
    route: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    info: RequestInfo
    rid: bytes
    t0: float
    send: Send = _no_send
    scope: Scope | None = None
    tried: set[int] = field(default_factory=set)
    last: Exception | None = None
    last_wid: int | None = None
    broken: int = 0
    mid_body: bool = False
    no_worker: NoEligibleWorker | None = None
    cut: tuple[int, float | None] | None = None
    gone: bool = False

    def failed(self, wid: int, e: Exception) -> None:
        """Record that the attempt on worker ``wid`` failed with ``e`` before the first byte
        reached the client (the worker counts as tried)."""
        self.last, self.last_wid = e, wid
        self.tried.add(wid)


@dataclass(slots=True, eq=False)
class Attempt:
    """One try of an :class:`Exchange` on one worker: ``handle`` (the chosen worker), ``lease``
    (its load, released once with ``outcome``: True ok, False a failure for its breaker, None no
    verdict, e.g. the client left), ``written`` (the pooled connection the request was already
    written on, None: :meth:`router.transport.Transport.send` connects and writes) and
    ``number`` (0 for the first try)."""

    handle: WorkerHandle
    lease: Lease
    written: Connection | None
    number: int = 0
    outcome: bool | None = None
    #: the first-byte deadline (event-loop time, s) when it was set at the write (router.quick); None: from the send
    deadline: float | None = None


def relayed_headers(up: Upstream, rid: bytes, wid_b: bytes) -> list[tuple[bytes, bytes]]:
    """The headers a client gets with ``up``'s answer (a new list): the engine's, plus
    ``X-Request-Id: rid`` when the engine sent none, plus ``X-DPLB-Worker-ID: wid_b``."""
    if up.request_id is not None:
        return [*up.headers, (_XWID, wid_b)]
    return [*up.headers, (_XRID, rid), (_XWID, wid_b)]


_UNSAFE_IN_TARGET = frozenset(b" \r\n\x00")


def request_target(scope: Scope) -> str:
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
