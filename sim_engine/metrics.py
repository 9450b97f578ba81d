"""``GET /metrics``: Prometheus text with vLLM V1's metric names, types and meanings.

Values are read from the engine at scrape time by a custom ``prometheus_client`` collector, so the
exposition always agrees with :meth:`EngineCore.state`. Labels are vLLM's: ``model_name`` and
``engine`` (``"0"``); ``vllm:request_success_total`` adds ``finished_reason``.

=============================================  =========  ================================================
name                                           type       meaning
=============================================  =========  ================================================
vllm:num_requests_running                      gauge      requests in the running batch
vllm:num_requests_waiting                      gauge      requests queued (incl. preempted)
vllm:kv_cache_usage_perc                       gauge      used blocks / total blocks, 0..1
vllm:prefix_cache_queries_total                counter    prompt tokens looked up in the prefix cache
vllm:prefix_cache_hits_total                   counter    of which found cached
vllm:num_preemptions_total                     counter    preemptions (by recompute)
vllm:prompt_tokens_total                       counter    prompt tokens of requests that started decoding
vllm:generation_tokens_total                   counter    generated tokens
vllm:request_success_total                     counter    finished requests by finished_reason
vllm:time_to_first_token_seconds               histogram  arrival → first token (simulated s)
vllm:inter_token_latency_seconds               histogram  gap between consecutive tokens
vllm:e2e_request_latency_seconds               histogram  arrival → last token
vllm:request_queue_time_seconds                histogram  arrival → first scheduled
vllm:cache_config_info                         gauge      1, labels block_size and num_gpu_blocks
=============================================  =========  ================================================
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from sim_engine.engine import EngineCore
from sim_engine.stats import Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Collects every metric of the table above from one :class:`EngineCore`."""

    def __init__(self, core: EngineCore, model_name: str) -> None:
        self.core = core
        self.labels = ["model_name", "engine"]
        self.values = [model_name, "0"]

    def _gauge(self, name: str, doc: str, v: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.labels)
        g.add_metric(self.values, v)
        return g

    def _counter(self, name: str, doc: str, v: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.labels)
        c.add_metric(self.values, v)
        return c

    def _hist(self, name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        m = HistogramMetricFamily(name, doc, labels=self.labels)
        m.add_metric(self.values, h.cumulative(), h.sum)
        return m

    def collect(self) -> Iterator[Metric]:
        """Yield the metric families (called by ``generate_latest``)."""
        core, s = self.core, self.core.stats
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(core.running)
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(core.waiting)
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", core.kv.usage
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions
        )
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens
        )
        rs = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=self.labels + ["finished_reason"],
        )
        for reason, v in sorted(s.request_success.items()):
            rs.add_metric(self.values + [reason], v)
        yield rs
        yield self._hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", s.ttft
        )
        yield self._hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", s.itl
        )
        yield self._hist(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", s.e2e
        )
        yield self._hist(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            s.queue_time,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        c = core.config
        info.add_metric([str(c.block_size), str(c.num_gpu_blocks), str(c.enable_prefix_caching)], 1.0)
        yield info


def make_registry(core: EngineCore, model_name: str) -> CollectorRegistry:
    """A fresh registry holding only this engine's collector (no process/platform collectors)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(core, model_name))
    return reg


def render(registry: CollectorRegistry) -> bytes:
    """Prometheus text exposition (format 0.0.4) of ``registry``."""
    return generate_latest(registry)
