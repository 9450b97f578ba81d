"""The one table of engine kinds: what the agent, the launcher and the simulator know of each
``--engine`` (issue 28; ``tests/worker_agent/test_engine_table.py`` ties it to the adapters, the
agent's and the launcher's ``--engine`` choices and the launcher's config section).

| name   | adapter                              | metric names | started as                         | socket |
|--------|--------------------------------------|--------------|------------------------------------|--------|
| sim    | worker_agent.adapters.sim.SimAdapter | vLLM's       | ``python -m sim_engine``           | uds    |
| vllm   | ...adapters.vllm.VllmAdapter         | vLLM's       | ``python -m vllm.entrypoints.openai.api_server`` | uds |
| sglang | ...adapters.sglang.SglangAdapter     | SGLang's     | ``python -m sglang.launch_server`` | tcp    |
| openai | ...adapters.openai.OpenAIAdapter     | vLLM's, then SGLang's | attached (``--engine-url``) | url |

``socket``: how routers reach the engine by default: its private Unix socket (``uds``), a loopback
TCP port the adapter picks (``tcp``), or the URL it was given (``url``); ``--engine-host`` makes a
spawning engine listen on TCP instead. ``start_timeout_s``: the launcher's default bound on an
agent's start-up (engine start and warm-up; a real engine loads weights and compiles graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .metrics import SGLANG, VLLM, MetricNames


@dataclass(frozen=True)
class EngineKind:
    """One row of the table: ``name`` (``--engine``), ``adapter`` (``module:Class`` of its
    :class:`~worker_agent.adapters.base.EngineAdapter`, imported by ``build_adapter``),
    ``metric_names`` (the ``/metrics`` families read first; None: none), ``module`` (what
    ``<engine-python> -m`` starts; None: the adapter attaches to a running server), ``socket``
    (module docstring), ``needs_model`` (refused without ``--model``: a real engine would download
    a default), ``needs_gpus`` (a GPU engine: the launcher refuses it without GPUs),
    ``start_timeout_s`` (seconds)."""

    name: str
    adapter: str
    metric_names: MetricNames | None
    module: str | None
    socket: Literal["uds", "tcp", "url"]
    needs_model: bool
    needs_gpus: bool
    start_timeout_s: float

    @property
    def spawns(self) -> bool:
        """True when the agent starts the engine (False: it attaches to one)."""
        return self.module is not None


ENGINES: dict[str, EngineKind] = {k.name: k for k in (
    EngineKind("sim", "worker_agent.adapters.sim:SimAdapter", VLLM, "sim_engine", "uds",
               needs_model=False, needs_gpus=False, start_timeout_s=120.0),
    EngineKind("vllm", "worker_agent.adapters.vllm:VllmAdapter", VLLM, "vllm.entrypoints.openai.api_server", "uds",
               needs_model=True, needs_gpus=True, start_timeout_s=1800.0),
    EngineKind("sglang", "worker_agent.adapters.sglang:SglangAdapter", SGLANG, "sglang.launch_server", "tcp",
               needs_model=True, needs_gpus=True, start_timeout_s=1800.0),
    EngineKind("openai", "worker_agent.adapters.openai:OpenAIAdapter", VLLM, None, "url",
               needs_model=False, needs_gpus=False, start_timeout_s=120.0),
)}

#: every engine name, in the table's order (the ``--engine`` choices)
ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)
