"""The one scheduling pipeline: eligibility → policy → breaker admission → lease.

    lease, decision = scheduler.select(req, exclude)   # raises NoEligibleWorker (503)
    ... forward ...
    lease.release()                                    # exactly once; idempotent

Eligibility is :meth:`router.workers.Registry.candidates`; kernel-backed policies (``dplb``)
get the last synced snapshots (the kernel re-checks state, heartbeat, circuit and KV threshold on
the live segment), the baselines get freshly read slots. After a policy picks, the worker's
breaker must admit it (a half-open breaker admits one probe); otherwise the pipeline tries again
without it.

A :class:`Lease` is the router-side load guard (SGLang's RAII load guard) and the one place that
keeps the router's per-request accounting. Its three moments, called by the live proxy
(:mod:`router.proxy`) and by the virtual-time simulator (``simulate/``) alike:

* dispatch (``Lease(handle, seg)``, taken by :meth:`Scheduler.select`): bumps the shared
  ``router_inflight`` and ``dispatched`` atomics in the segment (so every router process and the
  kernel see the dispatch at once) and this process's count;
* :meth:`Lease.first_token`: the first output token reached the router (first streamed chunk; for
  a non-streamed answer, the whole body) — the worker's prefill of this request is over;
* :meth:`Lease.release`: the response ended (success, error or disconnect): undoes the dispatch
  counts, exactly once; a request released without a first token passes that moment then.

Router-side state that changes at these moments belongs here, so both callers stay in step. (The
per-worker in-flight gauge is sampled from the local count by the health tick, not per request.)
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from router.errors import NoEligibleWorker
from router.metrics import Metrics
from router.policies.base import Decision, Policy, RequestInfo
from router.workers import Registry, WorkerHandle


class Lease:
    """Router-side accounting for one dispatched request on ``handle`` (see the module docstring):
    taken at dispatch, :meth:`first_token` once, :meth:`release` exactly once.

    ``req``: the request's :class:`RequestInfo` (prompt length, text) for accounting that needs it;
    ``clock``: the routing clock in ns (None: CLOCK_MONOTONIC via ``time.monotonic_ns``).
    ``dispatched_ns`` is the dispatch time and ``ttft_ns`` the router-observed time to first token
    (None until :meth:`first_token`, and when the request ended without one)."""

    __slots__ = ("_clock", "_first", "_released", "_seg", "dispatched_ns", "handle", "req", "ttft_ns")

    def __init__(self, handle: WorkerHandle, seg: Any, req: RequestInfo | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.handle = handle
        self._seg = seg
        self.req = req
        self._clock = clock or time.monotonic_ns
        self._released = False
        self._first = False
        self.dispatched_ns = self._clock()
        self.ttft_ns: int | None = None
        seg.router_inflight_add(handle.worker_id, 1)
        seg.dispatched_add(handle.worker_id, 1)
        handle.local_inflight += 1

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return self._released

    @property
    def first_token_seen(self) -> bool:
        """True once :meth:`first_token` ran (or the lease was released without one)."""
        return self._first

    def first_token(self) -> bool:
        """The first output token reached the router: the worker finished this request's prefill.
        Returns False (and does nothing) the second time or after :meth:`release`."""
        if self._first or self._released:
            return False
        self._first = True
        self.ttft_ns = self._clock() - self.dispatched_ns
        return True

    def release(self) -> bool:
        """Give the request's load back; returns False (and does nothing) when already released.
        A request that never produced a first token (error, disconnect) passes that moment here."""
        if self._released:
            return False
        self._first = True  # the first-token moment passes without a token (ttft_ns stays None)
        self._released = True
        h = self.handle
        try:
            self._seg.router_inflight_add(h.worker_id, -1)
        finally:
            h.local_inflight -= 1
        return True


class Scheduler:
    """Runs the pipeline for ``policy`` over ``registry`` (see module docstring)."""

    def __init__(self, registry: Registry, policy: Policy, seg: Any, metrics: Metrics | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.registry = registry
        self.policy = policy
        self.seg = seg
        self.metrics = metrics
        self.clock = clock  # the routing clock handed to every Lease (None: CLOCK_MONOTONIC)
        # what eligibility reads: the kernel re-reads live slots itself; load-blind baselines use
        # the last tick's snapshots; load-aware ones re-read every slot
        self.fresh: str = ("kernel" if getattr(policy, "uses_kernel", False) else
                           "fresh" if getattr(policy, "reads_load", True) else "cached")

    def decide(self, req: RequestInfo, exclude: set[int] | frozenset[int] = frozenset(),
               explain: bool = False) -> tuple[WorkerHandle, Decision]:
        """Choose a worker without dispatching (``/dplb/route`` uses it with ``explain``).

        Raises NoEligibleWorker (reason ``no_workers``: none registered; ``none_eligible``: all
        excluded, unhealthy, open or busy)."""
        excl = set(exclude)
        handles = self.registry.handles
        for _ in range(len(handles) + 1):
            cands = self.registry.candidates(req.model, excl, self.fresh)
            if not cands:
                break
            d = self.policy.choose(cands, req, explain)
            h = handles.get(d.worker_id)
            if h is None:
                excl.add(d.worker_id)
                continue
            return h, d
        reason = "no_workers" if not handles else "none_eligible"
        raise NoEligibleWorker("no worker can take the request now" if handles else "no worker is registered",
                               reason=reason)

    def select(self, req: RequestInfo, exclude: set[int] | frozenset[int] = frozenset()) -> tuple[Lease, Decision]:
        """Choose, admit through the breaker, take a :class:`Lease` and tell the policy."""
        excl = set(exclude)
        while True:
            h, d = self.decide(req, excl)
            if not h.breaker.allow():
                excl.add(h.worker_id)
                continue
            lease = Lease(h, self.seg, req, self.clock)
            self.policy.on_dispatch(h.worker_id, req)
            if self.metrics is not None:
                self.metrics.decision(self.policy.name, d.reason)
            return lease, d
