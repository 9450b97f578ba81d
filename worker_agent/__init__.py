"""DPLB worker agent: one process per GPU (group) that wraps an inference engine.

It starts (or attaches to) one engine through an adapter (:mod:`worker_agent.adapters`), relays the
router's requests to it over a Unix socket (:mod:`worker_agent.relay`, :mod:`worker_agent.upstream`),
and keeps its slot of the shared-memory segment true (:mod:`worker_agent.agent`): lifecycle state,
in-flight requests, queued prompt tokens, latency windows, engine running/waiting/KV-cache use,
NVML memory and heartbeat.

Modules: ``config`` (command line), ``errors``, ``metrics`` (Prometheus parsing), ``nvml``,
``meter`` (TTFT/TPOT/e2e, prompt length), ``upstream`` (transport), ``relay`` (ASGI app),
``agent`` (lifecycle and slot updates), ``adapters`` (vllm, sglang, openai, sim).
"""
from __future__ import annotations

__version__ = "0.1.0"
