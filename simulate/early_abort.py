"""When a simulated run may stop early (:class:`EarlyAbort`): the judge :mod:`simulate.cluster`'s
event loop asks at each first token, end and rejection. A run given a p99 SLO
(``SimSettings.abort_on``) stops once the SLO is certainly missed; a run given an attainment target
(``SimSettings.abort_below``) stops once the target is out of reach. Used by the capacity search
(:mod:`simulate.capacity`), which only needs to know that a rate fails, not by how much.
"""
from __future__ import annotations

from collections.abc import Sequence

from dplb_trace.mooncake import TraceRequest
from simulate.settings import SimSettings


def threshold_count(n: int, q: float = 99.0) -> int:
    """Samples above S among ``n`` that make the ``q``-th percentile (linear interpolation) exceed S
    for certain: with ``lo = floor((n-1)·q/100)`` the sorted value at ``lo`` is then above S."""
    lo = int((n - 1) * q / 100.0)
    return n - lo


class EarlyAbort:
    """When a run may stop early: its p99 SLO (``SimSettings.abort_on``) certainly missed, or its
    SLO-attainment target (``SimSettings.abort_below``) out of reach. Misses are certain at the
    first token (TTFT over the request's bound), at the end (TPOT over the bound) or at a
    rejection; a run stops once met <= n - misses can no longer reach q·n (the same comparison
    :func:`simulate.stats.slo_attainment` judges by). Each method returns True when the run must
    stop."""

    __slots__ = ("att", "att_lim", "att_q", "att_tpot", "missed", "n", "n_missed", "over_needed",
                 "over_tpot", "over_ttft", "tpot_lim", "ttft_lim")

    def __init__(self, s: SimSettings, reqs: Sequence[TraceRequest]) -> None:
        n = self.n = len(reqs)
        slo = s.abort_on
        self.ttft_lim = slo.ttft_p99_s if slo is not None else None
        self.tpot_lim = slo.tpot_p99_s if slo is not None else None
        self.over_needed = threshold_count(n)
        self.over_ttft = self.over_tpot = 0
        att = self.att = s.abort_below
        self.att_lim = [att[0].ttft_limit_s(r.input_length) for r in reqs] if att is not None else []
        self.att_tpot = att[0].tpot_s if att is not None else None
        self.att_q = att[1] if att is not None else 0.0
        self.missed = bytearray(n)
        self.n_missed = 0

    def miss(self, i: int) -> bool:
        """Count request ``i`` as missed (once); True when the target is now out of reach."""
        if self.att is None or self.missed[i]:
            return False
        self.missed[i] = 1
        self.n_missed += 1
        return (self.n - self.n_missed) / self.n < self.att_q

    def first_token(self, i: int, ft: float) -> bool:
        """Request ``i``'s first token came ``ft`` s after its arrival."""
        if self.ttft_lim is not None and ft > self.ttft_lim:
            self.over_ttft += 1
        return self.att is not None and ft > self.att_lim[i] and self.miss(i)

    def finished(self, i: int, tpot: float | None) -> bool:
        """Request ``i`` finished with a TPOT of ``tpot`` s (None: one output token)."""
        if self.tpot_lim is not None and tpot is not None and tpot > self.tpot_lim:
            self.over_tpot += 1
        return self.att_tpot is not None and tpot is not None and tpot > self.att_tpot and self.miss(i)

    def shed(self, i: int) -> bool:
        """Request ``i`` was shed by the admission queue (429): it never gets a first token, so it
        counts as a TTFT over the p99 bound (an infinite TTFT) and as a miss of the attainment
        target."""
        if self.ttft_lim is not None:
            self.over_ttft += 1
        return self.miss(i)

    def p99_missed(self) -> bool:
        """The p99 SLO is certainly missed (never without ``abort_on``: the counts stay 0)."""
        return self.over_ttft >= self.over_needed or self.over_tpot >= self.over_needed
