"""The router's admission queue in virtual time (``dplb-simulate``; :mod:`router.admission`).

:class:`SimAdmission` runs the router's own :class:`~router.admission.AdmissionQueue` and
:func:`~router.admission_rule.route_ticket` (the same code, not a copy) over the simulation's
scheduler: an arrival is offered to the queue and the queue is pumped; the simulation pumps it
again at a request's first token or end (the live router's kick), at an agent's publication, and
every ``admission.poll_ms`` while requests wait (the live router's poller): the TPOT rules read a
decode's pace and slack, which change with every decode step and with time alone. Dispatched
requests go to the caller's ``dispatch``; shed ones to ``reject`` with 429 (or the scheduler's
503 for an empty pool).

:func:`assign_mix` draws each request's priority class and tenant (``--priority-mix``,
``--tenant-mix``); :func:`by_group` reports SLO attainment, goodput and rejections per class and
per tenant.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import NotRequired, TypedDict, TypeVar

from router.admission import FAIL, GO, AdmissionQueue, Ticket
from router.admission_rule import route_ticket
from router.config import AdmissionSection
from router.errors import NoEligibleWorker
from router.policies.base import Decision, RequestInfo
from router.scheduling import Lease, Scheduler
from simulate.settings import Figures, RunResult

#: HTTP status of a request the queue shed (the router's answer)
SHED_STATUS = 429

#: a mix's key: a priority class (int) or a tenant (str)
K = TypeVar("K", int, str)


class GroupFigures(TypedDict):
    """One priority class's or tenant's figures (:func:`by_group`)."""

    requests: int
    attainment: float
    goodput_rps: float | None
    shed: int
    shed_wait_max_s: float | None
    queued: int
    wait_p99_s: float | None


class AdmissionFigures(TypedDict):
    """A run's admission figures (:func:`admission_figures`); rates in requests/s, waits in s."""

    queued: int
    shed: int
    shed_wait_max_s: float | None
    wait_p99_s: float | None
    goodput_rps: float | None
    offered_rps: float | None
    by_class: NotRequired[dict[str, GroupFigures]]
    by_tenant: NotRequired[dict[str, GroupFigures]]


class SimAdmission:
    """The admission queue of the simulated router (one process).

    ``dispatch(i, lease, decision, t)``: hand request ``i`` to its engine; ``reject(i, status,
    t)``: answer it without serving; ``prepare(i)``: called before each routing decision of
    request ``i`` (the oracle prefix view). ``waited[i]``: seconds request ``i`` spent in the
    queue (dispatched or shed)."""

    def __init__(self, cfg: AdmissionSection, scheduler: Scheduler, n: int,
                 dispatch: Callable[[int, Lease, Decision, float], None],
                 reject: Callable[[int, int, float], None],
                 prepare: Callable[[int], None] | None = None) -> None:
        self.q: AdmissionQueue[int] = AdmissionQueue(cfg)
        self.sched = scheduler
        scheduler.policy.report_ttft = True
        self.dispatch = dispatch
        self.reject = reject
        self.prepare = prepare
        self.infos: dict[int, RequestInfo] = {}
        self.waited: list[float | None] = [None] * n
        self.poll_s = cfg.poll_ms / 1000.0
        self._now = 0.0

    def arrive(self, i: int, info: RequestInfo, t: float) -> None:
        """Request ``i`` arrives at ``t`` (its class and tenant in ``info``): queue it and pump."""
        tk = self.q.ticket(i, t, info.prompt_len, info.priority, info.tenant, info.queue_budget_s)
        self.infos[i] = info
        if not self.q.offer(tk):
            self._shed(tk, t)
            return
        self.pump(t)

    def pump(self, t: float) -> None:
        """Dispatch what the cluster has room for, shed what expired (no-op when nothing waits)."""
        if self.q.depth == 0:
            return
        self._now = t
        out = self.q.pump(t, self._try)
        for tk, _ in out.shed:
            self._shed(tk, t)

    def _shed(self, tk: Ticket[int], t: float) -> None:
        self.waited[tk.payload] = tk.waited
        self.infos.pop(tk.payload, None)
        self.reject(tk.payload, SHED_STATUS, t)

    def _try(self, tk: Ticket[int]) -> str:
        i = tk.payload
        t = self._now
        if self.prepare is not None:
            self.prepare(i)
        info = self.infos[i]
        try:
            v, lease, d = route_ticket(self.q, self.sched, info, tk, t)
        except NoEligibleWorker as err:
            self.waited[i] = t - tk.arrival
            self.infos.pop(i, None)
            self.reject(i, err.status, t)
            return FAIL
        if v == GO:
            assert lease is not None and d is not None
            self.waited[i] = t - tk.arrival
            self.infos.pop(i, None)
            self.dispatch(i, lease, d, t)
        return v

    @property
    def waiting(self) -> int:
        """Requests in the queue now."""
        return self.q.depth


def parse_mix(flag: str, text: str | None, key: Callable[[str], K]) -> list[tuple[K, float]]:
    """``1:0.3,0:0.7`` → ``[(1, 0.3), (0, 0.7)]`` (weights need not sum to 1), each name read by
    ``key`` (``int``: priority classes, ``str``: tenants). Raises ValueError naming ``flag``."""
    if not text:
        return []
    out: list[tuple[K, float]] = []
    for part in text.split(","):
        name, sep, w = part.strip().rpartition(":")
        try:
            if not sep or not name:
                raise ValueError
            weight = float(w)
            k = key(name)
        except ValueError:
            raise ValueError(f"{flag} {text!r}: expected NAME:WEIGHT,... like "
                             f"{'1:0.3,0:0.7' if key is int else 'heavy:10,light:1'}") from None
        if not weight > 0:
            raise ValueError(f"{flag} {text!r}: weights must be > 0")
        out.append((k, weight))
    return out


def assign_mix(n: int, mix: Sequence[tuple[K, float]], seed: int, default: K) -> list[K]:
    """Each of ``n`` requests drawn a key of ``mix`` in proportion to its weight (seeded), or
    ``default`` for all when ``mix`` is empty."""
    if not mix:
        return [default] * n
    rng = random.Random(seed)
    keys = [k for k, _ in mix]
    weights = [w for _, w in mix]
    return rng.choices(keys, weights=weights, k=n)


def _r3(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def by_group(keys: Sequence[K], status: Sequence[int], met: Sequence[bool], waited: Sequence[float | None],
             span_s: float) -> dict[str, GroupFigures]:
    """Per group key: ``requests``, ``attainment`` (met / requests), ``goodput_rps`` (met / the
    window's arrival span), ``shed`` (429s), ``shed_wait_max_s`` (the longest a shed request
    waited), ``queued`` (requests that waited in the router) and ``wait_p99_s`` of those served."""
    from dplb_trace.stats import percentile

    out: dict[str, GroupFigures] = {}
    groups: dict[K, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    for k in sorted(groups, key=str):
        idx = groups[k]
        n_met = sum(1 for i in idx if met[i])
        shed = [i for i in idx if status[i] == SHED_STATUS]
        shed_waits = [w for i in shed if (w := waited[i]) is not None]
        served_waits = [w for i in idx if status[i] == 200 and (w := waited[i]) is not None]
        out[str(k)] = {
            "requests": len(idx), "attainment": round(n_met / len(idx), 4),
            "goodput_rps": round(n_met / span_s, 4) if span_s > 0 else None,
            "shed": len(shed), "shed_wait_max_s": round(max(shed_waits), 3) if shed_waits else None,
            "queued": sum(1 for w in served_waits if w > 0),
            "wait_p99_s": _r3(percentile(served_waits, 99)),
        }
    return out


def admission_figures(res: RunResult, att: Figures) -> AdmissionFigures:
    """The admission figures of a run (``res``: a :class:`simulate.cluster.RunResult`; ``att``:
    its ``slo_attainment`` figure): ``queued`` (requests that waited in the router's queue),
    ``shed`` (answered 429), ``shed_wait_max_s``, ``wait_p99_s`` of the served ones that waited,
    ``goodput_rps`` (SLO-met requests / the window's arrival span) and, when the run has more
    than one class or tenant, ``by_class`` and ``by_tenant`` (:func:`by_group`)."""
    from dplb_trace.stats import percentile

    n = len(res.status)
    missed = {m["index"] for m in att["misses"]}
    met = [i not in missed for i in range(n)]
    span = (res.arrival[-1] - res.arrival[0]) if n > 1 else 0.0
    waited = res.waited if res.waited else [None] * n
    queued = [w for i, w in enumerate(waited) if w is not None and w > 0 and res.status[i] == 200]
    shed_w = [w for i, w in enumerate(waited) if w is not None and res.status[i] == SHED_STATUS]
    out: AdmissionFigures = {
        "queued": len(queued), "shed": sum(1 for s in res.status if s == SHED_STATUS),
        "shed_wait_max_s": round(max(shed_w), 3) if shed_w else None,
        "wait_p99_s": _r3(percentile(queued, 99)),
        "goodput_rps": round(sum(met) / span, 4) if span > 0 else None,
        "offered_rps": round(n / span, 4) if span > 0 else None,
    }
    if res.priority and len(set(res.priority)) > 1:
        out["by_class"] = by_group(res.priority, res.status, met, waited, span)
    if res.tenant and len(set(res.tenant)) > 1:
        out["by_tenant"] = by_group(res.tenant, res.status, met, waited, span)
    return out


def group_lines(rows: Sequence[Figures]) -> str:
    """Per policy, attainment / goodput / sheds per class and per tenant (empty without groups)."""
    lines = []
    for r in rows:
        adm = r.get("admission") or {}
        for kind in ("by_class", "by_tenant"):
            for k, g in (adm.get(kind) or {}).items():
                lines.append(f"{r['policy']:<14} {kind[3:]:<6} {k:<10} requests {g['requests']:>5}  attainment "
                             f"{g['attainment']:.4f}  goodput {g['goodput_rps']} req/s  shed {g['shed']} "
                             f"(longest wait {g['shed_wait_max_s']} s)  wait p99 {g['wait_p99_s']} s")
    return "\n".join(lines)


def sweep_table(points: Sequence[Figures]) -> str:
    """The goodput-vs-offered-load curve (``--goodput-sweep``): per policy and rate, offered and
    SLO-met requests per second, goodput over the sweep's peak, attainment, sheds."""
    head = (f"{'policy':<14} {'x':>6} {'offered/s':>10} {'goodput/s':>10} {'of peak':>8} {'attain':>7} "
            f"{'shed':>5} {'ttft50':>7} {'ttft99':>7}")
    lines = [head]
    peak: dict[str, float] = {}
    for p in points:
        peak[p["policy"]] = max(peak.get(p["policy"], 0.0), p["goodput_rps"] or 0.0)
    for p in points:
        pk = peak[p["policy"]]
        rel = f"{(p['goodput_rps'] or 0.0) / pk:.3f}" if pk > 0 else "-"
        lines.append(f"{p['policy']:<14} {p['x']:>6.3g} {p['offered_rps']:>10.3f} {p['goodput_rps']:>10.3f} {rel:>8} "
                     f"{p['attainment']:>7.4f} {p['shed']:>5} {p['ttft_p50']:>7.2f} {p['ttft_p99']:>7.2f}")
    return "\n".join(lines)


__all__ = ["SHED_STATUS", "AdmissionFigures", "GroupFigures", "SimAdmission", "admission_figures", "assign_mix",
           "by_group", "group_lines", "parse_mix", "sweep_table"]
