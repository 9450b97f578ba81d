"""Find DPLB segments in /dev/shm by their magic, without mapping them."""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from dplb_shm import _native

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class SegmentInfo:
    """What the first 16 bytes of a /dev/shm file say: ``version`` and ``num_slots`` as stored."""

    name: str
    version: int
    num_slots: int
    size: int

    @property
    def compatible(self) -> bool:
        """True when this build can attach it (same layout version)."""
        return self.version == _native.LAYOUT_VERSION


def list_segments(shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Every readable file in ``shm_dir`` that starts with DPLB's magic, sorted by name.

    Files we may not read, or that are shorter than 16 bytes, are skipped.
    """
    out: list[SegmentInfo] = []
    try:
        names = sorted(os.listdir(shm_dir))
    except OSError:
        return out
    for n in names:
        p = os.path.join(shm_dir, n)
        try:
            with open(p, "rb") as f:
                raw = f.read(16)
                size = os.fstat(f.fileno()).st_size
        except OSError:
            continue
        if len(raw) < 16:
            continue
        magic, version, num_slots = struct.unpack("<QII", raw)
        if magic == _native.MAGIC:
            out.append(SegmentInfo(n, version, num_slots, size))
    return out
