"""Prometheus families of the router (``GET /metrics``).

Two sources, one page:

**Counted by this router** (its own registry; with ``--workers`` > 1 prometheus_client's
multiprocess mode sums them over the router processes):

| family                                      | type      | labels          |
|---------------------------------------------|-----------|-----------------|
| dplb_router_requests_total                  | counter   | worker, status, model |
| dplb_router_request_errors_total            | counter   | worker, kind, model   |
| dplb_router_request_duration_seconds        | histogram | route, model    |
| dplb_router_time_to_first_token_seconds     | histogram | route, model    |
| dplb_router_request_phase_seconds           | histogram | phase, model    |
| dplb_router_prompt_tokens_total             | counter   | worker, model   |
| dplb_router_generation_tokens_total         | counter   | worker, model   |
| dplb_router_routing_decisions_total         | counter   | policy, reason  |
| dplb_router_retries_total                   | counter   | reason          |
| dplb_router_query_of_death_total            | counter   |                 |
| dplb_router_admission_queue_depth           | gauge     | (summed over router processes) |
| dplb_router_admission_wait_seconds          | histogram | class           |
| dplb_router_admission_shed_total            | counter   | reason, class   |

The admission families (:mod:`router.admission_gate`): requests waiting in the router's queue
now; the time each request that waited there before it went to a worker waited (one routed at
once is not observed: the hot path stays as it was); requests answered
429 by the queue, ``reason`` ``budget`` (waited its queue budget), ``deadline`` (could no longer
meet its TTFT deadline, ``admission.shed_late``) or ``full`` (``admission.max_queue``), ``class``
the request's priority class.

``model`` on the router's own families is the model of the worker that answered (its slot's, as
the segment lists it; ``""`` for an answer no worker gave: a 404 for an unknown model, a 503 with
none eligible), never the client's string, so it stays bounded and the dashboard's model selector
filters these panels too. ``status`` is the HTTP status answered, or 499 (nginx's "client closed request") for a client
that left before its answer was complete. ``kind`` is one of connect, timeout, status_5xx,
engine_abort (an engine answered 499 to a client still connected), stream_broken, client_disconnect,
drain_cut (the router's own stop cut the request at its drain limit: 503). ``dplb_router_query_of_death_total`` counts requests answered
502 and not tried again because they broke the connection of two workers after those read them
(:data:`router.failures.BROKEN_ENGINES_LIMIT`). The TTFT
histogram times a stream from the request's arrival to the first chunk that carries content
(:mod:`router.stream_meter`; a chat stream's role-only chunk does not count). ``phase``:
``routing`` (arrival → dispatch to the worker, retries included), ``queue_prefill`` (dispatch →
first content: the engine's queue and the prefill), ``decode`` (first content → last byte); streams
only (a non-streamed answer shows no first token). Tokens: the answer's ``usage`` when it has one,
else one per content event (output) and the router's estimate (prompt).

**Read from the segment at scrape time** (:class:`SegmentCollector`: one fresh read of every
listed slot per scrape, never a sample of some earlier tick; the segment is one truth for every
router process, so the process answering the scrape reports it once, nothing is summed):

| family                                        | type    | what (labels worker, model)                   |
|-----------------------------------------------|---------|-----------------------------------------------|
| dplb_build_info                               | gauge   | 1; labels version, layout_version, policy     |
| dplb_router_default_prefill_rate_tokens_per_second | gauge | the rate priced until one is learned (config) |
| dplb_worker_info                              | gauge   | 1; plus labels gpus, endpoint, remote         |
| dplb_worker_state                             | gauge   | 1 for the slot's state (label state)          |
| dplb_worker_ready                             | gauge   | 1 when this router routes to it (eligible)    |
| dplb_worker_heartbeat_age_seconds             | gauge   | age of the agent's last heartbeat             |
| dplb_worker_requests_running                  | gauge   | in the engine's running batch                 |
| dplb_worker_requests_waiting                  | gauge   | queued in the engine                          |
| dplb_worker_requests_in_flight                | gauge   | dispatched by all routers, not yet answered   |
| dplb_worker_prefill_outstanding_tokens        | gauge   | uncached prompt tokens before first token     |
| dplb_worker_decode_requests                   | gauge   | requests past their first token               |
| dplb_worker_kv_cache_usage_ratio              | gauge   | 0..1 (absent while unknown)                   |
| dplb_worker_recent_ttft_seconds               | gauge   | routers' TTFT EWMA (absent before a sample)   |
| dplb_worker_recent_tpot_seconds               | gauge   | routers' TPOT EWMA (absent before a sample)   |
| dplb_worker_prefill_rate_tokens_per_second    | gauge   | learned prefill rate (absent before learning) |
| dplb_worker_gpu_memory_used_bytes             | gauge   | NVML, summed over the worker's GPUs           |
| dplb_worker_gpu_memory_total_bytes            | gauge   | (both absent while unknown)                   |
| dplb_worker_circuit_state                     | gauge   | 0 closed, 1 open, 2 half-open                 |
| dplb_worker_engine_restarts_total             | counter | engine restarts of the worker (by its agents) |
| dplb_worker_agent_restarts_total              | counter | restarts of the worker's agent                |
| dplb_worker_requests_completed_total          | counter | attempts the routers saw it answer            |
| dplb_worker_requests_failed_total             | counter | attempts that failed on it (5xx, broken, ...) |

Every slot that is not EMPTY (and not removed by an admin) is listed, dead ones included (a DEAD
worker reads ``ready 0`` and ``state{state="dead"} 1``); a worker that leaves loses its series at
the next scrape. Histogram buckets follow vLLM's TTFT/e2e buckets (``vllm/v1/metrics/loggers.py``),
trimmed at the low end for sub-millisecond proxying.
"""
from __future__ import annotations

import logging
import os
import platform
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from dplb_shm import WorkerSnapshot
from router.workers import EMPTY, STATE_NAMES, Registry, WorkerHandle

if TYPE_CHECKING:
    from dplb_shm import Segment

log = logging.getLogger("dplb.router.metrics")

WORKER_STATES = ("starting", "ready", "draining", "dead")
ERROR_KINDS = ("connect", "timeout", "status_5xx", "engine_abort", "stream_broken", "client_disconnect", "drain_cut")
RETRY_REASONS = ("connect", "timeout", "stream_broken", "engine_abort")  # plus status_<code> per retries.retry_on_status
PHASES = ("routing", "queue_prefill", "decode")
BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0)
#: histogram observations a :class:`Metrics` holds back at most before it adds them (:meth:`Metrics.flush`)
OBSERVED_MAX = 4096


def add_observations(h: object, values: list[float]) -> None:
    """Observe every one of ``values`` on the prometheus_client histogram child ``h``: the same
    counts as ``h.observe(v)`` for each (each value in the first bucket whose upper bound is >= it;
    prometheus_client keeps the buckets non-cumulative and sums them when collected), with one
    addition to the sum and one per bucket hit instead of a lock and a walk over the buckets per
    value. A child without prometheus_client's attributes (another version) gets ``observe``
    per value."""
    try:
        bounds = h._upper_bounds   # type: ignore[attr-defined]
        buckets = h._buckets       # type: ignore[attr-defined]
        total = h._sum             # type: ignore[attr-defined]
    except AttributeError:
        for v in values:
            h.observe(v)           # type: ignore[attr-defined]
        return
    hits: dict[int, int] = {}
    for v in values:
        i = bisect_left(bounds, v)
        hits[i] = hits.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in hits.items():
        buckets[i].inc(n)


def build_version() -> str:
    """DPLB's installed version (package metadata), ``unknown`` when not installed."""
    try:
        from importlib.metadata import version

        return version("dplb")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown"


#: the slot's verdict for a worker (:meth:`router.scheduling.Scheduler.routing_state`: ``eligible``
#: or why not), given its handle and a fresh read of its slot
Verdict = Callable[[WorkerHandle, WorkerSnapshot | None], str]

#: the per-worker families, by key: (name, help, counter?); labels worker, model unless listed in
#: :data:`_EXTRA_LABELS`
_WORKER_FAMILIES: dict[str, tuple[str, str, bool]] = {
    "info": ("dplb_worker_info", "1 per listed worker; its GPUs, endpoint and whether it is a remote mirror", False),
    "state": ("dplb_worker_state", "1 for the state the worker's slot is in (starting, ready, draining, dead)", False),
    "ready": ("dplb_worker_ready", "1 when this router sends requests to the worker (eligible for routing)", False),
    "hb": ("dplb_worker_heartbeat_age_seconds", "Age of the agent's last heartbeat in the segment", False),
    "running": ("dplb_worker_requests_running", "Requests in the engine's running batch (engine /metrics)", False),
    "waiting": ("dplb_worker_requests_waiting", "Requests queued in the engine, not yet scheduled (engine /metrics)",
                False),
    "inflight": ("dplb_worker_requests_in_flight",
                 "Requests dispatched to the worker by all router processes and not yet answered", False),
    "prefill": ("dplb_worker_prefill_outstanding_tokens",
                "Uncached prompt tokens dispatched to the worker whose first token has not come back", False),
    "decode": ("dplb_worker_decode_requests", "Requests on the worker past their first token (router accounting)",
               False),
    "kv": ("dplb_worker_kv_cache_usage_ratio", "KV-cache usage of the engine, 0..1 (absent while unknown)", False),
    "ttft": ("dplb_worker_recent_ttft_seconds",
             "Recent time to first token on the worker as the routers saw it (EWMA, dispatch to first content)", False),
    "tpot": ("dplb_worker_recent_tpot_seconds", "Recent time per output token on the worker (routers' EWMA)", False),
    "rate": ("dplb_worker_prefill_rate_tokens_per_second", "Prefill rate the routers learned for the worker", False),
    "mem_used": ("dplb_worker_gpu_memory_used_bytes", "GPU memory used on the worker's GPUs (NVML; absent if unknown)",
                 False),
    "mem_total": ("dplb_worker_gpu_memory_total_bytes", "GPU memory of the worker's GPUs (NVML; absent if unknown)",
                  False),
    "circuit": ("dplb_worker_circuit_state", "Circuit breaker of the worker: 0 closed, 1 open, 2 half-open", False),
    "restarts": ("dplb_worker_engine_restarts", "Engine restarts of the worker (by its agents)", True),
    "agent_restarts": ("dplb_worker_agent_restarts",
                       "Restarts of the worker's agent (a new agent in a dead one's place; its engine kept)", True),
    "done": ("dplb_worker_requests_completed",
             ("Request attempts on the worker that the routers saw answered (no 5xx, no connection error, no broken "
             "stream), counted by every router process in the segment"), True),
    "failed": ("dplb_worker_requests_failed",
               ("Request attempts on the worker that failed (5xx, connection error, timeout, broken stream), counted "
               "by every router process in the segment; a client that left counts in neither"), True),
}
_EXTRA_LABELS = {"info": ["gpus", "endpoint", "remote"], "state": ["state"]}


def worker_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """A fresh, empty family for every key of :data:`_WORKER_FAMILIES`, in its order."""
    out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for key, (name, doc, counter) in _WORKER_FAMILIES.items():
        labels = ["worker", "model", *_EXTRA_LABELS.get(key, [])]
        out[key] = CounterMetricFamily(name, doc, labels=labels) if counter else GaugeMetricFamily(name, doc,
                                                                                                  labels=labels)
    return out


def add_worker(f: dict[str, GaugeMetricFamily | CounterMetricFamily], h: WorkerHandle, s: WorkerSnapshot,
               eligible: bool) -> None:
    """Add worker ``h``'s samples, read from its slot ``s``, to the families ``f``
    (:func:`worker_families`); the optional ones (KV use, the routers' EWMAs, the learned rate, GPU
    memory) only when known."""
    w, model = str(h.worker_id), str(s.model or h.model or "")
    lv = [w, model]
    st_name = STATE_NAMES.get(int(s.state), "unknown")
    f["info"].add_metric([w, model, ",".join(str(x) for x in (s.gpu_ids or [])), str(s.endpoint or h.endpoint),
                          "true" if h.mirror else "false"], 1.0)
    for name in WORKER_STATES:
        f["state"].add_metric([w, model, name], 1.0 if name == st_name else 0.0)
    f["ready"].add_metric(lv, 1.0 if eligible else 0.0)
    f["hb"].add_metric(lv, max(0.0, float(s.heartbeat_age_ms)) / 1e3)
    f["running"].add_metric(lv, float(s.num_running))
    f["waiting"].add_metric(lv, float(s.num_waiting))
    f["inflight"].add_metric(lv, float(max(0, s.router_inflight)))
    f["prefill"].add_metric(lv, float(max(0, s.prefill_tokens)))
    f["decode"].add_metric(lv, float(max(0, s.decode_reqs)))
    if 0.0 <= float(s.kv_cache_usage) <= 1.0:
        f["kv"].add_metric(lv, float(s.kv_cache_usage))
    if s.router_ttft_s > 0:
        f["ttft"].add_metric(lv, float(s.router_ttft_s))
    if s.router_tpot_s > 0:
        f["tpot"].add_metric(lv, float(s.router_tpot_s))
    if s.prefill_rate > 0:
        f["rate"].add_metric(lv, float(s.prefill_rate))
    if s.gpu_mem_total_bytes >= 0 and s.gpu_mem_used_bytes >= 0:
        f["mem_used"].add_metric(lv, float(s.gpu_mem_used_bytes))
        f["mem_total"].add_metric(lv, float(s.gpu_mem_total_bytes))
    f["circuit"].add_metric(lv, float(int(s.circuit)))
    f["restarts"].add_metric(lv, float(s.restarts))
    f["agent_restarts"].add_metric(lv, float(s.agent_restarts))
    f["done"].add_metric(lv, float(s.completed))
    f["failed"].add_metric(lv, float(s.failed))


class SegmentCollector:
    """Per-worker series read from the segment when ``/metrics`` is scraped (module docstring).

    Typed collaborators, handed in by the router's state when it starts (:meth:`Metrics.attach`):
    ``registry`` (the listed workers' handles), ``seg`` (each slot is read afresh at collect time),
    ``policy`` (the routing policy's name, a label of ``dplb_build_info``), ``verdict`` (the
    scheduler's routing verdict: eligibility lives there) and ``see_worker`` (called with every
    listed worker id, so the router's own per-worker series start at 0); ``default_prefill_rate``
    (tokens/s, the rate priced until one is learned; None: not exported)."""

    def __init__(self, registry: Registry, seg: Segment, policy: str, verdict: Verdict,
                 see_worker: Callable[[int], None], default_prefill_rate: float | None = None) -> None:
        self.registry = registry
        self.default_prefill_rate = default_prefill_rate
        self.seg = seg
        self.policy = policy
        self.verdict = verdict
        self.see_worker = see_worker
        self.version = build_version()

    def describe(self) -> list[Metric]:
        return []  # families depend on the live workers; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        try:
            from dplb_shm import LAYOUT_VERSION

            layout = str(LAYOUT_VERSION)
        except Exception:  # noqa: BLE001 - the extension is missing: the router would not run anyway
            layout = "unknown"
        info = GaugeMetricFamily("dplb_build_info", "DPLB build: version, segment layout version, routing policy",
                                 labels=["version", "layout_version", "policy", "python"])
        info.add_metric([self.version, layout, self.policy, platform.python_version()], 1.0)
        yield info
        if self.default_prefill_rate is not None:
            dflt = GaugeMetricFamily("dplb_router_default_prefill_rate_tokens_per_second",
                                     "Prefill rate the routers price a worker with until they learned its own "
                                     "(routing_policy.prefill_tokens_per_s)")
            dflt.add_metric([], float(self.default_prefill_rate))
            yield dflt
        reg = self.registry
        for wid in list(reg.handles):
            self.see_worker(wid)
        f = worker_families()
        for wid in sorted(reg.handles):
            h = reg.handles.get(wid)
            if h is None:
                continue
            s: WorkerSnapshot | None
            try:
                s = self.seg.read_slot(wid)
            except Exception:  # noqa: BLE001 - a slot read mid-release: report what the last tick saw
                s = h.snap
            if s is None or int(s.state) == EMPTY:
                continue
            add_worker(f, h, s, self.verdict(h, s) == "eligible")
        yield from f.values()


class _ByWorker:
    """A counter labelled ``(worker, kind, model)`` used as one labelled ``(worker, kind)``: the
    model is the worker's (``model_of``), so the call sites name the worker and the kind only."""

    __slots__ = ("counter", "model_of")

    def __init__(self, counter: Counter, model_of: Callable[[str], str]) -> None:
        self.counter, self.model_of = counter, model_of

    def labels(self, worker: str, kind: str) -> Counter:
        """The child of ``worker`` (its label) and ``kind`` (``ERROR_KINDS``)."""
        return self.counter.labels(worker, kind, self.model_of(worker))


class Metrics:
    """All router metric families; ``render()`` returns (body bytes, content type).
    :meth:`attach` adds the per-worker series of a started router (:class:`SegmentCollector`)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("dplb_router_requests", "Requests answered, by worker, HTTP status and model",
                                ["worker", "status", "model"], registry=r)
        #: ``errors.labels(worker, kind)``: the worker's model is added (:class:`_ByWorker`)
        self.errors = _ByWorker(Counter("dplb_router_request_errors", "Forwarding errors, by worker, kind and model",
                                        ["worker", "kind", "model"], registry=r), self.model_of)
        self.duration = Histogram("dplb_router_request_duration_seconds",
                                  "Time from request received to last byte sent", ["route", "model"], buckets=BUCKETS,
                                  registry=r)
        self.ttft = Histogram("dplb_router_time_to_first_token_seconds",
                              "Time from request received to the first response chunk carrying content (streams)",
                              ["route", "model"], buckets=BUCKETS, registry=r)
        self.phase = Histogram("dplb_router_request_phase_seconds",
                               "Time of a streamed request in each phase: routing (received to dispatched), "
                               "queue_prefill (dispatched to first content), decode (first content to last byte)",
                               ["phase", "model"], buckets=BUCKETS, registry=r)
        self.prompt_tokens = Counter("dplb_router_prompt_tokens", "Prompt tokens of the requests answered, per worker",
                                     ["worker", "model"], registry=r)
        self.generation_tokens = Counter("dplb_router_generation_tokens",
                                         "Tokens generated in the answers relayed, per worker", ["worker", "model"],
                                         registry=r)
        self.decisions = Counter("dplb_router_routing_decisions", "Routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.retries = Counter("dplb_router_retries", "Requests retried on another worker before the first byte",
                               ["reason"], registry=r)
        self.query_of_death = Counter("dplb_router_query_of_death",
                                      "Requests answered 502 and not tried again: their connection broke on two "
                                      "workers after those read them, before the first byte (a query of death)",
                                      registry=r)
        self.queue_depth = Gauge("dplb_router_admission_queue_depth", "Requests waiting in the router's admission queue",
                                 registry=r, multiprocess_mode="livesum")
        self.queue_wait = Histogram("dplb_router_admission_wait_seconds",
                                    "Time a request waited in the router's admission queue before it went to a worker", ["class"],
                                    buckets=BUCKETS, registry=r)
        self.shed = Counter("dplb_router_admission_shed", "Requests the admission queue answered 429, by reason "
                            "(budget, deadline, full) and priority class", ["reason", "class"], registry=r)
        self.collector: SegmentCollector | None = None
        self._req_children: dict[tuple[str, int], Counter] = {}
        self._dec_children: dict[tuple[str, str], Counter] = {}
        self._dur: dict[tuple[str, str], object] = {}
        self._ttft: dict[tuple[str, str], object] = {}
        #: worker label → its model (from the attached state's registry; see :meth:`model_of`)
        self._models: dict[str, str] = {}
        #: the attached router's worker registry (:meth:`attach`), read by :meth:`model_of`
        self._registry: Registry | None = None
        self._phase: dict[tuple[str, str], object] = {}
        self._tok: dict[tuple[int, str], tuple[Counter, Counter]] = {}
        self._seen: set[int] = set()
        #: per-request counter increments not yet added to their prometheus_client child (see :meth:`flush`)
        self._pending: dict[Counter, float] = {}
        #: per-request histogram observations not yet added to their child (see :meth:`flush`), and how many
        self._observed: dict[object, list[float]] = {}
        self._n_observed = 0
        #: with ``--workers`` > 1 a scrape reads every process's files: counts go there at once
        self._direct = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

    def attach(self, registry: Registry, seg: Segment, policy: str, verdict: Verdict,
               retry_on_status: Iterable[int] = (), default_prefill_rate: float | None = None) -> SegmentCollector:
        """Report the per-worker series of a started router (:class:`SegmentCollector` over
        ``registry``, ``seg``, ``policy`` and ``verdict``) on every scrape, and start every retry
        reason the config allows (``retry_on_status``: ``retries.retry_on_status``) at 0 (a
        series that exists before its first event lets ``rate()`` and the dashboards show 0
        rather than nothing). ``default_prefill_rate``: ``routing_policy.prefill_tokens_per_s``, exported
        as ``dplb_router_default_prefill_rate_tokens_per_second``."""
        for reason in (*RETRY_REASONS, *(f"status_{s}" for s in retry_on_status)):
            self.retries.labels(reason)
        self._registry = registry
        self.collector = SegmentCollector(registry, seg, policy, verdict, self.see_worker, default_prefill_rate)
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            self.registry.register(self.collector)
        return self.collector

    def model_of(self, worker: str) -> str:
        """The model of worker label ``worker`` (``"none"``, or a worker not in the registry of the
        attached state, or one whose slot names no model yet: ``""``); a model once known is cached
        until :meth:`forget_worker`."""
        m = self._models.get(worker)
        if m is not None:
            return m
        reg = self._registry
        h = reg.handles.get(int(worker)) if reg is not None and worker.isdigit() else None
        if h is None:
            return ""
        m = str(h.model or "")
        if m:   # a slot still starting has no model yet: ask again next time
            self._models[worker] = m
        return m

    def observe_request(self, worker: str, status: int, route: str, seconds: float) -> None:
        """Count one answered request and its duration, labelled with the worker's model
        (children cached: ~1 µs per call)."""
        key = (worker, status)
        c = self._req_children.get(key)
        if c is None:
            c = self.requests.labels(worker, str(status), self.model_of(worker))
            if worker in self._models:
                self._req_children[key] = c
        self._add(c, 1.0)
        model = self.model_of(worker)
        h = self._dur.get((route, model))
        if h is None:
            h = self._dur[(route, model)] = self.duration.labels(route, model)
        self._observe(h, seconds)

    def observe_ttft(self, route: str, seconds: float, model: str = "") -> None:
        """Time to the first relayed chunk carrying content of a stream (``model``: the worker's)."""
        h = self._ttft.get((route, model))
        if h is None:
            h = self._ttft[(route, model)] = self.ttft.labels(route, model)
        self._observe(h, seconds)

    def observe_phase(self, phase: str, model: str, seconds: float) -> None:
        """Time one streamed request spent in ``phase`` (``PHASES``)."""
        key = (phase, model)
        h = self._phase.get(key)
        if h is None:
            h = self._phase[key] = self.phase.labels(phase, model)
        self._observe(h, seconds)

    def count_tokens(self, worker_id: int, model: str, prompt: int, generated: int) -> None:
        """Count one answered request's prompt and generated tokens on ``worker_id``."""
        key = (worker_id, model)
        pair = self._tok.get(key)
        if pair is None:
            w = str(worker_id)
            pair = self._tok[key] = (self.prompt_tokens.labels(w, model), self.generation_tokens.labels(w, model))
        if prompt > 0:
            self._add(pair[0], prompt)
        if generated > 0:
            self._add(pair[1], generated)

    def see_worker(self, worker_id: int) -> None:
        """Start worker ``worker_id``'s error counters at 0, every kind (once per worker)."""
        if worker_id in self._seen:
            return
        self._seen.add(worker_id)
        w = str(worker_id)
        for kind in ERROR_KINDS:
            self.errors.labels(w, kind)

    def forget_worker(self, worker_id: int) -> None:
        """The worker left: drop this process's cached children for it (its segment series go by
        themselves; its counters stay, as counters of a finished target do)."""
        for key in [k for k in self._tok if k[0] == worker_id]:
            self._tok.pop(key, None)
        w = str(worker_id)
        for rkey in [k for k in self._req_children if k[0] == w]:
            self._req_children.pop(rkey, None)
        self._models.pop(w, None)   # the slot may come back serving another model
        self._seen.discard(worker_id)

    def decision(self, policy: str, reason: str) -> None:
        """Count one routing decision."""
        key = (policy, reason)
        c = self._dec_children.get(key)
        if c is None:
            c = self._dec_children[key] = self.decisions.labels(policy, reason)
        self._add(c, 1.0)

    def admission_start(self, cls: str, reasons: Iterable[str]) -> None:
        """Create the admission series of class ``cls`` (each shed reason, the wait histogram)
        and the queue depth at 0, so that they are exported before their first event."""
        for reason in reasons:
            self.shed.labels(reason, cls)
        self.queue_wait.labels(cls)
        self.queue_depth.set(0)

    def admission_wait(self, priority: int, seconds: float) -> None:
        """One request left the admission queue for a worker after waiting ``seconds``."""
        self.queue_wait.labels(str(priority)).observe(seconds)

    def admission_shed(self, reason: str, priority: int, waited_s: float) -> None:
        """One request of class ``priority`` was answered 429 by the queue (``reason``) after ``waited_s``."""
        self.shed.labels(reason, str(priority)).inc()

    def admission_depth(self, depth: int) -> None:
        """Requests waiting in this process's admission queue now."""
        self.queue_depth.set(depth)

    def _add(self, child: Counter, n: float) -> None:
        """Count ``n`` on a per-request counter's child: coalesced until :meth:`flush`."""
        p = self._pending
        p[child] = p.get(child, 0.0) + n
        if self._direct:
            self.flush()

    def _observe(self, child: object, seconds: float) -> None:
        """Observe ``seconds`` on a per-request histogram's child (duration, TTFT, phases):
        coalesced until :meth:`flush` (at most :data:`OBSERVED_MAX` waiting)."""
        obs = self._observed.get(child)
        if obs is None:
            self._observed[child] = [seconds]
        else:
            obs.append(seconds)
        self._n_observed += 1
        if self._direct or self._n_observed >= OBSERVED_MAX:
            self.flush()

    def flush(self) -> None:
        """Add the coalesced increments of the per-request counters (requests, tokens, decisions)
        and the coalesced observations of the per-request histograms (duration, TTFT, phases) to
        their prometheus_client children. Those are updated several times per request (a stream:
        five histogram observations, two or three counters); prometheus_client's ``inc`` takes a
        lock and checks the child each time (~1 µs) and its ``observe`` adds the sum and walks the
        buckets (~5 µs), where a dict addition or a list append is a tenth of a µs; here each child
        gets one addition per flush (:func:`add_observations`). :meth:`render` flushes first, so a
        scrape sees every request (the health monitor also flushes every tick). With
        ``--workers`` > 1 (``PROMETHEUS_MULTIPROC_DIR``) a scrape reads the files every process
        writes, so there each update is flushed at once."""
        p = self._pending
        if p:
            self._pending = {}
            for c, n in p.items():
                c.inc(n)
        obs = self._observed
        if obs:
            self._observed = {}
            self._n_observed = 0
            for h, values in obs.items():
                add_observations(h, values)

    def render(self) -> tuple[bytes, str]:
        """Exposition text and its content type (after :meth:`flush`)."""
        self.flush()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            reg = CollectorRegistry()
            multiprocess.MultiProcessCollector(reg)
            if self.collector is not None:
                reg.register(self.collector)
            return generate_latest(reg), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
