"""The parts of the virtual cluster :mod:`simulate.cluster` runs: the virtual clock, the private
segment (always unlinked), the engines with their agents (:func:`start_engines`: the real
:class:`worker_agent.agent.Agent` writing the real slot, with no engine process and no GPU behind
it) and the prefix index that answers with the engines' truth (:class:`OracleIndex`).
"""
from __future__ import annotations

import atexit
import os
import uuid
from collections.abc import Callable
from typing import Literal

from dplb_shm import Segment, WorkerState
from router.kv_events import PendingBlocks
from router.policies.prefix_index import PrefixIndex
from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore, StepPlan
from simulate.settings import LoadSeries, SimSettings
from simulate.workload import EngineHasher
from worker_agent.agent import Agent
from worker_agent.config import AgentConfig
from worker_agent.engines import ENGINES
from worker_agent.metrics import EngineMetrics

#: virtual time 0 is this many ns on the segment's clock (heartbeat 0 means "never written")
OFFSET_NS = 1_000_000_000
#: the engine kind every simulated worker's agent is (the engine table, worker_agent/engines.py):
#: its vLLM metric names are the ones the virtual engines' counts stand for
SIM = ENGINES["sim"]


class VirtualClock:
    """Simulated time ``t`` (seconds); :meth:`now_ns` is the same instant on the segment's clock."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0

    def now_ns(self) -> int:
        return OFFSET_NS + round(self.t * 1e9)


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

    def __init__(self, inner: PrefixIndex) -> None:
        self.inner = inner
        self.current: dict[int, int] = {}
        #: with ``events_prefix``: per engine, this replica's placements not yet in the engine's
        #: events (:class:`router.kv_events.PendingBlocks`; empty: none kept)
        self.pending: list[PendingBlocks] = []

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


class SimWorker:
    """One simulated worker: engine ``k``'s core, its agent (and the agent's slot writer), the
    hasher of its block size, and the step it runs (``plan``: None idle, False waiting 1 ms)."""

    __slots__ = ("agent", "agents", "core", "hasher", "k", "plan", "writer", "writers")

    def __init__(self, k: int, core: EngineCore, agent: Agent, hasher: EngineHasher) -> None:
        self.k = k
        self.core = core
        self.agent = agent
        self.writer = agent.writer
        #: with router replicas (:mod:`simulate.replicas`), one agent per replica's segment
        #: (replica 0's is ``agent``): each publishes the engine's state into its replica's slot
        self.agents = [agent]
        self.writers = [agent.writer]
        self.hasher = hasher
        self.plan: StepPlan | Literal[False] | None = None

    def stamp(self, now_ns: int) -> None:
        """Every slot writer of this engine writes at ``now_ns`` from now on."""
        for w in self.writers:
            w.now_override_ns = now_ns


def start_engines(seg: Segment, s: SimSettings, hashers: dict[tuple[int, str], EngineHasher],
                   now_ns: Callable[[], int]) -> list[SimWorker]:
    """One engine and its agent per ``s.engines``: each agent claims its slot, turns READY and
    publishes its first engine state at t = 0; engines of one block size share a hasher."""
    engines: list[SimWorker] = []
    for k, ecfg in enumerate(s.engines):
        core = EngineCore(ecfg)
        agent = start_agent(seg, k, ecfg, s, now_ns())
        key = (ecfg.block_size, s.api)
        if key not in hashers:
            hashers[key] = EngineHasher(ecfg.block_size, s.api)
        engines.append(SimWorker(k, core, agent, hashers[key]))
    return engines


def start_agent(seg: Segment, k: int, ecfg: EngineConfig, s: SimSettings, now_ns: int) -> Agent:
    """Engine ``k``'s agent on ``seg``: it claims slot ``k``, turns READY and publishes an idle
    engine at ``now_ns`` (segment clock)."""
    acfg = AgentConfig(worker_id=k, shm=seg.name, uds=f"/sim/agent-{k}.sock", engine=SIM.name,
                       model=ecfg.model, state_interval_ms=s.state_interval_ms,
                       max_num_seqs=ecfg.max_num_seqs, latency_window_s=s.latency_window_s)
    agent = Agent(acfg, adapter=_NoAdapter(), segment=seg, nvml=_NoGpu())  # type: ignore[arg-type]
    agent.writer.now_override_ns = now_ns
    agent.writer.claim(worker_id=k, pid=os.getpid(), endpoint=acfg.uds, gpu_ids=[], weight=1.0,
                       model=ecfg.model, max_num_seqs=ecfg.max_num_seqs)
    agent.state = WorkerState.READY
    agent.writer.set_state(WorkerState.READY)
    agent.publish_engine(EngineMetrics(num_running=0, num_waiting=0, kv_cache_usage=0.0))
    return agent


class LoadSampler:
    """Load over time (the simulation's SAMPLE event): every engine's true queue (running +
    waiting), running count and KV usage at each sample time (an observer; nothing reads it).
    :meth:`sample` appends one sample; :meth:`as_dict` gives the series."""

    __slots__ = ("kv", "queue", "running", "t")

    def __init__(self, num_engines: int) -> None:
        self.t: list[float] = []
        self.queue: list[list[int]] = [[] for _ in range(num_engines)]
        self.running: list[list[int]] = [[] for _ in range(num_engines)]
        self.kv: list[list[float]] = [[] for _ in range(num_engines)]

    def sample(self, t: float, engines: list[SimWorker]) -> None:
        self.t.append(round(t, 3))
        for e in engines:
            core = e.core
            nr = len(core.running)
            self.queue[e.k].append(nr + len(core.waiting))
            self.running[e.k].append(nr)
            self.kv[e.k].append(round(core.kv.usage, 4))

    def as_dict(self) -> LoadSeries:
        return {"t": self.t, "queue": self.queue, "running": self.running, "kv": self.kv}
