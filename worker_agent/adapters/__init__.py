"""Engine adapters: one small interface (:class:`EngineAdapter`), one module per engine.

``build_adapter(cfg)`` picks the adapter named by ``--engine``.
"""
from __future__ import annotations

from ..config import AgentConfig
from ..errors import ConfigError
from .base import EngineAdapter
from .openai import OpenAIAdapter
from .sglang import SglangAdapter
from .sim import SimAdapter
from .vllm import VllmAdapter

ADAPTERS: dict[str, type[EngineAdapter]] = {
    "sim": SimAdapter,
    "vllm": VllmAdapter,
    "sglang": SglangAdapter,
    "openai": OpenAIAdapter,
}


def build_adapter(cfg: AgentConfig) -> EngineAdapter:
    """The adapter for ``cfg.engine``.

    Raises:
        ConfigError: unknown engine name, or the adapter's own checks (e.g. vllm needs ``--model``).
    """
    try:
        cls = ADAPTERS[cfg.engine]
    except KeyError:
        raise ConfigError("--engine", cfg.engine, f"expected one of {sorted(ADAPTERS)}") from None
    return cls(cfg)


__all__ = ["ADAPTERS", "EngineAdapter", "OpenAIAdapter", "SglangAdapter", "SimAdapter", "VllmAdapter",
           "build_adapter"]
