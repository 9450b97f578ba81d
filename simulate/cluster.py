"""The whole cluster in virtual time: N engines, their agents and one router, driven by an event queue.

Events (virtual seconds; no sockets, no sleeping)::

    arrival i          the router routes request i through its real pipeline
                       (router.scheduling.Scheduler: eligibility → policy → Lease), the chosen
                       engine queues it (sim_engine EngineCore.add_request; a request it can never
                       serve is rejected with the engine's HTTP status, 400, which the router
                       passes through unchanged); an idle engine starts a step at once
    engine in i        with ``SimSettings.stack_overhead_s`` > 0 the engine gets request i that
                       long after the router dispatched it (its lease taken): the live stack's own
                       time per request (HTTP, relays, the router's and the engine's parsing), in
                       its TTFT and in the router's learned prefill rate; 0: at the dispatch
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

    admission          with the router's admission queue on (the config's ``admission``, on by
                       default): an arrival is offered to the queue (router/admission.py, the
                       router's code), which dispatches it at once while the cluster has room and
                       else holds it; the queue is pumped again at each first token and end (the
                       router's accounting changed) and agent tick, and every ``poll_ms`` while
                       requests wait, as the live router's poller does (simulate/admission.py)

Ties at one instant: step ends, then agent ticks, router ticks, samples, admission timers,
shared-load deliveries, requests reaching their engine, then arrivals.

Information model, as live: the slot fields the engine owns (running, waiting, KV usage) change
only at agent ticks (the agent is off the data path: it sees no request); the router's own
accounting (router/accounting.py: in flight, outstanding prefill tokens, decoding requests and
context, learned prefill rate) changes at dispatch, first token and end, through the real Lease.
The latency windows are fed at each request's end rather than at the next scrape (a simplification;
only the ``weighted`` policy reads them). The kernel reads the same kind of segment, a private one created
here (unique name, always unlinked), and judges heartbeats against the virtual clock: slot writers
run with ``now_override_ns``, policies and the registry get ``clock=``.

What is not modelled: the stack's time apart from one fixed delay per request (``stack_overhead_s``:
no queueing for the router's CPU, no dependence on the prompt's size), HTTP retries (the sim engine
answers 400 only, which is never retried), probe failures, breaker trips, agent ``--max-queue``.

Router replicas (``SimSettings.replicas`` R > 1, :mod:`simulate.replicas`): R routers behind a
round-robin front, each with its own segment, policy and registry; every engine has one agent per
replica's segment, all publishing at the engine's tick; the router tick syncs every registry.
With ``events_prefix`` the engines' KV-cache events, taken at each step end, are every replica's
prefix truth. With ``share_load_ms`` their router lines are shared (:class:`simulate.replicas.SharedLoad`).

Here: the event loop, one handler per event kind (:class:`_Run`). What a run is given and returns:
:mod:`simulate.settings`; the cluster's parts (virtual clock, private segment, engines with their
agents, the oracle prefix index): :mod:`simulate.virtual`; when a run may stop early:
:mod:`simulate.early_abort`.
"""
from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from typing import cast

from dplb_protocol.wire import CHAT, COMPLETIONS
from dplb_shm import Segment
from dplb_trace.mooncake import TraceRequest
from router.config import Config
from router.errors import NoEligibleWorker
from router.kv_events import BlockSet
from router.policies import Decision, RequestInfo, build_policy
from router.scheduling import Lease, Scheduler
from router.state import learn_settings, scoring_params, ttft_params
from router.workers import Registry
from sim_engine.errors import SimEngineError
from sim_engine.request import SimRequest
from simulate.admission import SHED_STATUS, SimAdmission
from simulate.early_abort import EarlyAbort
from simulate.replicas import (
    AccountingError,
    Replica,
    RoundRobinFront,
    SharedLoad,
    add_scrapers,
    apply_kv_events,
    keep_pending,
)
from simulate.settings import CLIENT_BOUNDS, OK, RunResult, SimSettings
from simulate.virtual import (
    LoadSampler,
    OracleIndex,
    SimWorker,
    VirtualClock,
    private_segment,
    release_segment,
    start_engines,
)
from simulate.workload import (
    EngineHasher,
    RenderedPrompt,
    router_prompt_len,
    router_text,
    template,
)
from worker_agent.metrics import EngineMetrics

STEP_END, AGENT_TICK, ROUTER_TICK, SAMPLE, ADMIT_TICK, SHARE, ENGINE_IN = 0, 1, 2, 3, 4, 5, 6


class _Run:
    """One run's state between events, and one handler per event kind (the module docstring):
    :meth:`step_end`, :meth:`agent_tick`, :meth:`router_tick`, :meth:`sample`, :meth:`arrival`;
    :meth:`loop` pops the events in order and calls them."""

    def __init__(self, reqs: list[TraceRequest], s: SimSettings,
                 hashers: dict[tuple[int, str], EngineHasher], segs: list[Segment]) -> None:
        self.reqs = reqs
        self.s = s
        n = self.n = len(reqs)
        rng = random.Random(s.seed)
        self.clock = VirtualClock()
        now_ns = self.now_ns = self.clock.now_ns
        for seg in segs:
            seg.seed(s.seed)
        self.segs = segs
        cfg = s.router
        self.engines = start_engines(segs[0], s, hashers, now_ns)
        add_scrapers(self.engines, segs[1:], s, now_ns())
        # the routers: R replicas behind a round-robin front (simulate.replicas), replica 0 first
        self.replicas = [self._start_router(r, seg, cfg, rng) for r, seg in enumerate(segs)]
        self.via = [0] * n   # the replica each request reached
        self.front = RoundRobinFront(len(segs))
        self.accounting = AccountingError()
        self.share = SharedLoad(segs, len(self.engines), s.share_load_ms) if s.share_load_ms is not None else None
        self.needs_text = bool(getattr(self.replicas[0].policy, "needs_text", True))
        self.n_template = sum(len(part) for part in template(s.api))   # the engine's tokens around the words
        self.block_sets: list[BlockSet] = []
        if s.events_prefix:
            for e in self.engines:
                e.core.kv.events = []
                e.core.kv.event_tokens = False   # matched by the engine's hashes: no tokens needed
                self.block_sets.append(BlockSet(f"engine {e.k}"))
            if s.events_pending_s > 0:
                keep_pending(self.replicas, self.block_sets, s.events_pending_s, self.share)
        self.path = CHAT if s.api == "chat" else COMPLETIONS
        self.bound = CLIENT_BOUNDS[s.client_max_tokens]
        self.model = s.engines[0].model
        # per request
        self.arr = [r.timestamp_ms / 1000.0 / s.rate_scale for r in reqs]
        self.status = [0] * n
        self.worker = [-1] * n
        self.ttft: list[float | None] = [None] * n
        self.e2e: list[float | None] = [None] * n
        self.queue: list[float | None] = [None] * n
        self.out_tok = [0] * n
        self.cached = [0] * n
        self.leases: list[Lease | None] = [None] * n
        self.load = LoadSampler(len(self.engines))
        self.judge = EarlyAbort(s, reqs)
        self.aborted = False
        self.done = 0
        self.ms = 1000.0 * s.agent_latency_scale
        self._schedule_ticks(cfg, rng)
        # the router's admission queue (router.admission through simulate.admission), on unless
        # the config turns it off
        self.prios = s.priorities
        self.tenants = s.tenants
        # one queue per router replica (each router process holds its own)
        self.adms = ([SimAdmission(cfg.admission, rp.scheduler, n, self.dispatch, self._reject_at,
                                   self._preparer(rp.oracle)) for rp in self.replicas]
                     if cfg.admission.enabled else [])
        self.admit_tick = False

    def _start_router(self, r: int, seg: Segment, cfg: Config, rng: random.Random) -> Replica:
        """Router replica ``r``: its real pipeline over its segment ``seg``, on the virtual clock;
        with ``oracle_prefix`` or ``events_prefix`` its prefix index answers with the engines' truth
        (:class:`OracleIndex`)."""
        s, now_ns, clock = self.s, self.now_ns, self.clock
        policy = build_policy(s.policy, cfg.routing_policy, kernel=seg, params=scoring_params(cfg),
                              ttft_params=ttft_params(cfg), rng=random.Random(rng.getrandbits(64)), clock=now_ns)
        registry = Registry(seg, cfg, clock=now_ns)
        registry.sync(seg.snapshot())
        scheduler = Scheduler(registry, policy, seg, metrics=None, learn=learn_settings(cfg),
                              default_rate=cfg.routing_policy.prefill_tokens_per_s, clock_s=lambda: clock.t)
        oracle: OracleIndex | None = None
        if (s.oracle_prefix or s.events_prefix) and getattr(policy, "index", None) is not None:
            oracle = OracleIndex(policy.index)   # type: ignore[attr-defined]
            policy.index = oracle                # type: ignore[attr-defined]
        return Replica(r, seg, policy, registry, scheduler, oracle)

    def _schedule_ticks(self, cfg: Config, rng: random.Random) -> None:
        """The first agent ticks (each agent at a seeded phase: they start at different moments),
        router tick and sample; the sample period is max(state interval, span / load_points)."""
        s = self.s
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        span = max(self.arr[-1], 1e-9)
        self.interval = s.state_interval_ms / 1000.0
        self.sample_dt = max(self.interval, span / max(1, s.load_points))
        self.phase = [rng.uniform(0.0, self.interval) for _ in self.engines]
        self.tick_no = [0] * len(self.engines)
        for k in range(len(self.engines)):
            self.push(self.phase[k], AGENT_TICK, k)
        self.hc_interval = cfg.health_check.interval_ms / 1000.0
        self.r_phase = rng.uniform(0.0, self.hc_interval)
        self.r_tick = 0
        self.push(self.r_phase, ROUTER_TICK, -1)
        self.n_sample = 0
        self.push(0.0, SAMPLE, -1)

    def push(self, t: float, kind: int, k: int) -> None:
        """Schedule an event of ``kind`` for engine ``k`` (-1: none) at ``t``."""
        heapq.heappush(self.heap, (t, kind, self.seq, k))
        self.seq += 1

    def loop(self, progress: Callable[[int, int, float], None] | None) -> RunResult:
        """Run every event in order (ties: step ends, agent ticks, router ticks, samples, then
        arrivals) until every request is done or the run aborts; ``progress`` every 512 events."""
        n, arr, heap, clock = self.n, self.arr, self.heap, self.clock
        share = self.share
        handlers = (self.step_end, self.agent_tick, self.router_tick, self.sample, self.admit_timer,
                    share.deliver if share is not None else lambda t, k: None, self.engine_in)
        heappop = heapq.heappop
        inf = float("inf")
        i_next = 0
        events = 0
        while self.done < n:
            ta = arr[i_next] if i_next < n else inf
            if heap and heap[0][0] <= ta:
                t, kind, _, k = heappop(heap)
                clock.t = t
                events += 1
                handlers[kind](t, k)
            else:
                clock.t = ta
                events += 1
                self.arrival(i_next, ta)
                i_next += 1
            if share is not None and (due := share.publish(clock.t)) is not None:
                self.push(due, SHARE, -1)
            if self.aborted:
                break
            if progress is not None and events % 512 == 0:
                progress(self.done, n, clock.t)
        if progress is not None:
            progress(self.done, n, clock.t)
        return self.result(events)

    # ---- one handler per event kind ----------------------------------------------------------------

    def start_step(self, e: SimWorker, t: float) -> None:
        """Engine ``e`` schedules its next step at ``t``: a STEP_END when it ends, in 1 ms when
        nothing fits this instant (the live runner waits 1 ms too), none when it is idle."""
        core = e.core
        plan = core.schedule(t)
        if plan.scheduled:
            e.plan = plan
            self.push(t + plan.duration, STEP_END, e.k)
        elif core.has_work():
            e.plan = False
            self.push(t + 0.001, STEP_END, e.k)
        else:
            e.plan = None

    def step_end(self, t: float, k: int) -> None:
        """Engine ``k``'s step ends: its tokens reach their leases (first token, end), then the
        next step starts unless the run aborts."""
        e = self.engines[k]
        plan = e.plan
        e.plan = None
        if plan is False:
            self.start_step(e, t)
            return
        assert plan is not None   # a STEP_END is pushed with its plan (start_step)
        produced = e.core.complete(plan, t)
        if self.block_sets:
            apply_kv_events(e.core.kv, self.block_sets[k])
        if produced:
            e.stamp(self.now_ns())
        leases = self.leases
        aborted = False
        freed = False   # the router's accounting changed: admission may decide otherwise
        for req in produced:
            i = cast(int, req.sink)   # the request's index (SimRequest's sink, set below)
            n_out = len(req.output)
            lease = leases[i]
            assert lease is not None   # set when the request went to its engine
            lease.tokens = n_out   # what the live proxy's stream meter counts
            if n_out == 1:
                freed = True
                if self._first_token(req, i, t):
                    aborted = True
            if req.finish_reason is not None:
                freed = True
                if self._finished(e, i, n_out, t):
                    aborted = True
        if aborted or self.judge.p99_missed():
            self.aborted = True
            return
        self.start_step(e, t)
        if freed:
            for adm in self.adms:
                if adm.waiting:
                    adm.pump(t)

    def _first_token(self, req: SimRequest, i: int, t: float) -> bool:
        ft = t - self.arr[i]
        self.ttft[i] = ft
        first, lease = req.first_scheduled, self.leases[i]
        assert first is not None and lease is not None   # scheduled and dispatched before its first token
        self.queue[i] = first - self.arr[i]
        self.cached[i] = req.num_cached_tokens
        lease.first_token(now=t)
        return self.judge.first_token(i, ft)

    def _finished(self, e: SimWorker, i: int, n_out: int, t: float) -> bool:
        total = t - self.arr[i]
        ft, lease = self.ttft[i], self.leases[i]
        assert ft is not None and lease is not None   # its first token came before (or with) its end
        tpot = (total - ft) / (n_out - 1) if n_out > 1 else None
        ms = self.ms
        # the agent publishes latency windows from the engine's own histograms
        for w in e.writers:
            w.record_latency(ttft_ms=ft * ms, tpot_ms=None if tpot is None else tpot * ms, e2e_ms=total * ms)
        lease.release(now=t)   # as the live proxy: without the output count
        self.leases[i] = None
        self.e2e[i] = total
        self.out_tok[i] = n_out
        self.status[i] = OK
        self.done += 1
        return self.judge.finished(i, tpot)

    def agent_tick(self, t: float, k: int) -> None:
        """Agent ``k`` publishes its engine's running / waiting / KV usage with a fresh heartbeat."""
        e = self.engines[k]
        core = e.core
        e.stamp(self.now_ns())
        m = EngineMetrics(num_running=len(core.running), num_waiting=len(core.waiting), kv_cache_usage=core.kv.usage)
        for agent in e.agents:   # one per router replica
            agent.publish_engine(m)
        self.tick_no[k] += 1
        self.push(self.phase[k] + self.tick_no[k] * self.interval, AGENT_TICK, k)
        for adm in self.adms:
            if adm.waiting:
                adm.pump(t)

    def router_tick(self, t: float, k: int) -> None:
        """The router's health tick: its registry syncs from a segment snapshot."""
        for rp in self.replicas:
            rp.registry.sync(rp.seg.snapshot())
        self.r_tick += 1
        self.push(self.r_phase + self.r_tick * self.hc_interval, ROUTER_TICK, -1)

    def sample(self, t: float, k: int) -> None:
        """Every engine's load now (:class:`simulate.virtual.LoadSampler`)."""
        self.load.sample(t, self.engines)
        self.accounting.sample(self.segs, [len(e.core.running) + len(e.core.waiting) for e in self.engines])
        self.n_sample += 1
        self.push(self.n_sample * self.sample_dt, SAMPLE, -1)

    def admit_timer(self, t: float, k: int) -> None:
        """The router's poll while requests wait in its admission queue (``admission.poll_ms``):
        a pump, as the live gate's poller. Time alone changes what the TPOT rules read (a decode's
        pace and slack, :func:`router.admission_rule.pacing_over`, ``Decision.slo_victims``), and
        so does every decode step (tokens streamed), which pumps nothing here."""
        self.admit_tick = False
        for adm in self.adms:
            if adm.waiting:
                adm.pump(t)
        self._poll(t)

    def _poll(self, t: float) -> None:
        if not self.admit_tick and any(adm.waiting for adm in self.adms):
            self.admit_tick = True
            self.push(t + self.adms[0].poll_s, ADMIT_TICK, -1)

    def arrival(self, i: int, t: float) -> None:
        """Request ``i`` arrives: the router's pipeline picks an engine (or rejects it), or, with
        admission, the router's queue takes it and dispatches what the cluster has room for; the
        engine queues it (or rejects it with its HTTP status) and an idle engine starts a step."""
        s = self.s
        r = self.reqs[i]
        text = router_text(r, s.api) if self.needs_text else ""
        info = RequestInfo(self.path, self.model, True, text, router_prompt_len(r, s.api),
                           max_tokens=self.bound(r.output_length) if r.output_length > 0 else None)
        pick = self.via[i] = self.front.pick()
        rp = self.replicas[pick]
        if self.adms:
            if self.prios is not None:
                info.priority = self.prios[i]
            if self.tenants is not None:
                info.tenant = self.tenants[i]
            self.adms[pick].arrive(i, info, t)
            self._poll(t)
            return
        if rp.oracle is not None:
            self._oracle_matches(rp.oracle, r, text)
        try:
            lease, d = rp.scheduler.select(info, now=t)
        except NoEligibleWorker as err:
            self._rejected(i, err.status)
            return
        self.dispatch(i, lease, d, t)

    def _preparer(self, oracle: OracleIndex | None) -> Callable[[int], None] | None:
        """What sets a replica's oracle view of request ``i`` before it is routed (None without one)."""
        if oracle is None:
            return None

        def prepare(i: int) -> None:
            r = self.reqs[i]
            self._oracle_matches(oracle, r, router_text(r, self.s.api) if self.needs_text else "")

        return prepare

    def _reject_at(self, i: int, status: int, t: float) -> None:
        self._rejected(i, status)

    def dispatch(self, i: int, lease: Lease, d: Decision, t: float) -> None:
        """Request ``i`` routed (``lease`` taken on ``d.worker_id``): its engine queues it, at once or
        ``stack_overhead_s`` later (:meth:`engine_in`)."""
        self.worker[i] = d.worker_id
        self.leases[i] = lease
        if self.s.stack_overhead_s > 0:
            self.push(t + self.s.stack_overhead_s, ENGINE_IN, i)
        else:
            self.engine_in(t, i)

    def engine_in(self, t: float, i: int) -> None:
        """Request ``i`` reaches its engine (the worker :meth:`dispatch` chose), which queues it or
        rejects it with its HTTP status (its lease given back); an idle engine starts a step."""
        s = self.s
        r = self.reqs[i]
        k = self.worker[i]
        e = self.engines[k]
        lease = self.leases[i]
        assert lease is not None   # taken at dispatch
        e.stamp(self.now_ns())
        sreq = SimRequest(str(i), RenderedPrompt(r, s.api), r.output_length, e.core.config.block_size,  # type: ignore[arg-type]
                          sink=i, hashes=e.hasher.hashes(r))
        try:
            e.core.add_request(sreq, t)
        except SimEngineError as err:
            lease.release(now=t)
            self.leases[i] = None
            self._rejected(i, err.status)
            return
        if (oracle := self.replicas[self.via[i]].oracle) is not None and oracle.pending:
            oracle.pending[k].place(sreq.hashes, t)
            if self.share is not None:   # the other replicas see it through the store
                self.share.place(t, self.via[i], k, list(sreq.hashes))
        if e.plan is None:
            self.start_step(e, t)

    def _rejected(self, i: int, status: int) -> None:
        self.status[i] = status
        self.done += 1
        hit = self.judge.shed(i) if status == SHED_STATUS else self.judge.miss(i)
        if hit or self.judge.p99_missed():
            self.aborted = True

    def _oracle_matches(self, oracle: OracleIndex, r: TraceRequest, text: str) -> None:
        """Set ``oracle.current``: per engine, the share of ``text`` its prefix cache holds."""
        oracle.current = {}
        by_hasher: dict[int, list[int]] = {}
        for e in self.engines:
            hs = by_hasher.get(id(e.hasher))
            if hs is None:
                hs = by_hasher[id(e.hasher)] = e.hasher.hashes(r)
            bs = e.core.config.block_size
            n_tok = r.input_length + self.n_template
            if self.block_sets:   # the engines' events, as every replica's subscriber holds them
                keys = hs[:(n_tok - 1) // bs]
                hit = (oracle.pending[e.k].match(self.block_sets[e.k], keys, self.clock.t) if oracle.pending
                       else self.block_sets[e.k].match(keys)) * bs
            else:
                hit = len(e.core.kv.lookup(hs, (n_tok - 1) // bs)) * bs
            if hit and text:
                oracle.current[e.k] = max(1, round(len(text) * hit / n_tok))

    def result(self, events: int) -> RunResult:
        """The outcome; whatever is still in flight after an abort gives its lease back."""
        for lease in self.leases:
            if lease is not None:
                lease.release(now=self.clock.t)
        stats = []
        for e in self.engines:
            st = e.core.stats
            stats.append({"preemptions": st.num_preemptions, "prefix_cache_queries": st.prefix_cache_queries,
                          "prefix_cache_hits": st.prefix_cache_hits, "steps": st.steps,
                          "busy_time_s": st.busy_time, "generation_tokens": st.generation_tokens,
                          "prompt_tokens": st.prompt_tokens})
        return RunResult(policy=self.s.policy, arrival=self.arr, status=self.status, worker=self.worker,
                         ttft=self.ttft, e2e=self.e2e, queue=self.queue, output_tokens=self.out_tok,
                         cached_tokens=self.cached, prompt_tokens=[r.input_length for r in self.reqs],
                         engine_stats=stats, load=self.load.as_dict(), end_time=self.clock.t,
                         aborted=self.aborted, events=events,
                         replicas={"replicas": len(self.replicas), "accounting_error": self.accounting.result(),
                                   "shared_changes": self.share.published if self.share is not None else None},
                         waited=self._waited(),
                         priority=list(self.prios) if self.prios is not None
                         else [self.s.router.admission.default_priority] * self.n,
                         tenant=list(self.tenants) if self.tenants is not None else [""] * self.n,
                         prefill_rate=[float(self.segs[0].router_line(e.k)["prefill_rate"]) for e in self.engines])

    def _waited(self) -> list[float | None]:
        """Per request, its wait in the admission queue of the replica that took it."""
        out: list[float | None] = [None] * self.n
        for adm in self.adms:
            for i, w in enumerate(adm.waited):
                if w is not None:
                    out[i] = w
        return out


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
        if settings.replicas < 1:
            raise ValueError(f"replicas must be >= 1 (got {settings.replicas})")
        self.reqs = list(requests)
        self.s = settings
        self.hashers = hashers if hashers is not None else {}

    def run(self, progress: Callable[[int, int, float], None] | None = None) -> RunResult:
        """Simulate to the last request's end. ``progress(done, total, virtual_t)`` is called every
        few hundred events. The private segments (one per router replica) are unlinked whatever
        happens."""
        segs: list[Segment] = []
        try:
            for _ in range(self.s.replicas):
                segs.append(private_segment(len(self.s.engines)))
            return _Run(self.reqs, self.s, self.hashers, segs).loop(progress)
        finally:
            for seg in segs:
                release_segment(seg)
