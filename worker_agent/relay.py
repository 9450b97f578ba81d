"""The agent's HTTP face: a raw ASGI relay for the engine API plus a small FastAPI control app.

Routing (on the agent's Unix socket):

- ``GET /health`` → 200 only when the agent is READY, else 503 (FastAPI control app);
- ``GET /dplb/state`` → the slot as JSON (``WorkerSnapshot.to_dict()``) (control app);
- anything else (``/v1/*``, ``/generate``, ``/tokenize``, ``/v1/chat/completions/render``,
  ``/metrics``, ...) → relayed to the engine with method, path, query, headers (hop-by-hop ones
  excepted) and body untouched; the response is streamed back chunk by chunk as it arrives.

The relay is plain ASGI rather than a FastAPI route because it is a hop on every request: it reads
the body once, estimates the prompt length, and forwards. While a request is relayed a watcher
waits on ``receive()``; when the router disconnects (``http.disconnect``) the relay task is
cancelled, which drops the engine connection so the engine aborts the request.

Errors become OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``) here and
only here (:func:`error_response`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson

from .errors import (
    AgentError,
    BadRequestError,
    EngineUnavailableError,
    PayloadTooLargeError,
    UpstreamError,
)
from .meter import RequestMeter, estimate_prompt_tokens
from .upstream import Upstream

log = logging.getLogger("worker_agent.relay")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: request bodies above this size are refused with 413 (a 128k-token prompt is ~1 MB of text)
MAX_BODY_BYTES = 64 * 1024 * 1024

#: POST paths that do not run inference and so do not count as in-flight work
_NOT_INFERENCE = ("/tokenize", "/detokenize")


class RequestSink(Protocol):
    """What the relay tells the agent about each request (implemented by ``Agent``)."""

    worker_id: int

    def admit(self, counted: bool) -> None:
        """Raise ``NotReadyError``/``QueueFullError`` when the request must be refused."""

    def on_start(self, prompt_tokens: int) -> None:
        """A counted request entered the agent (slot: in-flight +1, queued prompt tokens)."""

    def on_finish(self, prompt_tokens: int, ttft_ms: float | None, tpot_ms: float | None,
                  e2e_ms: float | None, outcome: str) -> None:
        """A counted request left; ``outcome`` is ``ok``, ``failed`` or ``aborted``."""


def error_body(err: AgentError | None = None, *, message: str = "", status: int = 500,
               error_type: str = "internal_error", param: str | None = None) -> tuple[int, bytes]:
    """``(status, OpenAI-shaped JSON body)`` for an error (from ``err`` when given)."""
    if err is not None:
        status, message, error_type = err.http_status, err.reason, err.error_type
        param = getattr(err, "field", None)
    return status, orjson.dumps({"error": {"message": message, "type": error_type, "param": param,
                                           "code": status}})


async def error_response(send: Send, err: AgentError | None = None, **kw: Any) -> None:
    """Send an OpenAI-shaped error response (with ``Retry-After`` on 429/503)."""
    status, body = error_body(err, **kw)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status in (429, 503):
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _Disconnected(Exception):
    """The router closed the connection while the request was being relayed."""


class RelayApp:
    """ASGI app: control paths to ``control_app``, everything else to the engine.

    Args:
        sink: the agent (admission, slot updates).
        get_upstream: returns the engine's current :class:`Upstream` (None while there is none).
        control_app: ASGI app for ``/health`` and ``/dplb/*``.
        max_body_bytes: larger request bodies are answered 413.
    """

    def __init__(self, sink: RequestSink, get_upstream: Callable[[], Upstream | None], control_app: Any,
                 *, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.sink = sink
        self.get_upstream = get_upstream
        self.control_app = control_app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return  # lifespan is off; websockets are not relayed
        path: str = scope["path"]
        if path == "/health" or path.startswith("/dplb/"):
            await self.control_app(scope, receive, send)
            return
        started = False

        async def tracking_send(msg: dict[str, Any]) -> None:
            nonlocal started
            started = started or msg["type"] == "http.response.start"
            await send(msg)

        try:
            await self.relay(scope, receive, tracking_send)
        except Exception:  # a bug here must still answer OpenAI-shaped, and be logged
            log.exception("relay of %s %s failed", scope.get("method"), path)
            if not started:
                await error_response(send, message="internal error in the worker agent", status=500)

    async def _read_body(self, receive: Receive) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = msg.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise PayloadTooLargeError(self.max_body_bytes)
                parts.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(parts)

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay one request to the engine and its response back, measuring and counting it."""
        t0 = time.monotonic_ns()
        method: str = scope["method"]
        path: str = scope["path"]
        try:
            body = await self._read_body(receive)
        except _Disconnected:
            return
        except BadRequestError as e:
            await error_response(send, e)
            return
        counted = method == "POST" and not path.startswith(_NOT_INFERENCE) and not path.endswith("/render")
        try:
            self.sink.admit(counted)
        except AgentError as e:
            await error_response(send, e)
            return
        upstream = self.get_upstream()
        if upstream is None:
            await error_response(send, EngineUnavailableError("no engine to relay to", worker_id=self.sink.worker_id))
            return
        prompt = estimate_prompt_tokens(body) if counted else 0
        qs = scope.get("query_string", b"")
        target = (scope.get("raw_path") or path.encode()).decode("latin-1")
        if qs and "?" not in target:
            target += "?" + qs.decode("latin-1")
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]

        if counted:
            self.sink.on_start(prompt)
        outcome = "failed"
        meter: RequestMeter | None = None
        task = asyncio.current_task()
        assert task is not None
        disconnected = False

        async def watch() -> None:
            nonlocal disconnected
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    disconnected = True
                    task.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        resp = None
        body_done = False
        try:
            try:
                resp = await upstream.open(method, target, headers, body)
            except UpstreamError as e:
                await error_response(send, e)
                return
            meter = RequestMeter(t0, resp.content_type.startswith("text/event-stream"))
            await send({"type": "http.response.start", "status": resp.status, "headers": resp.headers})
            try:
                async for chunk in resp.chunks():
                    meter.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except UpstreamError as e:
                log.warning("%s %s: %s", method, path, e)
                resp.close(abort=True)
                resp = None
                # headers are gone already: an SSE stream ends with an OpenAI-shaped error event (so
                # clients and the router see a failure, not a silently truncated answer); other
                # bodies just end
                tail = b""
                if meter.streaming:
                    tail = b"data: " + error_body(e)[1] + b"\n\n"
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            body_done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            # 4xx: the engine answered (the request was bad), so not an engine failure
            outcome = "ok" if resp.status < 500 else "failed"
        except asyncio.CancelledError:
            if not disconnected:
                raise
            task.uncancel()
            outcome = "aborted"
            if resp is not None:
                resp.close(abort=True)
                resp = None
        finally:
            watcher.cancel()
            if resp is not None:
                resp.close(abort=not body_done)   # a fully read response returns its connection to the pool
            if counted:
                ttft = tpot = e2e = None
                # latency windows hold successful answers only (fast 4xx errors would flatter them)
                if meter is not None and outcome == "ok" and resp is not None and resp.status < 400:
                    ttft, tpot, e2e = meter.finish()
                self.sink.on_finish(prompt, ttft, tpot, e2e, outcome)
