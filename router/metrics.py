"""Prometheus families of the router (``GET /metrics``), in their own registry.

| family                                      | type      | labels            |
|---------------------------------------------|-----------|-------------------|
| dplb_router_requests_total                  | counter   | worker, status    |
| dplb_router_request_errors_total            | counter   | worker, kind      |
| dplb_router_request_duration_seconds        | histogram | route             |
| dplb_router_time_to_first_token_seconds     | histogram | route             |
| dplb_router_worker_inflight                 | gauge     | worker            |
| dplb_router_worker_kv_cache_usage           | gauge     | worker            |
| dplb_router_worker_ready                    | gauge     | worker            |
| dplb_router_routing_decisions_total         | counter   | policy, reason    |
| dplb_router_retries_total                   | counter   | reason            |
| dplb_router_circuit_state                   | gauge     | worker (0 closed, 1 open, 2 half-open) |

``kind`` is one of connect, timeout, status_5xx, stream_broken, client_disconnect. Histogram
buckets follow vLLM's TTFT/e2e buckets (``vllm/v1/metrics/loggers.py``), trimmed at the low end
for sub-millisecond proxying. With ``--workers`` > 1 the router runs prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by ``router.__main__``): counters and
histograms are summed over the processes, the in-flight gauge too (``livesum``), the other gauges
report the latest value (``livemostrecent``).
"""
from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0)


class Metrics:
    """All router metric families; ``render()`` returns (body bytes, content type)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dplb_router_requests", "Requests answered, by worker and HTTP status",
                                ["worker", "status"], registry=r)
        self.errors = Counter("dplb_router_request_errors", "Forwarding errors, by worker and kind",
                              ["worker", "kind"], registry=r)
        self.duration = Histogram("dplb_router_request_duration_seconds",
                                  "Time from request received to last byte sent", ["route"], buckets=BUCKETS,
                                  registry=r)
        self.ttft = Histogram("dplb_router_time_to_first_token_seconds",
                              "Time from request received to first response body byte (streams)", ["route"],
                              buckets=BUCKETS, registry=r)
        self.inflight = Gauge("dplb_router_worker_inflight", "Requests in flight per worker (this router)",
                              ["worker"], registry=r, multiprocess_mode="livesum")
        self.kv = Gauge("dplb_router_worker_kv_cache_usage", "KV-cache usage 0..1 as last read from the segment",
                        ["worker"], registry=r, multiprocess_mode="livemostrecent")
        self.ready = Gauge("dplb_router_worker_ready", "1 when the worker is eligible for routing", ["worker"],
                           registry=r, multiprocess_mode="livemostrecent")
        self.decisions = Counter("dplb_router_routing_decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.retries = Counter("dplb_router_retries", "Requests retried on another worker before the first byte",
                               ["reason"], registry=r)
        self.circuit = Gauge("dplb_router_circuit_state", "Circuit state (0 closed, 1 open, 2 half-open)",
                             ["worker"], registry=r, multiprocess_mode="livemostrecent")
        self._req_children: dict[tuple[str, int], object] = {}
        self._dec_children: dict[tuple[str, str], object] = {}
        self._dur: dict[str, object] = {}
        self._ttft: dict[str, object] = {}
        self._inflight: dict[int, object] = {}

    def observe_request(self, worker: str, status: int, route: str, seconds: float) -> None:
        """Count one answered request and its duration (children cached: ~1 µs per call)."""
        key = (worker, status)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self.requests.labels(worker, str(status))
        c.inc()  # type: ignore[attr-defined]
        h = self._dur.get(route)
        if h is None:
            h = self._dur[route] = self.duration.labels(route)
        h.observe(seconds)  # type: ignore[attr-defined]

    def observe_ttft(self, route: str, seconds: float) -> None:
        """Time to the first relayed body byte of a stream."""
        h = self._ttft.get(route)
        if h is None:
            h = self._ttft[route] = self.ttft.labels(route)
        h.observe(seconds)  # type: ignore[attr-defined]

    def set_inflight(self, worker_id: int, n: int) -> None:
        """Set this process's in-flight gauge of ``worker_id``."""
        g = self._inflight.get(worker_id)
        if g is None:
            g = self._inflight[worker_id] = self.inflight.labels(str(worker_id))
        g.set(n)  # type: ignore[attr-defined]

    def decision(self, policy: str, reason: str) -> None:
        """Count one routing decision."""
        key = (policy, reason)
        c = self._dec_children.get(key)
        if c is None:
            c = self._dec_children[key] = self.decisions.labels(policy, reason)
        c.inc()  # type: ignore[attr-defined]

    def render(self) -> tuple[bytes, str]:
        """Exposition text and its content type."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            return generate_latest(reg), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
