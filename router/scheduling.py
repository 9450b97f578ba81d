"""The one scheduling pipeline: eligibility → policy → breaker admission → lease.

    lease, decision = scheduler.select(req, exclude)   # raises NoEligibleWorker (503)
    ... forward ...
    lease.release()                                    # exactly once; idempotent

Eligibility is :meth:`router.workers.Registry.candidates`; kernel-backed policies (``dplb``)
get the last synced snapshots (the kernel re-checks state, heartbeat, circuit and KV threshold on
the live segment), the baselines get freshly read slots. After a policy picks, the worker's
breaker must admit it (a half-open breaker admits one probe); otherwise the pipeline tries again
without it.

A :class:`Lease` is the router-side load guard (SGLang's RAII load guard): taking it records the
request in the worker's router line (:mod:`router.accounting`: in-flight, outstanding prefill
tokens, later decoding requests) so every router process and the kernel see the dispatch at
once, and bumps this process's count; :meth:`Lease.release` undoes both exactly once. (The
per-worker gauges of ``/metrics`` read the segment's counts when scraped.) The proxy calls
:meth:`Lease.first_token` at a stream's first chunk that carries content
(:mod:`router.stream_meter`), not at its first byte.
"""
from __future__ import annotations

import time
from typing import Any

from router.accounting import LearnSettings, RequestAccount
from router.errors import NoEligibleWorker
from router.metrics import Metrics
from router.policies.base import Decision, Policy, RequestInfo
from router.workers import Registry, WorkerHandle


class Lease:
    """One dispatched request on ``handle``: its :class:`~router.accounting.RequestAccount` in the
    segment (router in-flight, outstanding prefill tokens, decoding requests) and this process's
    in-flight count. :meth:`first_token` once prefill is done, :meth:`release` exactly once at the
    end (idempotent). ``deadline``: when a request whose first token the router cannot see (not
    streamed) is assumed past prefill (dispatch + its estimated TTFT; :meth:`Scheduler.sweep`)."""

    __slots__ = ("account", "deadline", "handle")

    def __init__(self, handle: WorkerHandle, seg: Any, prompt_tokens: int = 0, uncached_tokens: int | None = None,
                 now: float | None = None, learn: LearnSettings | None = None, deadline: float | None = None) -> None:
        self.handle = handle
        t = time.monotonic() if now is None else now
        self.account = RequestAccount(seg, handle.worker_id, prompt_tokens,
                                      prompt_tokens if uncached_tokens is None else uncached_tokens, t, learn)
        self.deadline = deadline
        handle.local_inflight += 1

    @property
    def released(self) -> bool:
        """True once :meth:`release` ran."""
        return not self.account.open

    def first_token(self, now: float | None = None, observed: bool = True) -> float | None:
        """Prefill is done (the first content came back, or is assumed to have); returns the TTFT
        in s the first time, None after. See :meth:`RequestAccount.first_token`."""
        return self.account.first_token(time.monotonic() if now is None else now, observed)

    def release(self, now: float | None = None, output_tokens: int | None = None) -> bool:
        """Give the request's load back; returns False (and does nothing) when already released."""
        if not self.account.open:
            return False
        try:
            self.account.finish(time.monotonic() if now is None else now, output_tokens)
        finally:
            self.handle.local_inflight -= 1
        return True


class Scheduler:
    """Runs the pipeline for ``policy`` over ``registry`` (see module docstring)."""

    def __init__(self, registry: Registry, policy: Policy, seg: Any, metrics: Metrics | None = None,
                 learn: LearnSettings | None = None, default_rate: float = 30_769.0) -> None:
        self.registry = registry
        self.policy = policy
        self.seg = seg
        self.metrics = metrics
        self.learn = learn if learn is not None else LearnSettings()
        self.default_rate = default_rate
        #: leases of requests whose first token the router cannot see (non-streamed), until swept
        self.blind: set[Lease] = set()
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

    def select(self, req: RequestInfo, exclude: set[int] | frozenset[int] = frozenset(),
               now: float | None = None) -> tuple[Lease, Decision]:
        """Choose, admit through the breaker, take a :class:`Lease` and tell the policy.

        The lease is charged ``d.uncached_tokens`` (the policy's estimate of what the worker must
        compute; the whole prompt when the policy has none). For a request the router will not see
        the first token of (not streamed), the lease is also registered for :meth:`sweep`."""
        excl = set(exclude)
        t = time.monotonic() if now is None else now
        while True:
            h, d = self.decide(req, excl)
            if not h.breaker.allow():
                excl.add(h.worker_id)
                continue
            u = req.prompt_len if d.uncached_tokens is None else d.uncached_tokens
            deadline = None
            if not req.stream:
                est = d.est_s
                if est is None or not est < float("inf"):
                    est = u / self.default_rate
                deadline = t + est
            lease = Lease(h, self.seg, req.prompt_len, u, t, self.learn, deadline)
            if deadline is not None:
                self.blind.add(lease)
            self.policy.on_dispatch(h.worker_id, req)
            if self.metrics is not None:
                self.metrics.decision(self.policy.name, d.reason)
            return lease, d

    def sweep(self, now: float | None = None) -> int:
        """Move non-streamed requests past their estimated TTFT from prefill to decode (the router
        never sees their first token; without this their prompt would count as queued prefill
        until the whole answer is back). Forgets released leases. Returns how many moved."""
        t = time.monotonic() if now is None else now
        moved = 0
        for lease in list(self.blind):
            if lease.released or lease.account.first_seen:
                self.blind.discard(lease)
            elif lease.deadline is not None and t >= lease.deadline:
                lease.first_token(t, observed=False)
                self.blind.discard(lease)
                moved += 1
        return moved
