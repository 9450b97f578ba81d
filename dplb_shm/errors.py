"""Errors raised by :mod:`dplb_shm`. Mapping to HTTP status or exit codes happens at the edge.

::

    Exception
     └── SegmentError                       any segment problem; fields: name, reason
          ├── SegmentExistsError            (also FileExistsError) create() without replace
          ├── SegmentNotFoundError          (also FileNotFoundError) attach()/unlink() of no segment
          ├── LayoutMismatchError           wrong magic or layout version; names both versions
          ├── SegmentClosedError            use after close()
          ├── SlotIndexError                (also IndexError) slot outside 0..num_slots-1
          └── SlotFieldError                (also ValueError) a field value that cannot be stored
    ImportError
     └── NativeBuildError                   extension missing or stale: run `make build`
"""
from __future__ import annotations


class SegmentError(Exception):
    """A shared-memory segment operation failed.

    Attributes: ``name`` (segment name, no leading slash, or None), ``reason`` (short text).
    """

    def __init__(self, message: str, *, name: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.name = name
        self.reason = reason or message


class SegmentExistsError(SegmentError, FileExistsError):
    """``Segment.create`` found a segment of that name and ``replace`` was false."""


class SegmentNotFoundError(SegmentError, FileNotFoundError):
    """No segment of that name exists in /dev/shm."""


class LayoutMismatchError(SegmentError):
    """The segment's magic or layout version differs from this build's.

    Attributes: ``found_magic``, ``found_version``, ``expected_version``.
    """

    def __init__(self, message: str, *, name: str | None = None, found_magic: int = 0,
                 found_version: int = 0, expected_version: int = 0) -> None:
        super().__init__(message, name=name, reason="layout mismatch")
        self.found_magic = found_magic
        self.found_version = found_version
        self.expected_version = expected_version


class SegmentClosedError(SegmentError):
    """The segment (or a writer on it) was used after ``close()``."""


class SlotIndexError(SegmentError, IndexError):
    """A slot index outside ``0..num_slots-1``. Attribute ``slot``."""

    def __init__(self, message: str, *, name: str | None = None, slot: int = -1) -> None:
        super().__init__(message, name=name, reason="slot out of range")
        self.slot = slot


class SlotFieldError(SegmentError, ValueError):
    """A slot field value that cannot be stored (too long, out of range, unknown field).

    Attribute ``field``.
    """

    def __init__(self, message: str, *, field: str, name: str | None = None) -> None:
        super().__init__(message, name=name, reason=f"bad field {field}")
        self.field = field


class NativeBuildError(ImportError):
    """The native extension ``dplb_shm._native`` is missing or was built from other sources."""
