"""Engine adapters: one small interface (:class:`EngineAdapter`), one module per engine.

``build_adapter(cfg)`` picks the adapter the engine table (:mod:`worker_agent.engines`) names for
``--engine``.
"""
from __future__ import annotations

import importlib

from ..config import AgentConfig
from ..engines import ENGINES
from ..errors import ConfigError
from .base import EngineAdapter
from .openai import OpenAIAdapter
from .sglang import SglangAdapter
from .sim import SimAdapter
from .vllm import VllmAdapter


def adapter_class(engine: str) -> type[EngineAdapter]:
    """The adapter class the engine table names for ``engine`` (``EngineKind.adapter``).

    Raises:
        KeyError: ``engine`` is not in the table.
    """
    module, _, name = ENGINES[engine].adapter.partition(":")
    cls: type[EngineAdapter] = getattr(importlib.import_module(module), name)
    return cls


#: engine name -> adapter class, from the table
ADAPTERS: dict[str, type[EngineAdapter]] = {name: adapter_class(name) for name in ENGINES}


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
           "adapter_class", "build_adapter"]
