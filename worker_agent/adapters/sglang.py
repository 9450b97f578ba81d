"""SGLang adapter: spawns ``sglang.launch_server`` on a loopback port (``--engine-host`` H: on H),
which routers forward to directly.

Command::

    <engine-python> -m sglang.launch_server --model-path M --host 127.0.0.1 --port P --tp-size N
        --enable-metrics [pass-through args]

Environment: ``CUDA_VISIBLE_DEVICES`` = ``--gpus``. State from ``/metrics`` (only served with
``--enable-metrics``): ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``,
``sglang:token_usage`` (docs.sglang.io, "Production Metrics").
"""
from __future__ import annotations

from typing import ClassVar

from ..config import AgentConfig
from ..engines import ENGINES
from ..errors import ConfigError
from ..metrics import MetricNames
from ..upstream import EngineAddress
from .base import EngineAdapter, free_loopback_port


class SglangAdapter(EngineAdapter):
    """Runs ``sglang.launch_server`` for ``--model`` on ``--gpus``.

    Raises:
        ConfigError: when ``--model`` is missing.
    """

    name: ClassVar[str] = "sglang"
    metric_names: ClassVar[MetricNames | None] = ENGINES["sglang"].metric_names
    poll_interval_s: ClassVar[float] = 1.0

    def __init__(self, cfg: AgentConfig, *, port: int | None = None) -> None:
        if not cfg.model:
            raise ConfigError("--model", None, "required with --engine sglang")
        self.port = port or free_loopback_port()
        super().__init__(cfg)

    def _make_address(self) -> EngineAddress:
        return EngineAddress(url=f"http://{self.cfg.engine_host or '127.0.0.1'}:{self.port}")

    def command(self) -> list[str]:
        """argv of the SGLang server (see module docstring)."""
        argv = [self.cfg.engine_python, "-m", str(ENGINES["sglang"].module),
                "--model-path", str(self.cfg.model), "--host", self.cfg.engine_host or "127.0.0.1",
                "--port", str(self.port),
                "--tp-size", str(self.cfg.tp_size)]
        if "--enable-metrics" not in self.cfg.engine_args:
            argv.append("--enable-metrics")
        return argv + list(self.cfg.engine_args)
