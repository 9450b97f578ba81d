"""Sim adapter: spawns DPLB's simulated engine on a Unix socket (routers forward to it directly).

Command::

    <engine-python> -m sim_engine --uds <run-dir>/engine-<K>.sock [--model M] [pass-through args]
    <engine-python> -m sim_engine --host H --port P [--model M] [...]       (with --engine-host H)

The simulator serves vLLM's API and vLLM's metric names, so the state probe is vLLM's. Without
``--gpus`` the agent publishes the simulated device's memory (80 GiB, 90 % held, as vLLM holds it).
"""
from __future__ import annotations

import os
from typing import ClassVar

from ..config import ENGINE_STOP_GRACE_S
from ..engines import ENGINES
from ..metrics import MetricNames
from ..upstream import EngineAddress
from .base import EngineAdapter, free_loopback_port


class SimAdapter(EngineAdapter):
    """Runs ``python -m sim_engine`` on ``<run-dir>/engine-<K>.sock``."""

    name: ClassVar[str] = "sim"
    metric_names: ClassVar[MetricNames | None] = ENGINES["sim"].metric_names
    poll_interval_s: ClassVar[float] = 0.05

    #: the simulated device (sim_engine/config.py: one H100 80 GB), its memory held as vLLM holds
    #: it: ``--gpu-memory-utilization`` 0.9 of it allocated at start-up (weights + KV cache)
    SIM_GPU_TOTAL_BYTES: ClassVar[int] = 80 * 1024**3
    SIM_GPU_UTILIZATION: ClassVar[float] = 0.9

    def simulated_gpu_memory(self) -> tuple[int, int] | None:
        """The simulated device's memory when the agent has no GPU (with ``--gpus`` NVML reads the
        real ones): 80 GiB, 90 % in use, so the GPU memory series and panels have data on a laptop."""
        if self.cfg.gpus:
            return None
        total = self.SIM_GPU_TOTAL_BYTES
        return int(total * self.SIM_GPU_UTILIZATION), total

    @property
    def socket_path(self) -> str:
        """The engine's private socket, ``<run-dir>/engine-<K>.sock``."""
        return os.path.join(self.cfg.run_dir, f"engine-{self.cfg.worker_id}.sock")

    def _make_address(self) -> EngineAddress:
        if self.cfg.engine_host is not None:
            self.port = free_loopback_port()
            return EngineAddress(url=f"http://{self.cfg.engine_host}:{self.port}")
        return EngineAddress(uds=self.socket_path)

    def command(self) -> list[str]:
        """argv of the simulated engine (see module docstring)."""
        start = [self.cfg.engine_python, "-m", str(ENGINES["sim"].module)]
        if self.cfg.engine_host is not None:
            argv = [*start, "--host", self.cfg.engine_host, "--port", str(self.port)]
        else:
            argv = [*start, "--uds", self.socket_path]
        if self.cfg.model:
            argv += ["--model", self.cfg.model]
        return argv + list(self.cfg.engine_args)

    def _before_spawn(self) -> None:
        """Remove a stale socket left by an earlier run before a fresh simulator binds it."""
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass

    async def stop(self, timeout_s: float = ENGINE_STOP_GRACE_S) -> int | None:
        """Stop the simulator and remove its socket file."""
        rc = await super().stop(timeout_s)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        return rc
