"""DPLB worker agent: one process per GPU (group) that keeps an inference engine, off the request path.

It starts (or attaches to) one engine through an adapter (:mod:`worker_agent.adapters`), warms it
up, restarts it when it fails, drains it, and keeps its slot of the shared-memory segment true
(:mod:`worker_agent.agent`): the engine's address (the slot's ``endpoint``: routers forward
requests straight to it), lifecycle state, engine running/waiting/KV-cache use from its
``/metrics``, NVML memory and heartbeat. It serves a small control API (``/health``,
``/dplb/state``, ``/dplb/restart``) on a Unix socket, and on TCP when asked (``--control-port``).

Modules: ``config`` (command line), ``errors``, ``metrics`` (Prometheus parsing), ``nvml``,
``upstream`` (the agent's own client to its engine: health, warm-up, metrics), ``agent``
(lifecycle, slot, control API), ``adapters`` (vllm, sglang, openai, sim).
"""
from __future__ import annotations

__version__ = "0.1.0"
