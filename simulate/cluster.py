"""The whole cluster in virtual time: N engines, their agents and one router, driven by an event queue.

Events (virtual seconds; no sockets, no sleeping)::

    arrival i          the router routes request i through its real pipeline
                       (router.scheduling.Scheduler: eligibility → policy → Lease), the chosen
                       engine queues it (sim_engine EngineCore.add_request; the router forwards
                       straight to the engine; a request it can never serve is rejected with the
                       engine's HTTP status, 400, which the router passes through unchanged); an
                       idle engine starts a step at once
    step end (k)       EngineCore.complete: tokens of the step; a request's first token passes
                       Lease.first_token(); a finished one feeds the slot's latency windows (live,
                       the agent derives them from the engine's own histograms at its next scrape)
                       and Lease.release(); then the next step is scheduled if the engine has work
    agent tick (k)     every state interval (default 200 ms, the agent's --state-interval-ms), at a
                       seeded phase per agent: the engine's running / waiting / KV usage are
                       published into slot k (Agent.publish_engine, the live probe loop's body)
                       with a fresh heartbeat
    router tick        every health_check.interval_ms: Registry.sync(segment snapshot), the
                       health monitor's sync (probes always pass: no faults are simulated)

    sample             every max(state interval, span / load_points): each engine's true queue
                       (running + waiting), running count and KV usage, for the load-over-time
                       figures (an observer; nothing reads it)

Ties at one instant: step ends, then agent ticks, router ticks, samples, then arrivals.

Information model, as live: the slot fields the engine owns (running, waiting, KV usage) change
only at agent ticks (the agent is off the data path: it sees no request); the router's own
accounting (router/accounting.py: in flight, outstanding prefill tokens, decoding requests and
context, learned prefill rate) changes at dispatch, first token and end, through the real Lease.
The latency windows are fed at each request's end rather than at the next scrape (a simplification;
only the ``weighted`` policy reads them). The kernel reads the same kind of segment, a private one created
here (unique name, always unlinked), and judges heartbeats against the virtual clock: slot writers
run with ``now_override_ns``, policies and the registry get ``clock=``.

What is not modelled: network and router/agent CPU time (zero), HTTP retries (the sim engine
answers 400 only, which is never retried), probe failures, breaker trips, agent ``--max-queue``.
"""
from __future__ import annotations

import atexit
import heapq
import os
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.trace import TraceRequest
from dplb_shm import Segment, WorkerState
from router.config import Config
from router.errors import NoEligibleWorker
from router.policies import RequestInfo, build_policy
from router.protocol import CHAT, COMPLETIONS
from router.scheduling import Lease, Scheduler
from router.state import learn_settings, scoring_params, ttft_params
from router.workers import Registry
from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore
from sim_engine.errors import SimEngineError
from sim_engine.request import SimRequest
from simulate.workload import (
    EngineHasher,
    RenderedPrompt,
    router_prompt_len,
    router_text,
    template,
)
from worker_agent.agent import Agent
from worker_agent.config import AgentConfig
from worker_agent.engines import ENGINES
from worker_agent.metrics import EngineMetrics

#: virtual time 0 is this many ns on the segment's clock (heartbeat 0 means "never written")
OFFSET_NS = 1_000_000_000
#: the engine kind every simulated worker's agent is (the engine table, worker_agent/engines.py):
#: its vLLM metric names are the ones the virtual engines' counts stand for
SIM = ENGINES["sim"]

STEP_END, AGENT_TICK, ROUTER_TICK, SAMPLE = 0, 1, 2, 3
OK = 200


#: what a client tells the router as ``max_tokens`` for a request that will generate ``o`` tokens
#: (``SimSettings.client_max_tokens``): the exact length (an oracle), rounded up to a power of two,
#: four times over, or nothing
CLIENT_BOUNDS: dict[str, Callable[[int], int | None]] = {
    "exact": lambda o: o,
    "pow2": lambda o: 1 << max(0, (int(o) - 1).bit_length()),
    "x4": lambda o: 4 * int(o),
    "none": lambda o: None,
}


class VirtualClock:
    """Simulated time ``t`` (seconds); :meth:`now_ns` is the same instant on the segment's clock."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def now_ns(self) -> int:
        return OFFSET_NS + round(self.t * 1e9)


@dataclass
class SLO:
    """Service-level objective; ``None`` = no bound. Percentiles as :func:`bench.stats.percentile`."""

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
    engine_stats: list[dict[str, Any]]
    load: dict[str, Any]
    end_time: float
    aborted: bool = False
    events: int = 0


# ---- segments are always unlinked -----------------------------------------------------------------

_LIVE_SEGMENTS: set[str] = set()


def _unlink_leftovers() -> None:
    for name in list(_LIVE_SEGMENTS):
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass
        _LIVE_SEGMENTS.discard(name)


atexit.register(_unlink_leftovers)


def private_segment(num_slots: int) -> Segment:
    """A new segment with a unique name, registered for unlinking at exit as a last resort."""
    name = f"dplb-sim-{os.getpid()}-{uuid.uuid4().hex[:10]}"
    seg = Segment.create(name, num_slots=num_slots)
    _LIVE_SEGMENTS.add(name)
    return seg


def release_segment(seg: Segment) -> None:
    """Close and unlink ``seg`` (idempotent)."""
    name = seg.name
    try:
        if not seg.closed:
            seg.close()
    finally:
        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
        _LIVE_SEGMENTS.discard(name)


class _NoAdapter:
    """The agent's engine adapter is replaced by the simulator (no process, no HTTP)."""

    name = SIM.name
    upstream = None
    proc = None
    log_path = ""


class _NoGpu:
    available = False


# ---- the run --------------------------------------------------------------------------------------

class OracleIndex:
    """A policy's prefix index whose matches are the engines' truth (``--oracle-prefix``).

    Wraps the policy's :class:`router.policies.prefix_index.PrefixIndex`: hashing, insertion, size
    and removal go to it (so what a policy reads besides the matches, e.g. cache_aware's tree
    sizes, is unchanged); :meth:`match` answers with :attr:`current`, set by the simulation before
    each routing decision to ``{worker_id: characters}``, the share of the request's text equal to
    the share of its engine prompt tokens that engine holds in its prefix cache. ``chunk_chars`` is
    1, so :func:`router.policies.prefix_index.uncached_tokens` then gives prompt tokens minus cached
    tokens (to rounding) and cache_aware's match rate is the cached fraction."""

    chunk_chars = 1

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.current: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.inner)

    def hashes(self, text: str, model: str | None = None) -> list[int]:
        return list(self.inner.hashes(text, model))

    def match(self, hashes: list[int]) -> dict[int, int]:
        return dict(self.current)

    def insert(self, hashes: list[int], worker_id: int) -> None:
        self.inner.insert(hashes, worker_id)

    def size(self, worker_id: int) -> int:
        return int(self.inner.size(worker_id))

    def remove_worker(self, worker_id: int) -> None:
        self.inner.remove_worker(worker_id)


class _Engine:
    __slots__ = ("agent", "core", "hasher", "k", "plan", "writer")

    def __init__(self, k: int, core: EngineCore, agent: Agent, hasher: EngineHasher) -> None:
        self.k = k
        self.core = core
        self.agent = agent
        self.writer = agent.writer
        self.hasher = hasher
        self.plan: Any = None


def _threshold_count(n: int, q: float = 99.0) -> int:
    """Samples above S among ``n`` that make the ``q``-th percentile (linear interpolation) exceed S
    for certain: with ``lo = floor((n-1)·q/100)`` the sorted value at ``lo`` is then above S."""
    lo = int((n - 1) * q / 100.0)
    return n - lo


class Simulation:
    """One policy over one workload (see the module docstring). Use :meth:`run` once."""

    def __init__(self, requests: Sequence[TraceRequest], settings: SimSettings,
                 hashers: dict[tuple[int, str], EngineHasher] | None = None) -> None:
        if not requests:
            raise ValueError("no request to simulate")
        if not settings.engines:
            raise ValueError("at least one engine is needed")
        if settings.rate_scale <= 0:
            raise ValueError(f"rate scale must be > 0 (got {settings.rate_scale})")
        self.reqs = list(requests)
        self.s = settings
        self.hashers = hashers if hashers is not None else {}

    def run(self, progress: Callable[[int, int, float], None] | None = None) -> RunResult:
        """Simulate to the last request's end. ``progress(done, total, virtual_t)`` is called every
        few hundred events. The private segment is unlinked whatever happens."""
        seg = private_segment(len(self.s.engines))
        try:
            return self._run(seg, progress)
        finally:
            release_segment(seg)

    def _run(self, seg: Segment, progress: Callable[[int, int, float], None] | None) -> RunResult:
        s = self.s
        reqs = self.reqs
        n = len(reqs)
        rng = random.Random(s.seed)
        clock = VirtualClock()
        now_ns = clock.now_ns
        seg.seed(s.seed)
        cfg = s.router
        # agents: claim their slots, READY, first publication at t = 0
        engines: list[_Engine] = []
        for k, ecfg in enumerate(s.engines):
            core = EngineCore(ecfg)
            acfg = AgentConfig(worker_id=k, shm=seg.name, uds=f"/sim/agent-{k}.sock", engine=SIM.name,
                               model=ecfg.model, state_interval_ms=s.state_interval_ms,
                               max_num_seqs=ecfg.max_num_seqs, latency_window_s=s.latency_window_s)
            agent = Agent(acfg, adapter=_NoAdapter(), segment=seg, nvml=_NoGpu())  # type: ignore[arg-type]
            agent.writer.now_override_ns = now_ns()
            agent.writer.claim(worker_id=k, pid=os.getpid(), endpoint=acfg.uds, gpu_ids=[], weight=1.0,
                               model=ecfg.model, max_num_seqs=ecfg.max_num_seqs)
            agent.state = WorkerState.READY
            agent.writer.set_state(WorkerState.READY)
            agent.publish_engine(EngineMetrics(num_running=0, num_waiting=0, kv_cache_usage=0.0))
            key = (ecfg.block_size, s.api)
            if key not in self.hashers:
                self.hashers[key] = EngineHasher(ecfg.block_size, s.api)
            engines.append(_Engine(k, core, agent, self.hashers[key]))
        # the router: its real pipeline over that segment, on the virtual clock
        policy = build_policy(s.policy, cfg.routing_policy, kernel=seg, params=scoring_params(cfg),
                              ttft_params=ttft_params(cfg), rng=random.Random(rng.getrandbits(64)), clock=now_ns)
        registry = Registry(seg, cfg, clock=now_ns)
        registry.sync(seg.snapshot())
        scheduler = Scheduler(registry, policy, seg, metrics=None, learn=learn_settings(cfg),
                              default_rate=cfg.routing_policy.prefill_tokens_per_s, clock_s=lambda: clock.t)
        needs_text = bool(getattr(policy, "needs_text", True))
        oracle: OracleIndex | None = None
        n_template = sum(len(part) for part in template(s.api))   # the engine's tokens around the words
        if s.oracle_prefix and getattr(policy, "index", None) is not None:
            oracle = OracleIndex(policy.index)   # type: ignore[attr-defined]
            policy.index = oracle                # type: ignore[attr-defined]
        path = CHAT if s.api == "chat" else COMPLETIONS
        bound = CLIENT_BOUNDS[s.client_max_tokens]
        model = s.engines[0].model

        # per request
        arr = [r.timestamp_ms / 1000.0 / s.rate_scale for r in reqs]
        status = [0] * n
        worker = [-1] * n
        ttft: list[float | None] = [None] * n
        e2e: list[float | None] = [None] * n
        queue: list[float | None] = [None] * n
        out_tok = [0] * n
        cached = [0] * n
        prompt_tok = [r.input_length for r in reqs]
        leases: list[Lease | None] = [None] * n

        # load over time: every engine's true queue, sampled every `sample_dt` (a SAMPLE event)
        span = max(arr[-1], 1e-9)
        interval = s.state_interval_ms / 1000.0
        sample_dt = max(interval, span / max(1, s.load_points))
        load_t: list[float] = []
        load_q: list[list[int]] = [[] for _ in engines]
        load_r: list[list[int]] = [[] for _ in engines]
        load_kv: list[list[float]] = [[] for _ in engines]

        # SLO early abort
        slo = s.abort_on
        ttft_lim = slo.ttft_p99_s if slo is not None else None
        tpot_lim = slo.tpot_p99_s if slo is not None else None
        over_needed = _threshold_count(n)
        over_ttft = over_tpot = 0
        aborted = False
        # SLO-attainment early abort: misses are certain at the first token (TTFT over the request's
        # bound), at the end (TPOT over the bound) or at a rejection; stop once met <= n - misses
        # can no longer reach q·n (the same comparison simulate.stats.slo_attainment judges by)
        att = s.abort_below
        att_lim = [att[0].ttft_limit_s(r.input_length) for r in reqs] if att is not None else []
        att_tpot = att[0].tpot_s if att is not None else None
        att_q = att[1] if att is not None else 0.0
        missed = bytearray(n)
        n_missed = 0

        def miss(i: int) -> bool:
            """Count request ``i`` as missed (once); True when the target is now out of reach."""
            nonlocal n_missed
            if att is None or missed[i]:
                return False
            missed[i] = 1
            n_missed += 1
            return (n - n_missed) / n < att_q

        heap: list[tuple[float, int, int, int]] = []
        seq = 0
        phase = [rng.uniform(0.0, interval) for _ in engines]   # agents start at different moments
        tick_no = [0] * len(engines)
        for k in range(len(engines)):
            heapq.heappush(heap, (phase[k], AGENT_TICK, seq, k))
            seq += 1
        hc_interval = cfg.health_check.interval_ms / 1000.0
        r_phase = rng.uniform(0.0, hc_interval)
        r_tick = 0
        heapq.heappush(heap, (r_phase, ROUTER_TICK, seq, -1))
        seq += 1
        n_sample = 0
        heapq.heappush(heap, (0.0, SAMPLE, seq, -1))
        seq += 1

        def start_step(e: _Engine, t: float) -> None:
            nonlocal seq
            core = e.core
            plan = core.schedule(t)
            if plan.scheduled:
                e.plan = plan
                heapq.heappush(heap, (t + plan.duration, STEP_END, seq, e.k))
                seq += 1
            elif core.has_work():  # nothing fits this instant (the live runner waits 1 ms too)
                e.plan = False
                heapq.heappush(heap, (t + 0.001, STEP_END, seq, e.k))
                seq += 1
            else:
                e.plan = None

        ms = 1000.0 * s.agent_latency_scale
        done = 0
        i_next = 0
        events = 0
        inf = float("inf")
        heappop = heapq.heappop
        while done < n:
            ta = arr[i_next] if i_next < n else inf
            if heap and heap[0][0] <= ta:
                t, kind, _, k = heappop(heap)
                clock.t = t
                events += 1
                if kind == STEP_END:
                    e = engines[k]
                    plan = e.plan
                    e.plan = None
                    if plan is False:
                        start_step(e, t)
                        continue
                    produced = e.core.complete(plan, t)
                    if produced:
                        e.writer.now_override_ns = now_ns()
                    for req in produced:
                        i = req.sink
                        n_out = len(req.output)
                        lease = leases[i]
                        lease.tokens = n_out   # what the live proxy's stream meter counts
                        if n_out == 1:
                            ft = t - arr[i]
                            ttft[i] = ft
                            queue[i] = req.first_scheduled - arr[i]
                            cached[i] = req.num_cached_tokens
                            lease.first_token(now=t)
                            if ttft_lim is not None and ft > ttft_lim:
                                over_ttft += 1
                            if att is not None and ft > att_lim[i] and miss(i):
                                aborted = True
                        if req.finish_reason is not None:
                            total = t - arr[i]
                            ft = ttft[i]
                            tpot = (total - ft) / (n_out - 1) if n_out > 1 else None
                            # the agent publishes latency windows from the engine's own histograms
                            e.writer.record_latency(ttft_ms=ft * ms, tpot_ms=None if tpot is None else tpot * ms,
                                                    e2e_ms=total * ms)
                            lease.release(now=t)   # as the live proxy: without the output count
                            leases[i] = None
                            e2e[i] = total
                            out_tok[i] = n_out
                            status[i] = OK
                            done += 1
                            if tpot_lim is not None and tpot is not None and tpot > tpot_lim:
                                over_tpot += 1
                            if (att_tpot is not None and tpot is not None and tpot > att_tpot
                                    and miss(i)):
                                aborted = True
                    if over_ttft >= over_needed or over_tpot >= over_needed:  # 0 unless an SLO is set
                        aborted = True
                    if aborted:
                        break
                    start_step(e, t)
                elif kind == AGENT_TICK:
                    e = engines[k]
                    core = e.core
                    e.writer.now_override_ns = now_ns()
                    e.agent.publish_engine(EngineMetrics(num_running=len(core.running),
                                                          num_waiting=len(core.waiting),
                                                          kv_cache_usage=core.kv.usage))
                    tick_no[k] += 1
                    heapq.heappush(heap, (phase[k] + tick_no[k] * interval, AGENT_TICK, seq, k))
                    seq += 1
                elif kind == ROUTER_TICK:
                    registry.sync(seg.snapshot())
                    r_tick += 1
                    heapq.heappush(heap, (r_phase + r_tick * hc_interval, ROUTER_TICK, seq, -1))
                    seq += 1
                else:  # SAMPLE
                    load_t.append(round(t, 3))
                    for e in engines:
                        core = e.core
                        nr = len(core.running)
                        load_q[e.k].append(nr + len(core.waiting))
                        load_r[e.k].append(nr)
                        load_kv[e.k].append(round(core.kv.usage, 4))
                    n_sample += 1
                    heapq.heappush(heap, (n_sample * sample_dt, SAMPLE, seq, -1))
                    seq += 1
            else:
                i = i_next
                i_next += 1
                t = ta
                clock.t = t
                events += 1
                r = reqs[i]
                text = router_text(r, s.api) if needs_text else ""
                info = RequestInfo(path, model, True, text, router_prompt_len(r, s.api),
                                   max_tokens=bound(r.output_length) if r.output_length > 0 else None)
                if oracle is not None:
                    oracle.current = {}
                    by_hasher: dict[int, list[int]] = {}
                    for e in engines:
                        hs = by_hasher.get(id(e.hasher))
                        if hs is None:
                            hs = by_hasher[id(e.hasher)] = e.hasher.hashes(r)
                        bs = e.core.config.block_size
                        n_tok = r.input_length + n_template
                        hit = len(e.core.kv.lookup(hs, (n_tok - 1) // bs)) * bs
                        if hit and text:
                            oracle.current[e.k] = max(1, round(len(text) * hit / n_tok))
                try:
                    lease, d = scheduler.select(info, now=t)
                except NoEligibleWorker as err:
                    status[i] = err.status
                    done += 1
                    if miss(i):
                        aborted = True
                        break
                    continue
                k = d.worker_id
                e = engines[k]
                worker[i] = k
                e.writer.now_override_ns = now_ns()
                sreq = SimRequest(str(i), RenderedPrompt(r, s.api), r.output_length, e.core.config.block_size,  # type: ignore[arg-type]
                                  sink=i, hashes=e.hasher.hashes(r))
                try:
                    e.core.add_request(sreq, t)
                except SimEngineError as err:
                    status[i] = err.status
                    lease.release(now=t)
                    done += 1
                    if miss(i):
                        aborted = True
                        break
                    continue
                leases[i] = lease
                if e.plan is None:
                    start_step(e, t)
            if progress is not None and events % 512 == 0:
                progress(done, n, clock.t)
        if progress is not None:
            progress(done, n, clock.t)
        # whatever is still in flight after an abort gives its lease back
        for lease in leases:
            if lease is not None:
                lease.release(now=clock.t)
        load = {"t": load_t, "queue": load_q, "running": load_r, "kv": load_kv}
        stats = []
        for e in engines:
            st = e.core.stats
            stats.append({"preemptions": st.num_preemptions, "prefix_cache_queries": st.prefix_cache_queries,
                          "prefix_cache_hits": st.prefix_cache_hits, "steps": st.steps,
                          "busy_time_s": st.busy_time, "generation_tokens": st.generation_tokens,
                          "prompt_tokens": st.prompt_tokens})
        return RunResult(policy=s.policy, arrival=arr, status=status, worker=worker, ttft=ttft, e2e=e2e,
                         queue=queue, output_tokens=out_tok, cached_tokens=cached, prompt_tokens=prompt_tok,
                         engine_stats=stats, load=load, end_time=clock.t, aborted=aborted, events=events)
