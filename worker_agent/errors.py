"""Errors raised inside the worker agent.

Every error carries fields (worker id, engine, reason, exit code). Requests never reach the agent
(one hop: routers forward to the engine), so these are about the engine's lifecycle and the
command line; the control API renders the few it answers with :func:`dplb_protocol.wire.error_body`::

    AgentError                      base class; .worker_id, .reason
    ├── ConfigError                 a command-line flag or combination is invalid (.field, .value)
    ├── EngineError                 something about the engine; .engine
    │   ├── EngineStartError        the engine did not become ready (exited, timed out, warm-up failed)
    │   ├── EngineExitedError       the engine process exited unexpectedly; .exit_code
    │   └── UpstreamError           a control request to the engine (health, warm-up, metrics) failed
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
    """The engine process exited while the agent expected it to run; ``exit_code`` as from ``wait()``;
    ``hint``: what the adapter read in the engine's log about why (appended to the message)."""

    def __init__(self, exit_code: int | None, *, engine: str = "", worker_id: int | None = None,
                 hint: str = "") -> None:
        super().__init__(f"engine {engine or '?'} exited unexpectedly with code {exit_code}"
                         + (f": {hint}" if hint else ""), engine=engine, worker_id=worker_id)
        self.exit_code = exit_code


class UpstreamError(EngineError):
    """Connecting to or reading from the engine failed (connection refused, reset, timeout)."""

    http_status = 502
    error_type = "bad_gateway"
