"""Errors of the benchmark tools (trace loading, replay).

::

    BenchError
    ├── TraceFormatError    a trace line that cannot be used (file, line, reason)
    └── ReplayError         the replay cannot start (endpoint unreachable, no model served)
"""
from __future__ import annotations


class BenchError(Exception):
    """Base of the benchmark tools' errors."""


class TraceFormatError(BenchError, ValueError):
    """A trace line is invalid. Attributes: ``path`` (str), ``line`` (1-based int), ``reason``."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason


class ReplayError(BenchError):
    """The replay cannot run against the given endpoint (``url``) for ``reason``."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
