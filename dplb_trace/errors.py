"""The error a trace that cannot be used raises (the Mooncake reader, the simulator's Azure CSV
reader); a ``ValueError``, so callers that check inputs catch it with the rest."""
from __future__ import annotations


class TraceFormatError(ValueError):
    """A trace line is invalid. Attributes: ``path`` (str), ``line`` (1-based int), ``reason``."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason
