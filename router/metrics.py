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
| dplb_router_worker_state                    | gauge     | worker, state (1 for the slot's state) |
| dplb_router_worker_engine_restarts          | gauge     | worker            |

``kind`` is one of connect, timeout, status_5xx, stream_broken, client_disconnect.

Every slot that is not EMPTY has series (a DEAD worker reads ``ready 0`` and ``state{state="dead"}
1``); a worker that leaves (slot emptied, removed by an admin, taken by a new process) has its
per-worker gauges removed — in multiprocess mode, where a removed series cannot be withdrawn from
another process's file, they are set to 0 instead. ``worker_engine_restarts`` is the slot's
``restarts`` field (engine restarts by its agent since it claimed the slot). Histogram
buckets follow vLLM's TTFT/e2e buckets (``vllm/v1/metrics/loggers.py``), trimmed at the low end
for sub-millisecond proxying. With ``--workers`` > 1 the router runs prometheus_client's
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by ``router.__main__``): counters and
histograms are summed over the processes, the in-flight gauge too (``livesum``), the other gauges
report the latest value (``livemostrecent``).
"""
from __future__ import annotations

import contextlib
import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

WORKER_STATES = ("empty", "starting", "ready", "draining", "dead")
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
        self.state = Gauge("dplb_router_worker_state",
                           "1 for the state the worker's slot is in (empty, starting, ready, draining, dead)",
                           ["worker", "state"], registry=r, multiprocess_mode="livemostrecent")
        self.restarts = Gauge("dplb_router_worker_engine_restarts",
                              "Engine restarts by the worker's agent since it claimed its slot (from the segment)",
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

    def set_worker(self, worker_id: int, state: str, ready: bool, circuit: int, kv: float | None,
                   restarts: int) -> None:
        """Per-worker gauges of one health tick: the slot ``state`` name (one-hot over
        ``WORKER_STATES``), ``ready`` (eligible for routing), ``circuit``, ``kv`` (0..1, -1 unknown;
        None: not read) and the slot's engine ``restarts``."""
        w = str(worker_id)
        for name in WORKER_STATES:
            self.state.labels(w, name).set(1.0 if name == state else 0.0)
        self.ready.labels(w).set(1.0 if ready else 0.0)
        self.circuit.labels(w).set(circuit)
        if kv is not None:
            self.kv.labels(w).set(kv)
        self.restarts.labels(w).set(restarts)

    def forget_worker(self, worker_id: int) -> None:
        """The worker left: remove its per-worker gauges (multiprocess mode: set them to 0)."""
        w = str(worker_id)
        self._inflight.pop(worker_id, None)
        multi = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        per_worker = (self.ready, self.circuit, self.kv, self.inflight, self.restarts)
        for g in per_worker:
            if multi:
                g.labels(w).set(0.0)
            else:
                with contextlib.suppress(KeyError):
                    g.remove(w)
        for name in WORKER_STATES:
            if multi:
                self.state.labels(w, name).set(0.0)
            else:
                with contextlib.suppress(KeyError):
                    self.state.remove(w, name)

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
