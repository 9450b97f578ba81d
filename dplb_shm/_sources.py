"""Fingerprint of the native sources, baked into the extension at build time.

``setup.py`` loads this file by path (the package itself cannot be imported before the extension
exists) and passes :func:`source_hash` to the compiler as ``DPLB_SOURCE_SHA256``; on import,
``dplb_shm`` recomputes it from ``csrc/`` when the source tree is present and refuses a stale build.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

SOURCES = ("dplb_shm.h", "dplb_kernel.h", "dplb_native.pxd", "dplb_native.pyx", "dplb_segment.pxi",
           "dplb_writer.pxi")


def source_hash(csrc: str | Path) -> str | None:
    """SHA-256 (hex) over the native source files in ``csrc``; None when any is missing."""
    h = hashlib.sha256()
    for name in SOURCES:
        p = Path(csrc) / name
        try:
            data = p.read_bytes()
        except OSError:
            return None
        h.update(name.encode() + b"\0" + data + b"\0")
    return h.hexdigest()
