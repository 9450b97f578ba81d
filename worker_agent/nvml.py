"""GPU memory of the agent's GPUs through NVML (``nvidia-ml-py``, module ``pynvml``).

No NVML (the module is missing, the driver library is absent, no GPU, an index out of range):
the probe reports "unknown" (``-1`` bytes, the slot's convention), logs the reason once, and never
raises. NVML indexes GPUs physically and ignores ``CUDA_VISIBLE_DEVICES``; ``--gpus`` holds physical
indices, which is what the launch script plans with.
"""
from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger("worker_agent.nvml")

UNKNOWN = -1


class GpuMemoryProbe:
    """Reads used and total device memory, summed over ``gpu_ids``.

    Args:
        gpu_ids: physical GPU indices (``--gpus``); empty → always unknown (no NVML call made).

    The first :meth:`read` initialises NVML; a failure there (or later) switches the probe to
    "unknown" for good, logged once at WARNING. Calls block for well under a millisecond per GPU
    on a healthy driver; the agent still runs them off the event loop.
    """

    def __init__(self, gpu_ids: list[int]) -> None:
        self.gpu_ids = list(gpu_ids)
        self._nvml: ModuleType | None = None
        self._handles: list[object] = []
        self._failed = not self.gpu_ids
        self._initialised = False
        self.reason: str | None = None if self.gpu_ids else "no GPUs assigned"

    @property
    def available(self) -> bool:
        """False once NVML is known to be unusable (missing module, init failure, no GPU ids)."""
        return not self._failed

    def _fail(self, why: str) -> tuple[int, int]:
        if not self._failed:
            log.warning("NVML unavailable for GPUs %s (%s); GPU memory reported as unknown", self.gpu_ids, why)
        self._failed = True
        self.reason = why
        return UNKNOWN, UNKNOWN

    def _init(self) -> None:
        self._initialised = True
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
        self._nvml = nvml
        self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in self.gpu_ids]

    def read(self) -> tuple[int, int]:
        """Return ``(used_bytes, total_bytes)`` summed over the GPUs, or ``(-1, -1)`` when unknown."""
        if self._failed:
            return UNKNOWN, UNKNOWN
        try:
            if not self._initialised:
                self._init()
            used = total = 0
            nvml = self._nvml
            if nvml is None:
                return UNKNOWN, UNKNOWN
            for h in self._handles:
                info = nvml.nvmlDeviceGetMemoryInfo(h)
                used += int(info.used)
                total += int(info.total)
            return used, total
        except ImportError as e:
            return self._fail(f"pynvml not importable: {e}")
        except Exception as e:  # noqa: BLE001 - pynvml raises NVMLError subclasses and OSError variants
            return self._fail(f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Shut NVML down if this probe initialised it; safe to call more than once."""
        if self._nvml is not None and not self._failed:
            try:
                self._nvml.nvmlShutdown()
            except Exception as e:  # noqa: BLE001 - shutting down a broken driver must not raise
                log.debug("nvmlShutdown failed: %s", e)
        self._nvml = None
        self._handles = []
