"""Errors raised inside the router, and their OpenAI-shaped rendering.

Tree (HTTP status in brackets; rendered only at the edge, by :func:`dplb_protocol.wire.error_body`)::

    RouterError                         base; carries status, type, code, param
    ├── BadRequest          [400]       malformed JSON, wrong field types
    ├── Unauthorized        [401]       missing/wrong API key or admin token
    ├── Forbidden           [403]       admin call from a non-loopback client
    ├── NotFound            [404]       unknown model, unknown (or already removed) worker id, unknown path
    ├── MethodNotAllowed    [405]       a proxied path asked with another method than POST (Allow: POST)
    ├── Conflict            [409]       admin add of an address another worker (a local agent) holds, or
    │                                   that a concurrent remove undid before it got a slot
    ├── BodyTooLarge        [413]       request body above ``max_body_bytes``
    ├── UnsupportedMediaType [415]      a Content-Type other than application/json
    ├── HeadersTooLarge     [431]       request headers above ``max_header_bytes`` / ``max_headers``
    ├── NotSupported        [501]       the worker has no such API (admin restart of a non-agent)
    ├── Overloaded          [429]       the admission queue shed the request (Retry-After; budget, deadline, full)
    ├── NoEligibleWorker    [503]       no ready worker can take the request (Retry-After)
    ├── NoFreeSlot          [503]       admin add of a remote worker with every segment slot taken
    ├── DrainCut            [503]       the router stopped: its drain limit cut a request not yet
    │                                   answered (Retry-After: another router, or this one restarted)
    ├── UpstreamError       [502]       the worker failed (refused, dropped, 5xx) and no retry helped
    ├── GatewayTimeout      [504]       the worker did not answer within the first-byte timeout
    └── ConfigError         (no HTTP)   invalid dplb.yaml / flags; names the field

The OpenAI error body, the SSE error event and the base class :class:`RouterError`
(= :class:`dplb_protocol.wire.OpenAIError`) live in :mod:`dplb_protocol.wire`, with ``code`` the HTTP status
as an int everywhere; :class:`BadRequest` too (request parsing raises it there).
"""
from __future__ import annotations

from typing import TypedDict, Unpack

from dplb_protocol.wire import BadRequest, error_body, sse_error_event
from dplb_protocol.wire import OpenAIError as RouterError


class ErrorFields(TypedDict, total=False):
    """The keyword fields an error subclass passes on to :class:`RouterError` (``param``: the
    request field at fault, as in the OpenAI error body)."""

    param: str | None


class Unauthorized(RouterError):
    """Missing or wrong API key / admin token (401)."""

    status = 401
    type = "authentication_error"


class Forbidden(RouterError):
    """Admin endpoint called from a non-loopback client while admin is loopback-only (403)."""

    status = 403
    type = "permission_error"


class NotFound(RouterError):
    """Unknown model, worker or path (404)."""

    status = 404
    type = "not_found_error"


class MethodNotAllowed(RouterError):
    """A method other than ``POST`` on a path only ``POST`` serves (405 + ``Allow: POST``)."""

    status = 405
    type = "invalid_request_error"

    def __init__(self, method: str, path: str, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(f"method {method} not allowed on {path}; use POST", headers={"allow": "POST"}, **kw)


class Conflict(RouterError):
    """An admin call that contradicts the current state (409): adding an address a local agent's
    slot already holds, or a remote worker that a concurrent remove undid before it got a slot."""

    status = 409
    type = "conflict_error"


class BodyTooLarge(RouterError):
    """Body larger than the configured ``max_body_bytes`` (413)."""

    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(RouterError):
    """The request names a Content-Type other than ``application/json`` (415), as vLLM's OpenAI
    server answers (``vllm/entrypoints/utils.py``: ``validate_json_request``)."""

    status = 415
    type = "invalid_request_error"


class HeadersTooLarge(RouterError):
    """Request headers larger in total than ``router.max_header_bytes`` or more numerous than
    ``router.max_headers`` (431 Request Header Fields Too Large, RFC 6585 §5)."""

    status = 431
    type = "invalid_request_error"


class NotSupported(RouterError):
    """The worker does not offer the requested operation (501), e.g. an admin restart of an
    endpoint that is not a DPLB agent."""

    status = 501
    type = "not_implemented"


class NoEligibleWorker(RouterError):
    """No worker can take the request now (503 + ``Retry-After``).

    ``reason`` names why (``no_workers``, ``all_excluded``, ...); ``retry_after`` is seconds.
    """

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str = "no worker can take the request now", *, reason: str = "no_workers",
                 retry_after: int = 1, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after)}, **kw)
        self.reason = reason
        self.retry_after = retry_after


class Overloaded(RouterError):
    """The admission queue shed the request (429 + ``Retry-After`` + ``X-DPLB-Shed-Reason``):
    it waited its queue budget (``budget``), could no longer meet its deadline with
    ``admission.shed_late`` (``deadline``), or found the queue full (``full``). ``retry_after``
    in whole seconds (:meth:`router.admission.AdmissionQueue.retry_after`)."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, reason: str, retry_after: int = 1, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after), "x-dplb-shed-reason": reason}, **kw)
        self.reason = reason
        self.retry_after = retry_after


class NoFreeSlot(RouterError):
    """Adding a remote worker found every slot of the segment taken (503 + ``Retry-After``)."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 5, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after)}, **kw)


class DrainCut(RouterError):
    """The router's own stop reached its drain limit (``--drain-timeout``) before the request was
    answered: 503 + ``Retry-After`` (the client's retry reaches a router that serves: another
    replica, or this one restarted by the launcher), counted ``kind="drain_cut"``. A stream already
    started ends with the same error as an SSE event instead."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after)}, **kw)


class UpstreamError(RouterError):
    """Every attempt failed before the first response byte (502). ``worker_id``: the last one tried."""

    status = 502
    type = "upstream_error"

    def __init__(self, message: str, *, worker_id: int | None = None, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(message, **kw)
        self.worker_id = worker_id


class GatewayTimeout(RouterError):
    """The worker sent no first byte within ``router.first_byte_timeout_s`` (504). Not retried on
    another worker unless ``retries.retry_on_timeout``: the work may still be running there.
    ``worker_id``: the worker that timed out."""

    status = 504
    type = "timeout_error"

    def __init__(self, message: str, *, worker_id: int | None = None, **kw: Unpack[ErrorFields]) -> None:
        super().__init__(message, **kw)
        self.worker_id = worker_id


class ConfigError(ValueError):
    """Invalid configuration. ``field`` is the dotted path of the offending field."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"config field '{field}' = {value!r}: {reason}")
        self.field = field
        self.value = value
        self.reason = reason


class TransportError(Exception):
    """Forwarding to a worker failed. ``kind``: ``connect`` (refused, reset, closed before the
    response head), ``timeout`` (connect or read timeout) or ``stream_broken`` (after the head);
    ``endpoint``: the worker's socket path or host:port; ``refused``: True when nothing accepted the
    connection at all (refused, socket file missing) — the worker is down, not merely slow;
    ``unsent``: the worker's process never read the request (refused, or reset / broken pipe before
    any response byte), so trying another worker costs it nothing."""

    refused = False
    unsent = False

    def __init__(self, kind: str, endpoint: str, detail: str = "") -> None:
        super().__init__(f"{kind} error talking to {endpoint}: {detail}")
        self.kind = kind
        self.endpoint = endpoint
        self.detail = detail


__all__ = ["BadRequest", "BodyTooLarge", "ConfigError", "Conflict", "DrainCut", "Forbidden", "GatewayTimeout", "HeadersTooLarge",
           "NoEligibleWorker", "NoFreeSlot", "NotFound", "NotSupported", "Overloaded", "RouterError", "TransportError",
           "Unauthorized",
           "UnsupportedMediaType", "UpstreamError", "error_body", "sse_error_event"]
