"""The answers the router makes itself (not relayed from a worker), written as raw ASGI
messages: a JSON body with its ``Content-Length`` and ``X-DPLB-Worker-ID: none`` (the worker the
answer is about, for a 502/504 on one), and a :class:`router.errors.RouterError` rendered as
OpenAI's error shape with its own headers (``Retry-After``) and the request id."""
from __future__ import annotations

from dplb_protocol.wire import WORKER_HEADER_B as _XWID
from router.errors import RouterError
from router.exchange import Send

_XRID = b"x-request-id"
_JSON = (b"content-type", b"application/json")
_NONE = b"none"


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
