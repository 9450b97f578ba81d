"""Router configuration: ``dplb.yaml`` validated with pydantic v2; command-line flags override it.

Every field has a default (docs/DESIGN.md "Processes", dplb.example.yaml), so an empty file or no file is valid. Unknown keys
are rejected so that a typo does not silently fall back to a default. :func:`load_config` raises
:class:`router.errors.ConfigError` whose message names the dotted field, the value and the reason.

Example (see ``dplb.example.yaml`` at the repository root for every field)::

    router: {port: 30000, shm: dplb-30000, admin_token: s3cret}
    routing_policy: {policy: dplb, kv_cache_threshold: 0.8}
    backend_servers:
      - {endpoint: "10.0.0.7:8001", weight: 2.0}     # remote agent, mirrored into a slot
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, cast, overload

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from dplb_shm.types import HEARTBEAT_TIMEOUT_MS
from router.errors import ConfigError
from router.policies import (
    REGISTRY,
    CacheAwareParams,
    DplbParams,
    KvCostParams,
    LeastLoadParams,
    LMetricParams,
    SessionParams,
    WeightedParams,
    policy_names,
)

#: a host name, an IPv4 literal or an IPv6 literal (bare or in brackets)
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f]*:[0-9A-Fa-f:.]*")
#: every policy name at import, from the registry (kept for old imports; the parsers and the
#: validation read router.policies.policy_names(), which also holds a policy registered later)
POLICIES = policy_names()


def is_loopback(host: str) -> bool:
    """True for a loopback host: ``localhost``, 127.0.0.0/8, ``::1`` (brackets allowed)."""
    import ipaddress

    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RouterSection(_Strict):
    """Process-level settings of the router (network, auth, limits)."""

    host: str = "127.0.0.1"  # loopback unless asked; beyond loopback the router requires admin_token
    port: int = Field(default=30000, ge=1, le=65535)
    shm: str | None = None  # default: "dplb-<port>" (docs/INTERFACES.md)
    workers: int = Field(default=1, ge=1, le=64, description="router processes sharing the segment")
    admin_token: str | None = None
    admin_loopback_only: bool = True
    api_key: str | None = None
    # 64 MiB: a 128k-token prompt is ~0.5 MB of text; chat bodies with images can be tens of MB.
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    # request head limits (431 beyond them, checked before the body is read; router/server.py):
    # total bytes of header names + values, and the number of header fields
    max_header_bytes: int = Field(default=32 * 1024, ge=1024, le=16 * 1024 * 1024)
    max_headers: int = Field(default=100, ge=8, le=10_000)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    # longest wait from dispatch to the first response body byte: a stream's first token after a
    # long prefill, or a whole non-streamed generation (vLLM/SGLang send those at the end)
    first_byte_timeout_s: float = Field(default=600.0, gt=0)
    # longest gap between two body chunks once the first arrived (a stalled stream)
    idle_timeout_s: float = Field(default=120.0, gt=0)
    # deprecated alias of first_byte_timeout_s (one timeout used to cover both waits)
    request_timeout_s: float | None = Field(default=None, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"
    # one line per proxied request on the logger dplb.router.access, whatever log_level says
    # (router/access_log.py): "text", "json" (one object per line) or "off"
    access_log: Literal["text", "json", "off"] = "text"
    state_dir: str | None = None  # admin state shared by router processes; default /tmp/dplb-router-<port>

    @model_validator(mode="after")
    def _alias(self) -> RouterSection:
        if self.request_timeout_s is not None and "first_byte_timeout_s" not in self.model_fields_set:
            object.__setattr__(self, "first_byte_timeout_s", self.request_timeout_s)
        return self

    @field_validator("shm")
    @classmethod
    def _no_slash(cls, v: str | None) -> str | None:
        if v is not None and (not v or "/" in v):
            raise ValueError("segment name without slashes, e.g. dplb-30000")
        return v


class BackendServer(_Strict):
    """A worker agent the router does not find in its segment: ``endpoint`` ``host:port`` (an agent
    on another node: its control API, ``dplb-worker-agent --control-port``) or an absolute Unix
    socket path; the router mirrors it into a slot of its own segment (top slot downwards),
    refreshes it from the agent's ``GET /dplb/state`` and forwards requests to the engine address
    that state publishes (one hop). Local
    agents started by the launch script are found in the segment and need no entry here; their
    GPUs come from the launcher's ``--gpus``."""

    endpoint: str
    weight: float = Field(default=1.0, gt=0, le=100)
    model: str | None = None
    #: the engine's KV-cache events publisher (vLLM's ``--kv-events-config`` "endpoint") and its
    #: replay socket, ``tcp://host:port`` or ``ipc://path``: read with ``kv_events.enabled``
    kv_events: str | None = None
    kv_events_replay: str | None = None

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"(tcp://[^\s/]+:\d+|ipc:///\S+)", v):
            raise ValueError("expected tcp://host:port or ipc:///absolute/path")
        return v

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        v = v.strip()
        for prefix in ("http://", "https://"):
            if v.startswith(prefix):
                v = v[len(prefix):].rstrip("/")
        if v.startswith("/"):
            return v
        host, sep, port = v.rpartition(":")
        # the host must be a name or an IP literal: this refuses other schemes (ftp://, gopher://,
        # file:...), credentials (user@host) and paths, so the admin API cannot aim the router elsewhere
        if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port (http:// optional) or an absolute Unix socket path")
        return v


class HealthCheck(_Strict):
    """Active probes of ``GET /health`` on every worker (docs/DESIGN.md "Router": 200 ms / 50 ms / 3 failures)."""

    interval_ms: int = Field(default=200, ge=10)
    timeout_ms: int = Field(default=50, ge=1)
    max_failures: int = Field(default=3, ge=1)
    heartbeat_timeout_ms: int = Field(default=HEARTBEAT_TIMEOUT_MS, ge=50)
    enabled: bool = True


class RoutingPolicy(DplbParams, WeightedParams, CacheAwareParams, LeastLoadParams, LMetricParams, KvCostParams,
                    SessionParams, _Strict):
    """Policy choice and every registered policy's parameters (docs/DESIGN.md "Scoring"; each
    field is declared once, by the policy that reads it: ``router.policies.<name>.<Name>Params``,
    or a group several share in :mod:`router.policies.registry`; each policy's module docstring
    gives its formula). It subclasses every registered ``PolicySpec.params`` (a test checks that
    none is missing), so one section stays valid whichever policy ``policy`` names."""

    policy: str = "dplb"
    # age at which TTFT/TPOT/e2e samples leave the slots' latency windows; the launcher passes it to
    # every agent as --latency-window-s (the agents own those windows)
    latency_window_sec: float = Field(default=10.0, gt=0)

    @field_validator("policy")
    @classmethod
    def _registered(cls, v: str) -> str:
        if v not in REGISTRY:
            raise ValueError(f"unknown routing policy {v!r}; one of {', '.join(policy_names())}")
        return v


class CircuitBreaker(_Strict):
    """Per-worker breaker over a sliding window of the last requests (only connect errors,
    timeouts and 5xx count as failures)."""

    failure_rate_threshold: float = Field(default=0.15, gt=0, le=1)
    minimum_requests: int = Field(default=20, ge=1)
    window_size: int = Field(default=100, ge=1)
    open_time_s: float = Field(default=5.0, gt=0)
    enabled: bool = True


class Retries(_Strict):
    """Retries on another worker of what failed before the first response byte reached the client
    (a non-streamed answer reaches it whole), with jittered exponential backoff.

    Always retried, because they cost the worker nothing: a refused connection (nothing listens),
    one the worker never read (reset before any response byte), and the statuses in
    ``retry_on_status`` (429 and 503: refused before any work began). A connection that broke after
    the worker read the request (its engine exited, was killed or reset it) is retried once, on
    another worker, with ``retry_on_disconnect`` (the default): a request that has broken two
    workers' connections is answered 502 and not tried again (a request that crashes engines
    would crash the next one too; ``dplb_router_query_of_death_total``). A timeout is not retried
    (the request may still be running there, and would likely time out again elsewhere: up to
    ``max_attempts`` × the timeout of GPU time) unless ``retry_on_timeout``. When no worker is
    left to take the request the answer is 503 with ``Retry-After``."""

    max_attempts: int = Field(default=3, ge=1, le=16)
    backoff_base_ms: float = Field(default=5.0, ge=0)
    backoff_max_ms: float = Field(default=200.0, ge=0)
    retry_on_status: list[int] = Field(default_factory=lambda: [429, 503])
    retry_on_timeout: bool = False
    retry_on_disconnect: bool = True


class MetricsSection(_Strict):
    """Where ``GET /metrics`` is served. ``port``: a port of its own (``dplb-router --metrics-port``,
    like SGLang router's ``--prometheus-port``) on ``router.host``, serving the same exposition as
    the main port (which keeps serving it); None (default): the main port only."""

    port: int | None = Field(default=None, ge=1, le=65535)


class KVEventsSection(_Strict):
    """The engines' KV-cache events as the routing policy's prefix index (:mod:`router.events_index`;
    ``dplb-router --kv-events``): with ``enabled`` every router process subscribes to the publisher
    each ``backend_servers`` entry names (``kv_events``, ``kv_events_replay``) and matches prompts
    against the engines' block sets, tokenized as the simulated engine does (``vocab_size``, its
    ``--vocab-size``); ``block_size``: the engines' (vLLM's ``--block-size``); ``pending_s``: how
    long a prompt this router sent counts on its engine while the engine's events do not show it
    (0: the events alone). Off by default: the policy's own index."""

    enabled: bool = False
    block_size: int = Field(default=16, ge=1, le=4096)
    vocab_size: int = Field(default=128_256, ge=1, lt=1 << 32)
    pending_s: float = Field(default=30.0, ge=0, le=3600)


class ShareSection(_Strict):
    """Replicas on different nodes (routers, or pickers behind one gateway) share their in-flight
    load per engine and their placements through Redis (:mod:`router.share`; ``dplb-router
    --share-url``, ``dplb-epp --share-url``). ``url``: ``redis://host:6379/0`` (``rediss://`` for TLS,
    ``unix://`` for a socket; None: off, each replica its own view); ``prefix``: the keys' prefix,
    one per pool of replicas; ``interval_ms``: how often every replica's load is read besides the
    pushes (the others' changes arrive as they happen); ``push_gap_ms``: the shortest time between
    two pushes of this replica's changes (changes meanwhile go together); ``ttl_s``: how long a
    replica's load outlives its last write (a replica killed without a goodbye; at least 3 x
    ``interval_ms``: the load is rewritten within ``ttl_s / 4`` plus one interval);
    ``lookup_ms``: on a prefix miss (this replica's index holds less than half of the prompt's
    head), the longest the request waits for one read of what the other replicas pushed and
    placed that has not arrived yet (0: never waits; a back-to-back client's next request can then
    beat the push of its previous one's placement); ``max_stream_mb``: about how much the stream of
    placements may hold in Redis, MiB (each a prompt's hashes and block keys: up to ~100 KB for a
    long prompt; its oldest go first). The engines are
    matched by their address: give every replica the same addresses. A router shares with one
    process per node (``router.workers`` 1)."""

    url: str | None = None
    prefix: str = Field(default="dplb", min_length=1, max_length=200)
    interval_ms: float = Field(default=100.0, gt=0, le=60_000)
    push_gap_ms: float = Field(default=1.0, ge=0, le=10_000)
    ttl_s: float = Field(default=2.0, gt=0, le=3600)
    lookup_ms: float = Field(default=10.0, ge=0, le=1000)
    max_stream_mb: float = Field(default=256.0, gt=0, le=1 << 20)

    @field_validator("url")
    @classmethod
    def _scheme(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"(rediss?|unix)://\S+$", v):
            raise ValueError("not a Redis URL: redis://host:port/db, rediss://... or unix:///path")
        return v

    @model_validator(mode="after")
    def _interval(self) -> ShareSection:
        if 3 * self.interval_ms > self.ttl_s * 1000:
            raise ValueError(f"ttl_s ({self.ttl_s} s) must be at least 3 x interval_ms ({self.interval_ms} ms): a "
                             "replica rewrites its load within ttl_s / 4 plus one interval, and a late write would "
                             "let it expire while the replica runs")
        return self


class AdmissionClass(_Strict):
    """Settings of one priority class (``admission.classes``, keyed by the class's integer
    priority, higher first). ``queue_budget_s``: the longest a request of this class waits in
    the router's queue before it is answered 429 (None: ``admission.queue_budget_s``)."""

    queue_budget_s: float | None = Field(default=None, gt=0, le=3600)


class AdmissionSection(_Strict):
    """The router's admission queue (docs/admission.md; :mod:`router.admission`).

    A request is dispatched at once while the policy's estimated TTFT on the best eligible worker
    is within ``headroom`` × the request's TTFT budget (``ttft_slo_base_s`` + ``ttft_slo_per_1k_s``
    × prompt tokens / 1000, the per-request SLO of ``dplb-simulate``); otherwise it waits in the
    router, ordered by priority class, then fairly between tenants, then by deadline, and is
    answered 429 + ``Retry-After`` after its queue budget, or, once requests have waited without a
    break for ``late_backlog_s`` (a sustained backlog, not a burst), as soon as it can no longer
    meet its deadline (``shed_late``; before that, or with false: it waits, behind every request
    that still can). In the first ``hold_after_s`` of a spell without room, and unless a request
    was held within ``reserve_window_s``, a request is bound on arrival as without the queue (a
    burst below capacity costs nothing). While a
    higher class has had a request within ``reserve_window_s``, a class fills only ``reserve`` ×
    the headroom (a tenant above its fair share of its class: ``tenant_reserve`` ×), measured against the smaller of its own TTFT budget and a typical request's of
    the higher class (trunk reservation): the rest is kept for the higher class. On by default;
    ``enabled: false`` binds every request to a worker on arrival (no queue, no 429 for overload)."""

    enabled: bool = True
    headroom: float = Field(default=1.0, gt=0, le=100,
                            description="dispatch while est. TTFT <= headroom x the request's TTFT budget")
    # 0.25 for a lower class (was 0.5, shared with tenants): two classes 30 % / 70 % at 2x capacity,
    # the high class's attainment 0.979-0.993 -> 0.993-1.000 on six conversation-trace runs; a
    # tenant above its share keeps 0.5 (0.25 there: agentic seed 1's light tenant 0.967 -> 0.767);
    # bench/results/admission.md, round 4
    reserve: float = Field(default=0.25, gt=0, le=1,
                           description="share of headroom a class may fill while a higher class is active")
    tenant_reserve: float = Field(default=0.5, gt=0, le=1,
                                  description="share of headroom a tenant above its fair share may fill")
    reserve_window_s: float = Field(default=10.0, ge=0)
    ttft_slo_base_s: float = Field(default=1.0, gt=0)
    ttft_slo_per_1k_s: float = Field(default=0.1, ge=0)
    tpot_slo_s: float = Field(default=0.1, ge=0, description="a worker whose decodes pace above this has no room (0: off)")
    queue_budget_s: float = Field(default=30.0, gt=0, le=3600)
    default_priority: int = Field(default=0, ge=-1000, le=1000)
    classes: dict[int, AdmissionClass] = Field(default_factory=dict)
    shed_late: bool = True
    hold_after_s: float = Field(default=3.0, ge=0, le=3600,
                                description="a spell without room shorter than this (and no hold within reserve_window_s) "
                                            "binds requests on arrival, as without the queue (0: always hold)")
    late_backlog_s: float = Field(default=10.0, ge=0, le=3600,
                                  description="shed_late answers 429 only once requests have waited without a break this "
                                              "long (a sustained backlog); before, a late request waits behind those on time")
    max_queue: int = Field(default=10_000, ge=1, le=10_000_000)
    tenant_header: str = "x-dplb-tenant"
    poll_ms: float = Field(default=20.0, gt=0, le=10_000)
    reroute_after: float = Field(default=0.5, ge=0, le=1,
                                 description="a request held for its worker this share of its TTFT budget goes to another "
                                             "worker that has room (0: never)")
    # 0.8 with lookahead 8 and reroute_after 0.5: agentic at 2x capacity, high class 0.893 -> 0.982
    # (4 engines, seed 0, tuned on), 0.951 -> 0.997 (seed 1), 0.979 -> 0.993 (8 engines);
    # bench/results/admission.md, round 5
    reserve_pace: float = Field(default=0.8, gt=0, le=1,
                                description="a lower-class request (a higher class active) waits while a decode on its worker "
                                            "paces above this x tpot_slo_s")
    tpot_holds: Literal["overload", "always"] = Field(
        default="always",
        description="when the TPOT rules (a decode the request would push over its bound, decodes pacing over) hold a "
                    "request: overload = only while the queue sees overload (within reserve_window_s a hold on the TTFT "
                    "estimate, a late or shed request, most decodes in flight pacing over; a sustained backlog), while "
                    "the reserve is in force, or for a request that fills only the reserve; always: at any load")
    decode_room: bool = Field(default=False,
                              description="a worker whose decode step, once the requests dispatched there and this one "
                                          "decode, would take longer than tpot_slo_s has no room (the kernel's decode-cost "
                                          "model: step_base_ms + decode_seq_ms x requests + decode_ctx_ns x context tokens)")
    lookahead: int = Field(default=8, ge=0, le=1000,
                           description="requests a pump sets aside while the worker each was routed to has no room, "
                                       "trying those behind them on other workers (0: the first without room stops it)")

    @field_validator("tenant_header")
    @classmethod
    def _lower(cls, v: str) -> str:
        if not v or not re.fullmatch(r"[A-Za-z0-9-]+", v):
            raise ValueError(f"not a header name: {v!r}")
        return v.lower()

    @field_validator("classes")
    @classmethod
    def _class_range(cls, v: dict[int, AdmissionClass]) -> dict[int, AdmissionClass]:
        for k in v:
            if not -1000 <= k <= 1000:
                raise ValueError(f"class priority {k} outside [-1000, 1000]")
        return v

    def budget_s(self, priority: int) -> float:
        """The queue budget of class ``priority``, seconds."""
        c = self.classes.get(priority)
        return self.queue_budget_s if c is None or c.queue_budget_s is None else c.queue_budget_s

    def ttft_budget_s(self, prompt_tokens: int) -> float:
        """The TTFT a request of ``prompt_tokens`` is allowed, seconds (its deadline's span)."""
        return self.ttft_slo_base_s + self.ttft_slo_per_1k_s * prompt_tokens / 1000.0

    def values(self) -> AdmissionSection:
        """A plain copy of this section's values (:class:`AdmissionValues`), for code that reads
        them per request: a pydantic model's attribute read costs ~0.14 µs against ~0.02 µs on a
        plain object (its ``__getattr__`` hook turns off CPython 3.11's attribute fast path; timeit,
        bench/results/long-prompts.md round 5). Typed as the section (same names, same methods);
        later changes to the section do not reach the copy."""
        return cast(AdmissionSection, AdmissionValues(self))


class AdmissionValues:
    """The values of an :class:`AdmissionSection` as plain attributes (every field, by name), with
    its :meth:`~AdmissionSection.budget_s` and :meth:`~AdmissionSection.ttft_budget_s`; made by
    :meth:`AdmissionSection.values`."""

    budget_s = AdmissionSection.budget_s
    ttft_budget_s = AdmissionSection.ttft_budget_s

    def __init__(self, section: AdmissionSection) -> None:
        for name in type(section).model_fields:
            setattr(self, name, getattr(section, name))

    def values(self) -> AdmissionSection:
        """Itself (already plain)."""
        return cast(AdmissionSection, self)


class Config(_Strict):
    """Whole router configuration (the ``dplb.yaml`` file)."""

    router: RouterSection = Field(default_factory=lambda: RouterSection())
    backend_servers: list[BackendServer] = Field(default_factory=list)
    health_check: HealthCheck = Field(default_factory=lambda: HealthCheck())
    routing_policy: RoutingPolicy = Field(default_factory=lambda: RoutingPolicy())
    circuit_breaker: CircuitBreaker = Field(default_factory=lambda: CircuitBreaker())
    retries: Retries = Field(default_factory=lambda: Retries())
    metrics: MetricsSection = Field(default_factory=lambda: MetricsSection())
    admission: AdmissionSection = Field(default_factory=lambda: AdmissionSection())
    kv_events: KVEventsSection = Field(default_factory=lambda: KVEventsSection())
    share: ShareSection = Field(default_factory=lambda: ShareSection())
    # what the launcher starts (several models on one box); empty: --num-workers/--model decide.
    # The router does not read it: the launcher validates it (launcher.config.LaunchWorker,
    # loaded with load_config(..., model=launcher.config.LaunchConfig))
    workers: list[dict[str, object]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _metrics_port(self) -> Config:
        if self.metrics.port is not None and self.metrics.port == self.router.port:
            raise ValueError(f"metrics.port {self.metrics.port} is router.port: give it a port of its own or leave "
                             "it unset (/metrics is served on the main port anyway)")
        if self.share.url and self.router.workers > 1:
            raise ValueError("share.url goes with router.workers 1: the processes of one node share its segment, "
                             "one of them would add the other nodes' load for all")
        return self

    @property
    def shm_name(self) -> str:
        """Segment name: ``router.shm`` or ``dplb-<port>``."""
        return self.router.shm or f"dplb-{self.router.port}"

    def admin_exposed(self) -> bool:
        """True when the router listens beyond loopback and no ``admin_token`` is set: anyone who
        reaches the port could drain, remove or add workers (``router.__main__`` refuses to start)."""
        return not self.router.admin_token and not is_loopback(self.router.host)

    @property
    def state_dir(self) -> str:
        """Directory holding admin state shared by router processes."""
        return self.router.state_dir or f"/tmp/dplb-router-{self.router.port}"


def _field_error(e: ValidationError) -> ConfigError:
    err = e.errors()[0]
    field = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
    return ConfigError(field, err.get("input"), err.get("msg", "invalid"))


# Any: the YAML document's nested mappings, each level narrowed by the isinstance below
def _set_dotted(d: dict[str, Any], dotted: str, value: object) -> None:  # type: ignore[explicit-any]
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError(dotted, value, f"'{k}' is not a mapping")
    d[keys[-1]] = value


C = TypeVar("C", bound=Config)


@overload
def load_config(path: str | os.PathLike | None = None, overrides: Mapping[str, object] | None = None) -> Config: ...


@overload
def load_config(path: str | os.PathLike | None, overrides: Mapping[str, object] | None, model: type[C]) -> C: ...


def load_config(path: str | os.PathLike | None = None, overrides: Mapping[str, object] | None = None,
                model: type[Config] = Config) -> Config:
    """Load and validate ``path`` (YAML; ``None`` → defaults), then apply ``overrides``.

    ``model``: the class to validate with (a subclass of :class:`Config` that says more about a
    section, e.g. the launcher's ``LaunchConfig`` for ``workers``).

    ``overrides`` maps dotted field names to values, e.g. ``{"router.port": 30001,
    "routing_policy.policy": "round_robin"}``; ``None`` values are skipped (flag not given).
    Raises :class:`ConfigError` naming the field on any invalid value, unknown key or YAML error.
    """
    raw: dict[str, object] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text()) if p.exists() else None
        except yaml.YAMLError as e:
            raise ConfigError("<file>", str(p), f"not valid YAML: {e}") from None
        if not p.exists():
            raise ConfigError("<file>", str(p), "no such file")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("<root>", type(loaded).__name__, "the file must hold a mapping")
        raw = loaded
    for k, v in (overrides or {}).items():
        if v is not None:
            _set_dotted(raw, k, v)
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise _field_error(e) from None


def config_from_json(text: str) -> Config:
    """Rebuild a :class:`Config` from :meth:`Config.model_dump_json` (used to hand the config to
    uvicorn's worker processes through an environment variable)."""
    try:
        return Config.model_validate_json(text)
    except ValidationError as e:
        raise _field_error(e) from None
