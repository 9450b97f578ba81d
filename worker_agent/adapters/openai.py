"""OpenAI adapter: attaches to a running OpenAI-compatible server at ``--engine-url``
(``http(s)://host:port`` or ``unix:/path/to.sock``).

Nothing is spawned and nothing is stopped. Readiness: ``GET /v1/models`` answers 200 (not every
server has ``/health``), then the one-token warm-up. State: the server's ``/metrics`` read with
vLLM's names, else SGLang's; a server without ``/metrics`` (404) or without either family leaves
the agent's own counters (in-flight as running, 0 waiting, KV unknown) in the slot.
"""
from __future__ import annotations

import logging
from typing import ClassVar

from ..engines import ENGINES
from ..metrics import SGLANG, VLLM, EngineMetrics, MetricNames, parse_engine_metrics
from ..upstream import EngineAddress
from .base import EngineAdapter

log = logging.getLogger("worker_agent.engine")


class OpenAIAdapter(EngineAdapter):
    """Attach to ``--engine-url`` (``http://host:port``, loopback or a remote node)."""

    name: ClassVar[str] = "openai"
    metric_names: ClassVar[MetricNames | None] = ENGINES["openai"].metric_names
    health_path: ClassVar[str] = "/v1/models"

    def _make_address(self) -> EngineAddress:
        url = str(self.cfg.engine_url)
        if url.startswith("unix:"):
            return EngineAddress(uds=url[len("unix:"):])
        return EngineAddress(url=url)

    def env_overrides(self) -> dict[str, str]:
        """No environment: nothing is spawned."""
        return {}

    async def probe(self) -> EngineMetrics:
        """vLLM's families first, SGLang's when those are absent; empty when neither."""
        if self._metrics_missing:
            return EngineMetrics()
        status, body = await self.upstream.get("/metrics", timeout_s=max(1.0, 5 * self.cfg.state_interval_s))
        if status != 200:
            if status == 404:
                self._metrics_missing = True
                log.warning("%s has no /metrics; using the agent's own counters", self.address)
            return EngineMetrics()
        text = body.decode("utf-8", "replace")
        for names in (VLLM, SGLANG):
            try:
                m = parse_engine_metrics(text, names)
            except ValueError:
                continue
            if not m.empty:
                return m
        return EngineMetrics()
