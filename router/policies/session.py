"""session: consistent hashing on a session key, with bounded load.

The key is the request's ``X-Session-Id`` header (``routing_policy.session_header``), else the
body's ``user``; requests without one go to the least-loaded worker. Each eligible worker owns
``vnodes`` points on a hash ring (64-bit BLAKE2b of ``"<worker>#<k>"``); the key's point walks the
ring clockwise to the first worker whose load stays within ``max_load_skew`` × the mean: with
``P`` requests pending over ``n`` workers, a worker is taken while ``pending_i + 1 <=
ceil(max_load_skew · (P + 1) / n)``. That is "consistent hashing with bounded loads" (Mirrokni,
Thorup, Zadimoghaddam, SODA 2018): a session stays on its worker (and its KV cache) while that
worker is not overloaded, and a worker leaving moves only its own sessions.

Config: ``routing_policy: {policy: session, session_header: x-session-id, max_load_skew: 1.5}``
"""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from router.policies.base import (
    BasePolicy,
    Decision,
    RequestInfo,
    least_loaded,
    load_scores,
    pending,
)
from router.policies.registry import PolicyContext, PolicyParams, PolicySpec, register

if TYPE_CHECKING:
    from dplb_shm.types import WorkerSnapshot


def _h(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "big")


class SessionPolicy(BasePolicy):
    """Consistent hashing with bounded load (see the module docstring)."""

    name = "session"

    def __init__(self, max_load_skew: float = 1.5, vnodes: int = 64, rng=None) -> None:
        super().__init__(rng)
        self.max_load_skew = max(1.0, max_load_skew)
        self.vnodes = max(1, vnodes)
        self._rings: dict[frozenset[int], tuple[list[int], list[int]]] = {}

    def ring(self, ids: frozenset[int]) -> tuple[list[int], list[int]]:
        """``(points, owners)`` of the ring over worker ``ids`` (cached per set of ids)."""
        r = self._rings.get(ids)
        if r is None:
            pts = sorted((_h(f"{w}#{k}"), w) for w in ids for k in range(self.vnodes))
            r = ([p for p, _ in pts], [w for _, w in pts])
            if len(self._rings) > 64:
                self._rings.clear()
            self._rings[ids] = r
        return r

    def choose(self, workers: Sequence[WorkerSnapshot], req: RequestInfo, explain: bool = False) -> Decision:
        rows = load_scores(workers) if explain else []
        if not req.session:
            return Decision(least_loaded(workers, self.rng).worker_id, "no_session", rows)
        by_id = {w.worker_id: w for w in workers}
        points, owners = self.ring(frozenset(by_id))
        total = sum(pending(w) for w in workers)
        cap = math.ceil(self.max_load_skew * (total + 1) / len(workers))
        start = bisect.bisect(points, _h(req.session)) % len(points)
        seen: set[int] = set()
        for k in range(len(points)):
            wid = owners[(start + k) % len(points)]
            if wid in seen:
                continue
            if pending(by_id[wid]) + 1 <= cap:
                return Decision(wid, "session" if not seen else "session_spill", rows)
            seen.add(wid)
            if len(seen) == len(by_id):
                break
        return Decision(least_loaded(workers, self.rng).worker_id, "session_spill", rows)


class SessionParams(PolicyParams):
    """``session``'s parameters: the header naming a request's session (the router reads it for
    every policy's ``RequestInfo.session``) and the bounded-load factor."""

    session_header: str = Field(default="x-session-id", min_length=1)
    max_load_skew: float = Field(default=1.5, ge=1)


def _build(p: SessionParams, ctx: PolicyContext) -> SessionPolicy:
    return SessionPolicy(p.max_load_skew, rng=ctx.rng)


SPEC = register(PolicySpec("session", SessionParams, _build,
                           reads="consistent hash of a session key, bounded load"))
