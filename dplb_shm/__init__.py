"""dplb_shm: DPLB's shared-memory state plane and native scoring kernel.

One POSIX shm segment (``/dev/shm/<name>``) holds a header and one slot per worker. Each worker
agent is the single writer of its slot (seqlock, native code); router processes read every slot
lock-free and pick a worker with the native kernel. Layout: ``csrc/dplb_shm.h``; formula:
``csrc/dplb_kernel.h``; pure-Python reference: :mod:`dplb_shm.reference`.

The extension is required: a missing or stale build raises :class:`NativeBuildError` (an
ImportError) telling you to run ``make build``; there is no silent fallback to Python. It is
loaded at the first use of one of its names (``Segment``, ``SlotWriter``, ``LAYOUT_VERSION``,
``MAGIC``, ``now_ns``), not on ``import dplb_shm``: the pure-Python types (``WorkerState``,
``WorkerSnapshot``, ``ScoringParams``, the errors...) import without a build.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from dplb_shm._sources import source_hash
from dplb_shm.errors import (
    LayoutMismatchError,
    NativeBuildError,
    SegmentClosedError,
    SegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    SlotFieldError,
    SlotIndexError,
)
from dplb_shm.types import (
    HEARTBEAT_TIMEOUT_MS,
    Circuit,
    ScoreTerms,
    ScoringParams,
    StateReason,
    TtftParams,
    TtftTerms,
    WorkerSnapshot,
    WorkerState,
    heartbeat_stale,
)

DEFAULT_NUM_SLOTS = 64
#: the names that come from the native extension, loaded (and checked) at the first use of one
_NATIVE_NAMES = frozenset({"Segment", "SlotWriter", "LAYOUT_VERSION", "MAGIC", "now_ns"})

if TYPE_CHECKING:
    from dplb_shm._native import LAYOUT_VERSION, MAGIC, Segment, SlotWriter, now_ns
else:
    def __getattr__(name: str) -> object:
        """The native extension's names (:data:`_NATIVE_NAMES`), loaded at the first use of one
        (PEP 562), so ``from dplb_shm import WorkerState`` needs no build. Raises
        :class:`NativeBuildError` when the extension is missing or stale."""
        if name not in _NATIVE_NAMES:
            raise AttributeError(f"module 'dplb_shm' has no attribute {name!r}")
        native = _load_native()
        g = globals()
        for n in _NATIVE_NAMES:
            g[n] = getattr(native, n)
        return g[name]


def _load_native() -> ModuleType:
    """Import ``dplb_shm._native`` and check it was built from the ``csrc/`` on disk.

    Raises :class:`NativeBuildError`: not built, or built from other sources (run ``make build``)."""
    try:
        from dplb_shm import _native
    except ImportError as e:  # pragma: no cover - depends on the build state
        raise NativeBuildError(f"dplb_shm native extension is not built ({e}); run `make build` "
                               "(or `.venv/bin/python setup.py build_ext --inplace`) in the source tree") from e
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    if csrc.is_dir():   # installed without sources: nothing to compare against
        on_disk = source_hash(csrc)
        if on_disk is not None and on_disk != _native.SOURCE_SHA256:
            raise NativeBuildError(
                f"dplb_shm native extension is stale: built from sources {_native.SOURCE_SHA256[:12]}, "
                f"csrc/ on disk is {on_disk[:12]}; run `make build`")
    return _native


def default_name(port: int = 30000) -> str:
    """The segment name every CLI uses by default: ``dplb-<router port>``."""
    return f"dplb-{port}"


def unlink(name: str, missing_ok: bool = False) -> bool:
    """Remove ``/dev/shm/<name>`` without attaching; True if it was there.

    Raises :class:`SegmentNotFoundError` when it is missing, unless ``missing_ok``.
    """
    import posix_ipc

    try:
        posix_ipc.unlink_shared_memory("/" + name.lstrip("/"))
        return True
    except posix_ipc.ExistentialError:
        if missing_ok:
            return False
        raise SegmentNotFoundError(f"no segment {name} in /dev/shm", name=name, reason="not found") from None


__all__ = [
    "DEFAULT_NUM_SLOTS",
    "HEARTBEAT_TIMEOUT_MS",
    "LAYOUT_VERSION",
    "MAGIC",
    "Circuit",
    "LayoutMismatchError",
    "NativeBuildError",
    "ScoreTerms",
    "ScoringParams",
    "Segment",
    "SegmentClosedError",
    "SegmentError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SlotFieldError",
    "SlotIndexError",
    "SlotWriter",
    "StateReason",
    "TtftParams",
    "TtftTerms",
    "WorkerSnapshot",
    "WorkerState",
    "default_name",
    "heartbeat_stale",
    "now_ns",
    "unlink",
]
