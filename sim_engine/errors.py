"""Errors raised by the simulated engine.

::

    SimEngineError                      base of everything this package raises on purpose
    ├── InvalidRequestError             bad request body or parameter  -> HTTP 400 (OpenAI shape)
    │   └── ContextLengthError          prompt + max_tokens exceed --max-model-len -> HTTP 400
    ├── ModelNotFoundError              "model" names a model this engine does not serve -> HTTP 404
    └── EngineCapacityError             a request can never fit in the KV cache -> HTTP 400

Errors carry fields (``message``, ``param``, ``code``); mapping them to an HTTP status and the
OpenAI error body ``{"error": {"message", "type", "param", "code"}}`` happens only at the edge
(:func:`sim_engine.server.error_response`).
"""

from __future__ import annotations


class SimEngineError(Exception):
    """Base class. ``status`` is the HTTP status the server answers with; ``type`` the OpenAI type."""

    status: int = 500
    type: str = "internal_server_error"

    def __init__(self, message: str, param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.status

    def to_dict(self) -> dict:
        """The OpenAI-shaped error body ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(SimEngineError):
    """The request body or one of its parameters is invalid (HTTP 400, ``BadRequestError``)."""

    status = 400
    type = "BadRequestError"


class ContextLengthError(InvalidRequestError):
    """Prompt tokens plus requested output tokens exceed the model's context (``--max-model-len``)."""


class EngineCapacityError(InvalidRequestError):
    """The request needs more KV-cache blocks than the whole cache holds, so it could never run."""


class ModelNotFoundError(SimEngineError):
    """The request names a model other than the one this engine serves (HTTP 404)."""

    status = 404
    type = "NotFoundError"
