"""What one simulated run is given and what it returns: :class:`SimSettings` (the engines, the
router's config, the policy, the workload's rate and seed, the early-abort SLOs), the SLOs a run is
judged by (:class:`SLO`, :class:`AttainmentSLO`, with their defaults and sources) and
:class:`RunResult`, the raw outcome per request and per engine. The event loop that turns one into
the other is :mod:`simulate.cluster`; the figures of a result are :mod:`simulate.stats`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from router.config import Config
from sim_engine.config import EngineConfig

#: the status of a served request (``RunResult.status``)
OK = 200

#: a row of figures as :func:`simulate.stats.summarize` and the searches of :mod:`simulate.capacity`
#: build it and :mod:`simulate.report` prints and writes it (JSON-ready: numbers, strings, None,
#: nested rows and lists, keyed by the figure's name)
# Any: each value's type is fixed by its key (``ttft_p99`` a float or None, ``policy`` a str,
# ``probes`` a list of rows), which the readers know; one alias instead of a TypedDict per search
Figures = dict[str, Any]  # type: ignore[explicit-any]


class LoadSeries(TypedDict):
    """Load over time (``RunResult.load``): sample times (s) and, per engine, its queue (running
    + waiting), running requests and KV-cache usage (0..1) at each."""

    t: list[float]
    queue: list[list[int]]
    running: list[list[int]]
    kv: list[list[float]]

#: what a client tells the router as ``max_tokens`` for a request that will generate ``o`` tokens
#: (``SimSettings.client_max_tokens``): the exact length (an oracle), rounded up to a power of two,
#: four times over, or nothing
CLIENT_BOUNDS: dict[str, Callable[[int], int | None]] = {
    "exact": lambda o: o,
    "pow2": lambda o: 1 << max(0, (int(o) - 1).bit_length()),
    "x4": lambda o: 4 * int(o),
    "none": lambda o: None,
}


@dataclass
class SLO:
    """Service-level objective; ``None`` = no bound. Percentiles as :func:`dplb_trace.stats.percentile`."""

    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None


#: vLLM router's ``smetric`` policy defaults: ``smetric_ttft_slo_secs`` 1.0 and
#: ``smetric_ttft_slo_secs_per_1k_tokens`` 0.0625 (vllm-project/router, docs/load_balancing/README.md,
#: the SMetric section; the check is ``ttft_slo_base + ttft_slo_per_char * l`` in
#: src/policies/smetric.rs)
SMETRIC_TTFT_BASE_S = 1.0
SMETRIC_TTFT_PER_1K_S = 0.0625
#: the judging SLO's defaults. The fixed part is smetric's; the per-1k part is 0.1 s, not smetric's
#: 0.0625 s: the engine model's prefill is quadratic in the prompt (0.0325 ms per token + 1.06 ns
#: per attention pair), so an idle engine takes 1 + 0.092 s per 1k tokens for the longest prompt
#: of the conversation trace (126,195 tokens: TTFT 12.6 s, measured) and more than 1 + 0.0625 s
#: per 1k above about 79k tokens, 1.2 % of that trace, which no routing could then serve within the SLO (the
#: attainment would stay below 0.99 at any rate). 0.1 s per 1k (a guaranteed 10k prompt tokens/s)
#: covers every prompt up to the 131,072-token context on an idle engine. TPOT: DistServe's and
#: ``vllm bench serve --goodput``'s usual 100 ms.
DEFAULT_TTFT_BASE_S = SMETRIC_TTFT_BASE_S
DEFAULT_TTFT_PER_1K_S = 0.1
DEFAULT_TPOT_S = 0.1
DEFAULT_ATTAINMENT = (0.99, 0.90)
#: the stack's own time per request that a simulated engine's TTFT leaves out (HTTP, the router's
#: routing and relay, the engine's request parsing), seconds: 0 by default (the figures are the
#: engines' and the router's decisions alone). The live test stack's, measured:
#: :data:`simulate.fidelity.LIVE_STACK_OVERHEAD_S`; ``--stack-overhead-ms`` sets a deployment's.
DEFAULT_STACK_OVERHEAD_S = 0.0


@dataclass(frozen=True)
class AttainmentSLO:
    """Per-request SLO (DistServe's SLO attainment, Zhong et al. OSDI'24; ``vllm bench serve
    --goodput``): a request meets it when it was served, its TTFT ≤ ``ttft_base_s`` +
    ``ttft_per_1k_s`` × prompt tokens / 1000 (prompt tokens = the trace's ``input_length``) and its
    TPOT ≤ ``tpot_s`` (``None``: no TPOT bound). A request with one output token has no TPOT and is
    judged on its TTFT alone (``benchmark_serving`` gives it TPOT 0, which passes any bound). A
    request that was rejected (400, 503) or never finished (the run stopped early) misses."""

    ttft_base_s: float = DEFAULT_TTFT_BASE_S
    ttft_per_1k_s: float = DEFAULT_TTFT_PER_1K_S
    tpot_s: float | None = DEFAULT_TPOT_S

    def ttft_limit_s(self, prompt_tokens: int) -> float:
        """The TTFT bound of a prompt of ``prompt_tokens`` tokens, seconds."""
        return self.ttft_base_s + self.ttft_per_1k_s * prompt_tokens / 1000.0

    def as_dict(self) -> dict[str, float | None]:
        return {"ttft_base_s": self.ttft_base_s, "ttft_per_1k_s": self.ttft_per_1k_s, "tpot_s": self.tpot_s}


@dataclass
class SimSettings:
    """One simulated run. ``engines``: one :class:`EngineConfig` per engine (heterogeneous allowed);
    ``router``: the router's config (weights, thresholds, health interval); ``api``: what
    ``dplb-replay`` would send (chat or completions); ``load_points``: most samples of load over
    time kept per engine; ``abort_on``: stop as soon as this SLO is certainly missed (capacity
    search); ``abort_below``: the same for an SLO-attainment target."""

    engines: list[EngineConfig]
    policy: str = "dplb"
    router: Config = field(default_factory=Config)
    state_interval_ms: int = 200
    latency_window_s: float = 10.0
    rate_scale: float = 1.0
    api: str = "chat"
    seed: int = 0
    load_points: int = 300
    abort_on: SLO | None = None
    #: stop as soon as the share of requests meeting this SLO is certainly below the target
    #: (``(slo, q)``: more than ``(1 − q)`` of the window has missed; capacity search)
    abort_below: tuple[AttainmentSLO, float] | None = None
    #: the prefix-aware policies see each engine's true cached prefix of the request (its KV cache
    #: looked up with the request's block hashes at arrival) instead of the router's prefix index
    #: (:class:`OracleIndex`; issue 29 item 2: what the index costs)
    oracle_prefix: bool = False
    #: factor on the latencies the agents publish (1: simulated time). A live cluster whose engines
    #: run at ``--time-scale T`` has agents that measure wall time, T times shorter: 1/T mimics it
    #: (``simulate.fidelity``; with state interval, latency window and health interval × T)
    agent_latency_scale: float = 1.0
    #: the ``max_tokens`` the router is told, of :data:`CLIENT_BOUNDS` (the engine generates the
    #: trace's output length whatever it is): the trace's length (``exact``, an oracle; what every
    #: run before issue 29's round 8 used), a client's looser bound or none
    client_max_tokens: str = "exact"
    #: router replicas behind a round-robin front, each with its own segment, policy state and
    #: scrapers, the engines shared (:mod:`simulate.replicas`; 1: the one router)
    replicas: int = 1
    #: like ``oracle_prefix``, but the truth as the engines' KV-cache events tell it: each engine's
    #: block set (:class:`router.kv_events.BlockSet`, shared by every replica) takes the events of a
    #: step when the step ends, as vLLM publishes them after the step (``--events-prefix``)
    events_prefix: bool = False
    #: with ``events_prefix``: a replica's own placements count as the engine's blocks until the
    #: engine's events store them or this many seconds pass (:class:`router.kv_events.PendingBlocks`;
    #: 0: the events alone)
    events_pending_s: float = 30.0
    #: with replicas: their router lines shared through a store, each change reaching the other
    #: replicas this many ms later (:class:`simulate.replicas.SharedLoad`; None: nothing shared)
    share_load_ms: float | None = None
    #: per request (window order) its priority class and tenant (None: the admission config's
    #: default class, one anonymous tenant); read by the router's admission queue
    #: (``router.admission``, on unless ``router.admission.enabled`` is false)
    priorities: list[int] | None = None
    tenants: list[str] | None = None
    #: seconds between the router's dispatch of a request (its lease taken) and the engine
    #: receiving it: the stack's own time per request, which a live TTFT includes and the router's
    #: learned prefill rate sees (:data:`DEFAULT_STACK_OVERHEAD_S`; 0: none)
    stack_overhead_s: float = DEFAULT_STACK_OVERHEAD_S


@dataclass
class RunResult:
    """Raw outcome of a run: per request (index = position in the window) and per engine.

    Times in seconds. ``status``: 200 served, else the HTTP status the client got. ``ttft``/``e2e``/
    ``queue``: None unless served. ``engine_stats``: per engine ``EngineCore.state()``-like counters.
    ``load``: ``{"t": [...], "queue": [[per sample] per engine], "running": ..., "kv": ...}``.
    """

    policy: str
    arrival: list[float]
    status: list[int]
    worker: list[int]
    ttft: list[float | None]
    e2e: list[float | None]
    queue: list[float | None]
    output_tokens: list[int]
    cached_tokens: list[int]
    prompt_tokens: list[int]
    engine_stats: list[dict[str, float]]
    load: LoadSeries
    end_time: float
    aborted: bool = False
    events: int = 0
    #: ``{"replicas": R, "accounting_error": ...}`` (:class:`simulate.replicas.AccountingError`)
    replicas: Figures | None = None
    #: seconds each request waited in the router's admission queue (None: never queued there,
    #: or admission off); its class and tenant (as :class:`SimSettings`)
    waited: list[float | None] = field(default_factory=list)
    priority: list[int] = field(default_factory=list)
    tenant: list[str] = field(default_factory=list)
    #: per engine, the prefill rate the router (replica 0) had learned at the end, tokens per
    #: simulated second (0: none learned; router/accounting.py)
    prefill_rate: list[float] = field(default_factory=list)
