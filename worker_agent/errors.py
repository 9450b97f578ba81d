"""Errors raised inside the worker agent.

Every error carries fields (worker id, engine, reason, exit code); mapping an error to an HTTP
status and an OpenAI-shaped body happens once, at the edge (:func:`worker_agent.relay.error_response`)::

    AgentError                      base class; .worker_id, .reason
    ├── ConfigError                 a command-line flag or combination is invalid (.field, .value)
    ├── EngineError                 something about the engine; .engine
    │   ├── EngineStartError        the engine did not become ready (exited, timed out, warm-up failed)
    │   ├── EngineExitedError       the engine process exited unexpectedly; .exit_code
    │   └── UpstreamError           a request to the engine failed at the transport level (502)
    │       └── EngineUnavailableError  nothing accepted the connection: no work began (503)
    ├── NotReadyError               the agent is starting, draining or dead; .state (answered 503)
    ├── QueueFullError              --max-queue reached (answered 429 with Retry-After)
    └── BadRequestError             the request body cannot be read (answered 400)
        └── PayloadTooLargeError    the request body exceeds the relay's limit (answered 413)
"""
from __future__ import annotations


class AgentError(Exception):
    """Base class of every worker-agent error.

    Args:
        reason: human-readable explanation (becomes the OpenAI error ``message``).
        worker_id: the agent's worker id, when known.
    """

    #: HTTP status used when this error reaches a client (the edge maps it; nothing else does)
    http_status: int = 500
    #: OpenAI error ``type``
    error_type: str = "internal_error"

    def __init__(self, reason: str, *, worker_id: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.worker_id = worker_id


class ConfigError(AgentError):
    """A flag (``field``) has an invalid ``value``; raised while parsing the command line."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field = field
        self.value = value


class EngineError(AgentError):
    """Base class of errors about the engine behind the agent (``engine`` = adapter name)."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, reason: str, *, engine: str = "", worker_id: int | None = None) -> None:
        super().__init__(reason, worker_id=worker_id)
        self.engine = engine


class EngineStartError(EngineError):
    """The engine did not become ready: it exited during start-up, timed out, or failed warm-up."""


class EngineExitedError(EngineError):
    """The engine process exited while the agent expected it to run; ``exit_code`` as from ``wait()``."""

    def __init__(self, exit_code: int | None, *, engine: str = "", worker_id: int | None = None) -> None:
        super().__init__(f"engine {engine or '?'} exited unexpectedly with code {exit_code}",
                         engine=engine, worker_id=worker_id)
        self.exit_code = exit_code


class UpstreamError(EngineError):
    """Connecting to or reading from the engine failed (connection refused, reset, timeout)."""

    http_status = 502
    error_type = "bad_gateway"


class EngineUnavailableError(UpstreamError):
    """The engine refused the connection (not listening: dead or restarting), so nothing reached
    it and the request cost it nothing; answered 503 with ``Retry-After`` so that a router may try
    another worker."""

    http_status = 503
    error_type = "service_unavailable"


class NotReadyError(AgentError):
    """The agent cannot take a request in its current lifecycle ``state`` (a ``WorkerState`` name)."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, state: str, *, worker_id: int | None = None) -> None:
        super().__init__(f"worker {worker_id} is {state.lower()}, not taking requests", worker_id=worker_id)
        self.state = state


class QueueFullError(AgentError):
    """The agent already holds ``limit`` requests in flight (``--max-queue``)."""

    http_status = 429
    error_type = "rate_limit_exceeded"

    def __init__(self, limit: int, *, worker_id: int | None = None) -> None:
        super().__init__(f"worker {worker_id} has {limit} requests in flight (--max-queue {limit})",
                         worker_id=worker_id)
        self.limit = limit


class BadRequestError(AgentError):
    """The request body could not be read (not JSON where JSON is required, too large)."""

    http_status = 400
    error_type = "invalid_request_error"


class PayloadTooLargeError(BadRequestError):
    """The request body is larger than ``limit`` bytes."""

    http_status = 413

    def __init__(self, limit: int, *, worker_id: int | None = None) -> None:
        super().__init__(f"request body larger than {limit} bytes", worker_id=worker_id)
        self.limit = limit
