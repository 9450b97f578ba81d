"""What every policy shares: the request summary it reads, the decision it returns, the load measure.

A policy sees only *eligible* workers (the pipeline in :mod:`router.scheduling` has already
dropped those that are not ready, stale, unhealthy, circuit-open, drained, serving another model or
already tried) as read-only snapshots with at least the attributes of
``dplb_shm.WorkerSnapshot`` used below, and returns a :class:`Decision`. Policies never touch the
network and never raise for an empty list (the pipeline guarantees at least one worker).
"""
from __future__ import annotations

import random as _random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias

from dplb_protocol.wire import (
    RequestInfo,  # what the request says, parsed once (re-exported)
)

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot

#: one value of an explanation row (``/dplb/route?explain``): a number, a label, or None
ScoreValue: TypeAlias = "int | float | str | bool | None"
#: one explanation row: ``worker_id``, ``score`` and each term of the policy
ScoreRow: TypeAlias = "Mapping[str, ScoreValue]"


@dataclass(slots=True)
class Decision:
    """A policy's choice: ``worker_id``, a short ``reason`` (metric label) and, when asked to
    explain, ``scores``: one dict per eligible worker with ``worker_id``, ``score`` and each term.

    ``uncached_tokens``: the policy's estimate of the prompt tokens the chosen worker must compute
    (None: the whole prompt; the lease charges it as outstanding prefill); ``est_s``: its
    estimated TTFT there, s (None when the policy does not estimate one); ``ttft_s``: the part of
    that estimate that is this request's own time to first token there (the ``dplb`` policy's
    queue, prefill, shared decode steps and KV barrier, without the terms that price what the
    choice costs others; set only when the policy's ``report_ttft`` is on: the admission queue
    reads it); ``slo_victims``: streamed requests in flight on the chosen worker that this
    request's prefill would push over their TPOT bound (:mod:`router.policies.tpot_slo`; 0 when
    the policy does not count them)."""

    worker_id: int
    reason: str
    scores: Sequence[ScoreRow] = field(default_factory=list)
    uncached_tokens: int | None = None
    est_s: float | None = None
    ttft_s: float | None = None
    slo_victims: int = 0


class Snap(Protocol):
    """The snapshot attributes policies read (a subset of ``dplb_shm.WorkerSnapshot``)."""

    worker_id: int
    weight: float
    num_running: int
    num_waiting: int
    inflight: int
    router_inflight: int
    kv_cache_usage: float
    max_num_seqs: int


class Decodes(Protocol):
    """What a policy may read of the streamed requests in flight per worker (the scheduler's
    :class:`router.scheduling.DecodeBook`; :mod:`router.policies.tpot_slo` prices them)."""

    def has_requests(self, worker_id: int) -> bool: ...

    def requests(self, worker_id: int) -> list[tuple[int | None, int, float | None]]: ...

    def victim_rows(self, worker_id: int, tpot_slo_s: float, step_tokens: float,
                    default_output_tokens: int) -> list[tuple[float, float]]: ...


class Policy(Protocol):
    """A routing policy. ``name`` is its config name; what it reads, declared here and read by the
    pipeline (:class:`router.scheduling.Scheduler`, :class:`router.state.RouterState`):
    ``needs_text`` (the pipeline must extract the prompt text), ``uses_kernel`` (it scores with the
    native kernel, which reads the slots itself), ``reads_load`` (it needs each slot read afresh
    per request; False: the last health tick's snapshots will do); ``report_ttft`` (set by the
    admission queue: fill ``Decision.ttft_s`` where the policy can)."""

    name: str
    needs_text: bool
    uses_kernel: bool
    reads_load: bool
    report_ttft: bool

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision: ...

    def on_dispatch(self, worker_id: int, req: RequestInfo) -> None: ...

    def forget(self, worker_id: int) -> None: ...

    def bind_decodes(self, book: Decodes) -> None: ...


def pending(s: WorkerSnapshot) -> int:
    """Requests queued on or headed to worker ``s``, the same measure as the native kernel
    (``csrc/dplb_kernel.h``): ``max(running + waiting, agent in-flight)`` plus the router's
    in-flight requests the agent has not seen yet (``router_inflight - inflight``, never negative).

    The last term is why a burst does not pile onto one worker between two state refreshes: the
    router bumps ``router_inflight`` in the segment the moment it picks (vLLM's DP balancer bumps a
    local count between stats updates for the same reason, ``vllm/v1/engine/core_client.py``).
    """
    inflight = int(s.inflight)
    return max(int(s.num_waiting) + int(s.num_running), inflight) + max(0, int(s.router_inflight) - inflight)


def least_loaded(workers: Sequence[WorkerSnapshot], rng: _random.Random) -> WorkerSnapshot:
    """The worker with the smallest :func:`pending`; ties broken at random (never towards id 0)."""
    best: list[WorkerSnapshot] = []
    best_p = None
    for w in workers:
        p = pending(w)
        if best_p is None or p < best_p:
            best, best_p = [w], p
        elif p == best_p:
            best.append(w)
    return best[0] if len(best) == 1 else rng.choice(best)


def pick_min(costs: dict[int, float], rng: _random.Random, eps: float = 1e-12) -> int:
    """The worker id with the smallest cost; ties (within ``eps``) broken at random."""
    best = min(costs.values())
    tied = [wid for wid, c in costs.items() if c <= best + eps]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def load_scores(workers: Sequence[WorkerSnapshot]) -> list[ScoreRow]:
    """Explanation rows for load-based baselines: score = -pending (higher is better)."""
    return [{"worker_id": w.worker_id, "score": float(-pending(w)), "pending": pending(w),
             "num_running": w.num_running, "num_waiting": w.num_waiting,
             "router_inflight": w.router_inflight} for w in workers]


class BasePolicy:
    """Default no-op hooks; ``rng`` is injectable so tests are deterministic."""

    name = "base"
    needs_text = False
    uses_kernel = False
    reads_load = True
    #: fill ``Decision.ttft_s`` (the admission queue turns it on; costs a policy that has it one
    #: more estimate per decision)
    report_ttft = False

    def __init__(self, rng: _random.Random | None = None) -> None:
        self.rng = rng or _random.Random()

    def on_dispatch(self, worker_id: int, req: RequestInfo) -> None:
        """Called once the request is sent to ``worker_id`` (prefix policies index it here)."""

    def forget(self, worker_id: int) -> None:
        """Called when a worker leaves (drop its prefix entries, counters...)."""

    def bind_decodes(self, book: Decodes) -> None:
        """Called once by the scheduler with its :class:`router.scheduling.DecodeBook` (the
        streamed requests in flight per worker); policies that do not price them ignore it."""
