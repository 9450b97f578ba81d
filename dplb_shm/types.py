"""Plain Python types of the segment API: worker state, snapshots, scoring parameters and terms.

These carry no native code so that :mod:`dplb_shm.reference` and tests can use them on their own.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from dplb_shm.errors import SlotFieldError


class WorkerState(enum.IntEnum):
    """Life cycle of a slot (``state`` field). Only READY workers receive requests."""

    EMPTY = 0
    STARTING = 1
    READY = 2
    DRAINING = 3
    DEAD = 4


class StateReason(enum.IntEnum):
    """Why a slot is in its state (``state_reason`` field, ``DPLB_REASON_*`` in csrc/dplb_shm.h).

    Set by the agent when its engine fails or is restarted (AGENT_EXITED: by the launcher when the
    agent itself died); back to NONE once the engine is READY
    after a clean start (the ``restarts`` and ``last_exit_code`` fields keep the history)."""

    NONE = 0
    ENGINE_EXITED = 1   # the engine exited unexpectedly; it is restarted after a backoff
    START_FAILED = 2    # the engine did not become ready; it is restarted after a backoff
    GAVE_UP = 3         # too many failures within the window: DEAD until an admin restart
    ADMIN_RESTART = 4   # restarted on an operator's request
    AGENT_EXITED = 5    # the agent died; the launcher marked its slot DEAD and restarts it after a backoff


class SlotFields(TypedDict, total=False):
    """What one slot write may set (``SlotWriter.publish(**fields)``), each key a field of
    ``dplb_slot_t`` (csrc/dplb_shm.h) of the same name; the writer validates the ranges (csrc/
    dplb_native.pyx ``_apply``, :class:`dplb_shm.errors.SlotFieldError`). Units: ``*_ns``
    CLOCK_MONOTONIC ns; ``*_ms`` milliseconds (-1: none); ``kv_cache_usage`` 0..1 (-1: unknown);
    ``*_bytes`` bytes. ``heartbeat_ns`` given: stored as is instead of now. Fields the writer
    alone derives (``seq``, ``length_compat``, the latency rings and their counts) or that
    :meth:`SlotWriter.claim` sets (``worker_id``), and the routers' lines, are not here
    (tests/dplb_shm/test_slot_fields.py walks the header's table)."""

    state: WorkerState | int
    state_reason: StateReason | int
    pid: int
    engine_pid: int
    endpoint: str
    control: str
    model: str
    gpu_ids: Sequence[int]
    weight: float
    num_running: int
    num_waiting: int
    inflight: int
    max_num_seqs: int
    queued_prompt_tokens: int
    kv_cache_usage: float
    gpu_mem_used_bytes: int
    gpu_mem_total_bytes: int
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    prompt_len_hist: Sequence[int]
    completed: int
    failed: int
    heartbeat_ns: int
    restarts: int
    agent_restarts: int
    last_exit_code: int
    next_restart_ns: int


class RouterLine(TypedDict):
    """A slot's router-side accounting as ``Segment.router_line`` reads it (csrc/dplb_native.pyx
    ``_router_dict``; each field one atomic load, together not a snapshot): ``router_inflight``
    requests in flight from the routers, ``dispatched`` requests ever dispatched, ``circuit`` the
    :class:`Circuit` state, ``prefill_tokens`` outstanding prefill tokens, ``decode_reqs`` and
    ``decode_ctx_tokens`` decoding requests and their context tokens, ``prefill_rate`` the learned
    prefill rate (tokens/s, 0 = none learned) from ``prefill_rate_n`` samples, ``router_ttft_s``
    and ``router_tpot_s`` the routers' TTFT and TPOT EWMAs (s, 0 = no sample), ``completed`` and
    ``failed`` request outcomes."""

    router_inflight: int
    dispatched: int
    circuit: int
    prefill_tokens: int
    decode_reqs: int
    decode_ctx_tokens: int
    prefill_rate: float
    prefill_rate_n: int
    router_ttft_s: float
    router_tpot_s: float
    completed: int
    failed: int


#: how old a READY slot's heartbeat may be before routers stop routing to it, ms: the default of
#: the router's ``health_check.heartbeat_timeout_ms`` and of the kernels' ``heartbeat_timeout_ms``
HEARTBEAT_TIMEOUT_MS = 1000


def heartbeat_stale(state: int, heartbeat_age_ms: float, timeout_ms: float = HEARTBEAT_TIMEOUT_MS) -> bool:
    """The one staleness rule: a READY slot whose heartbeat is older than ``timeout_ms`` (ms) —
    its agent is gone or stuck and no router routes to it (the kernels skip it; ``/dplb/status``
    says ``routing: stale``; ``dplb-shm-dump`` prints ``stale`` in its state column). Other states
    are what they say (an unknown age, -1, is not stale)."""
    return int(state) == WorkerState.READY and heartbeat_age_ms > timeout_ms


class Circuit(enum.IntEnum):
    """Router-side circuit breaker state stored in a slot's router line."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One slot as read under its seqlock (every field from the same write).

    Units: ``heartbeat_ns`` CLOCK_MONOTONIC ns; ``heartbeat_age_ms`` computed at read time;
    ``kv_cache_usage`` 0..1 or -1.0 when unknown; memory in bytes, -1 when unknown; latencies in
    ms (window mean and nearest-rank p99 over the last 32 samples), -1.0 when no sample;
    ``prompt_len_hist[b]`` counts queued prompts with length in [2^b, 2^(b+1)) (bin 0 also holds
    0). ``router_inflight``, ``dispatched``, ``circuit`` and the router-owned accounting come
    from the router lines (atomics shared by every router process), read at the same moment but
    outside the seqlock: ``prefill_tokens`` (uncached prompt tokens dispatched whose first token has
    not come back), ``decode_reqs``/``decode_ctx_tokens`` (requests past their first token and
    their prompt tokens), ``prefill_rate`` (learned, tokens/s, 0 = none yet), ``router_ttft_s`` /
    ``router_tpot_s`` (EWMAs of what the routers observed, s, 0 = no sample), and ``completed`` /
    ``failed``: the request attempts on this worker that the routers saw answered / fail (5xx,
    connection error, timeout, broken stream), counted by every router process's lease at its
    finish, for local and mirrored workers alike — the one count the dump, ``/dplb/status`` and
    ``/metrics`` show. ``engine_completed`` is the engine's own finished-request counter as the
    agent scrapes it (seqlock-guarded; 0 for engines without one, and for mirrored workers), and
    ``engine_failed`` the slot writer's own failure count beside it.
    ``restarts``: engine restarts of the worker (its agents carry the count over an agent restart);
    ``agent_restarts``: restarts of the worker's agent;
    ``last_exit_code``: the engine's last exit status (negative: the signal that killed it; 0:
    never exited); ``state_reason``: a :class:`StateReason`; ``next_restart_ns``: CLOCK_MONOTONIC
    ns of the next scheduled engine restart, 0 when none (agent fields, seqlock-guarded).
    ``pid`` is the slot writer's: the worker agent's (a mirror slot: the owning router's), also
    given as :attr:`agent_pid`; ``engine_pid`` the engine process the agent spawned (0 = none: an
    attached server, or no engine running).
    ``endpoint`` is the data path (layout 5, one hop): the engine's own address, which routers
    forward requests to; ``control`` the agent's control address ("" = the endpoint's own).
    """

    worker_id: int
    state: WorkerState
    pid: int
    endpoint: str
    model: str
    gpu_ids: list[int]
    weight: float
    heartbeat_ns: int
    heartbeat_age_ms: float
    num_running: int
    num_waiting: int
    inflight: int
    router_inflight: int
    dispatched: int
    queued_prompt_tokens: int
    max_num_seqs: int
    kv_cache_usage: float
    gpu_mem_used_bytes: int
    gpu_mem_total_bytes: int
    ttft_ms: float
    tpot_ms: float
    e2e_ms: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    e2e_p99_ms: float
    prompt_len_hist: list[int]
    completed: int
    failed: int
    circuit: int
    seq: int = 0
    # router-owned request accounting (router line, atomics; defaults for older remote agents)
    prefill_tokens: int = 0
    decode_reqs: int = 0
    decode_ctx_tokens: int = 0
    prefill_rate: float = 0.0
    router_ttft_s: float = 0.0
    router_tpot_s: float = 0.0
    restarts: int = 0
    #: restarts of the worker's agent (a new agent took a dead one's place), carried by each new agent
    agent_restarts: int = 0
    last_exit_code: int = 0
    state_reason: StateReason = StateReason.NONE
    next_restart_ns: int = 0
    #: the agent's control address (``/health``, ``/dplb/state``, ``/dplb/restart``); ``endpoint``
    #: is the engine's own data address that routers forward to. "" = ``endpoint`` serves both.
    control: str = ""
    #: pid of the engine process the agent spawned; 0 = none (an attached server, none running)
    engine_pid: int = 0
    #: the engine's own finished-request counter, as the agent scraped it (the slot's ``completed``)
    engine_completed: int = 0
    #: the slot writer's own failure count (``SlotWriter.count(failed=)``; the agent writes none)
    engine_failed: int = 0
    #: the slot's writer stopped inside a write: its seqlock sequence stayed odd (killed between its
    #: two stores, or a stray write) with a heartbeat over 1 s old, so this read gave up waiting
    #: (``Segment.read_slot``); the other fields were copied without the seqlock and may be torn.
    #: No router routes to a stale slot; ``dplb-shm-dump`` shows it as ``stale``.
    stale: bool = False

    @property
    def agent_pid(self) -> int:
        """The worker agent's pid (the slot's ``pid``: its writer)."""
        return self.pid

    @property
    def exit_code(self) -> int | None:
        """The engine's last exit status (``Popen.returncode`` convention, :mod:`dplb_shm.exits`),
        or None while it never exited: ``last_exit_code`` holds 0 then, which means an exit only
        once the engine has been restarted (``restarts`` > 0) or while the slot is DEAD because its
        engine exited or failed to start (not ``agent_exited``, nor the launcher's ``gave_up`` on a
        dying agent: the agent died, the engine did not)."""
        engine_dead = self.state == WorkerState.DEAD and self.state_reason in (StateReason.ENGINE_EXITED,
                                                                               StateReason.START_FAILED)
        if self.last_exit_code == 0 and not self.restarts and not engine_dead:
            return None
        return self.last_exit_code

    @property
    def mirrored(self) -> bool:
        """True for a remote worker a router mirrors: its ``control`` is the remote agent's
        ``host:port`` (a local agent's is its Unix socket path), and ``pid`` is the mirroring
        router's, not an agent's."""
        return bool(self.control) and not self.control.startswith("/")

    def to_dict(self) -> dict[str, object]:
        """The JSON shape printed by ``dplb-shm-dump --json`` and served as ``/dplb/state``.

        ``state`` and ``state_reason`` become their lower-case names (``"ready"``,
        ``"engine_exited"``); ``last_exit_code`` is null while the engine never exited
        (:attr:`exit_code`); every other field keeps its name, and ``agent_pid``
        repeats ``pid`` (null for a mirrored remote worker: ``pid`` is the mirroring router's).
        """
        d = asdict(self)
        d["agent_pid"] = None if self.mirrored else self.pid
        d["last_exit_code"] = self.exit_code
        d["state"] = self.state.name.lower()
        d["state_reason"] = StateReason(self.state_reason).name.lower()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> WorkerSnapshot:
        """Inverse of :meth:`to_dict` (e.g. a remote agent's ``/dplb/state``).

        Raises :class:`SlotFieldError` on an unknown state or a missing field.
        """
        # Any: a remote agent's JSON, each value checked by the WorkerSnapshot field it fills
        kw: dict[str, Any] = dict(d)  # type: ignore[explicit-any]
        st = kw.get("state")
        try:
            kw["state"] = WorkerState[st.upper()] if isinstance(st, str) else WorkerState(int(st))  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError) as e:
            raise SlotFieldError(f"unknown worker state {st!r}", field="state") from e
        r = kw.get("state_reason", 0)
        try:
            kw["state_reason"] = StateReason[r.upper()] if isinstance(r, str) else StateReason(int(r))
        except (KeyError, ValueError, TypeError):
            kw["state_reason"] = StateReason.NONE  # a newer agent's reason: not fatal
        if kw.get("last_exit_code") is None:   # null: never exited, which the slot holds as 0
            kw["last_exit_code"] = 0
        if kw.get("pid") is None:
            kw["pid"] = 0
        names = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in kw.items() if k in names}
        try:
            return cls(**kw)
        except TypeError as e:
            raise SlotFieldError(f"bad worker state dict: {e}", field="*") from e

    @property
    def is_live(self) -> bool:
        """True unless the slot is EMPTY or DEAD."""
        return self.state not in (WorkerState.EMPTY, WorkerState.DEAD)


@dataclass(frozen=True, slots=True)
class ScoringParams:
    """Parameters of the scoring kernel (see ``csrc/dplb_kernel.h`` for the formula).

    Defaults are the seeds' weights and thresholds from docs/DESIGN.md "Scoring":
    ``w_pending=0.4, w_kv=0.3, w_latency=0.2, w_length=0.1``; ``max_queue=0`` means "use each
    slot's ``max_num_seqs``" (256 when the slot has none); ``kv_cache_threshold=0.8``: a worker
    above it is not eligible; ``heartbeat_timeout_ms``: older heartbeats make a worker ineligible;
    ``latency_scale_ms``: TTFT at which the latency term halves.
    Raises :class:`SlotFieldError` (a ValueError) on a non-finite weight, negative ``max_queue``,
    or non-positive ``latency_scale_ms``/``heartbeat_timeout_ms``.
    """

    w_pending: float = 0.4
    w_kv: float = 0.3
    w_latency: float = 0.2
    w_length: float = 0.1
    max_queue: int = 0
    kv_cache_threshold: float = 0.8
    heartbeat_timeout_ms: float = float(HEARTBEAT_TIMEOUT_MS)
    latency_scale_ms: float = 100.0

    def __post_init__(self) -> None:
        for name in ("w_pending", "w_kv", "w_latency", "w_length", "kv_cache_threshold",
                     "heartbeat_timeout_ms", "latency_scale_ms"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise SlotFieldError(f"ScoringParams.{name} must be a finite number, got {v!r}", field=name)
        if not isinstance(self.max_queue, int) or self.max_queue < 0 or self.max_queue > 2**31 - 1:
            raise SlotFieldError(f"ScoringParams.max_queue must be an int >= 0, got {self.max_queue!r}",
                                 field="max_queue")
        if self.latency_scale_ms <= 0:
            raise SlotFieldError("ScoringParams.latency_scale_ms must be > 0", field="latency_scale_ms")
        if self.heartbeat_timeout_ms <= 0:
            raise SlotFieldError("ScoringParams.heartbeat_timeout_ms must be > 0", field="heartbeat_timeout_ms")


@dataclass(frozen=True, slots=True)
class ScoreTerms:
    """Every term of one eligible worker's score.

    ``pending`` is the raw pending count; ``*_term`` are already multiplied by their weight in
    :class:`ScoringParams`; ``weight`` is the worker's static weight; and
    ``score = weight * (((pending_term + kv_term) + latency_term) + length_term) + affinity``.
    """

    worker_id: int
    score: float
    pending: float
    pending_term: float
    kv_term: float
    latency_term: float
    length_term: float
    affinity: float
    weight: float

    def to_dict(self) -> dict[str, float]:
        """Plain dict (for ``/dplb/route``)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class TtftParams:
    """Parameters of the estimated-TTFT kernel (``dplb_pick_ttft`` in csrc/dplb_kernel.h).

    ``prefill_rate``: prompt tokens/s a worker is assumed to prefill until it has learned its own
    (default 30,769 = 1 / 0.0325 ms per token, the sim engine's Llama-3.1-8B-on-H100 model,
    sim_engine/config.py); ``waiting_tokens``: prompt tokens assumed for each request waiting in
    the engine that the routers did not dispatch themselves (1024); ``step_tokens``: prompt tokens
    per engine step (vLLM's
    ``max_num_batched_tokens``, 8192); ``step_base_s`` (5 ms), ``decode_seq_s`` (50 µs per
    decoding request) and ``decode_ctx_s`` (39 ns per context token) price what every step costs
    besides our prefill (the same sim engine constants); ``kv_barrier_s``: scale of the convex KV
    barrier ``kv_barrier_s·k/(1−k)`` (0.15 s, SGLang gateway's ``least_load``); ``w_decode``: weight
    of the batch term (what the batch already on a worker adds to this request's own decode);
    ``kv_cache_threshold`` and ``heartbeat_timeout_ms`` as in :class:`ScoringParams`;
    ``rate_band``: learned prefill rates within this fraction of the eligible workers' median
    count as the median (0.25: identical engines whose learned rates drifted apart by sampling
    noise are priced alike; a worker more than 25 % off keeps its own rate; 0 turns pooling off);
    ``w_interf``: weight of the interference term ``B·u/r`` (our prefill's delay summed over the
    requests sharing its steps; 0 = off); ``w_miss``: later requests assumed to wait behind a
    prefix miss's recompute, term ``w_miss·(u − u_min)/r`` (0 = off); ``interf_batch_cap``: the
    interference term counts at most this many requests of a worker's batch, ``min(B, cap)·u/r``
    (64; 0 = no cap; issue 29 round 9, docs/DESIGN.md). Derivations in
    csrc/dplb_kernel.h and docs/DESIGN.md.
    Raises :class:`SlotFieldError` on a non-finite value or a non-positive rate, step size or timeout.
    """

    prefill_rate: float = 30_769.0
    waiting_tokens: float = 1024.0
    step_tokens: float = 8192.0
    step_base_s: float = 0.005
    decode_seq_s: float = 0.00005
    decode_ctx_s: float = 3.9e-8
    kv_barrier_s: float = 0.15
    w_decode: float = 0.25
    kv_cache_threshold: float = 0.8
    heartbeat_timeout_ms: float = float(HEARTBEAT_TIMEOUT_MS)
    rate_band: float = 0.25
    w_interf: float = 0.5
    w_miss: float = 0.0
    interf_batch_cap: float = 64.0

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise SlotFieldError(f"TtftParams.{name} must be a finite number, got {v!r}", field=name)
        for name in ("prefill_rate", "step_tokens", "heartbeat_timeout_ms"):
            if getattr(self, name) <= 0:
                raise SlotFieldError(f"TtftParams.{name} must be > 0", field=name)
        for name in ("waiting_tokens", "step_base_s", "decode_seq_s", "decode_ctx_s", "kv_barrier_s", "w_decode",
                     "rate_band", "w_interf", "w_miss", "interf_batch_cap"):
            if getattr(self, name) < 0:
                raise SlotFieldError(f"TtftParams.{name} must be >= 0", field=name)


@dataclass(frozen=True, slots=True)
class TtftTerms:
    """Every term of one eligible worker's estimated TTFT (seconds unless named otherwise).

    ``est_s = (((((prefill_s + decode_s) + kv_s) + batch_s) + interf_s) + miss_s) / weight``;
    ``interf_s``: our prefill's delay summed over the ``batch`` requests sharing its steps;
    ``miss_s``: the recompute a prefix miss costs the requests arriving behind it; ``batch``: requests sharing the
    worker's steps; ``queue_tokens``: outstanding prefill
    tokens ahead; ``uncached_tokens``: this request's prompt tokens not cached there; ``rate``:
    the prefill rate used (tokens/s; the pool's median when ``own_rate``, the worker's learned or
    seed rate, lies within :attr:`TtftParams.rate_band` of it); ``steps``: engine steps until its last prompt chunk;
    ``decode_reqs``: decoding requests sharing those steps; ``outside_reqs``: requests in the engine
    that no router dispatched, as of the agent's last scrape (``running + waiting − inflight``, ≥ 0;
    counted in ``batch`` and, while waiting, in ``queue_tokens``); ``weight``: the slot's static weight.
    """

    worker_id: int
    est_s: float
    queue_tokens: float
    uncached_tokens: float
    rate: float
    own_rate: float
    steps: float
    prefill_s: float
    decode_s: float
    kv_s: float
    batch_s: float
    interf_s: float
    miss_s: float
    decode_reqs: float
    batch: float
    outside_reqs: float
    weight: float

    def to_dict(self) -> dict[str, float]:
        """Plain dict (for ``/dplb/route``)."""
        return asdict(self)


__all__ = ["HEARTBEAT_TIMEOUT_MS", "Circuit", "RouterLine", "ScoreTerms", "ScoringParams", "StateReason", "TtftParams", "TtftTerms",
           "WorkerSnapshot", "WorkerState", "heartbeat_stale"]
