"""The leases an observed response side waits to take over (:mod:`epp.observe`), by token.

At the pick, a request whose response side is observed hands its lease off (the exchange that
holds it is parked here under a new token, which the routing answer sets as the request header
``x-dplb-lease``); the observer filter's stream takes it by that token a few milliseconds later.
A lease nobody takes within :data:`CLAIM_S` is ended without a verdict (its holder's
``close()``: counted as a client that left): its observer's stream went to another picker replica,
or the request never went upstream.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Protocol

log = logging.getLogger("dplb.epp")

#: seconds a handed-off lease waits for its observer's stream (which opens within milliseconds of
#: the pick: Envoy sends the request head on it as soon as the first filter lets the head go)
CLAIM_S = 10.0


class Holder(Protocol):
    """What holds a handed-off lease (an :class:`epp.stream.Exchange`): ``close()`` ends it."""

    def close(self) -> None: ...


class Handoffs:
    """The handed-off leases not yet taken, by token ``<replica>.<n>`` (a random id of this picker
    process, then a counter); ``claim_s``: :data:`CLAIM_S`."""

    def __init__(self, claim_s: float = CLAIM_S) -> None:
        self.claim_s = claim_s
        self.replica = uuid.uuid4().hex[:8]
        self.n = 0
        #: token -> (time handed off, the holder), oldest first
        self.open: dict[str, tuple[float, Holder]] = {}
        #: observer streams whose token was not handed off here (another replica's, or expired)
        self.foreign = 0
        #: leases ended because nobody took them within :attr:`claim_s`
        self.expired = 0

    def put(self, holder: Holder) -> str:
        """Park ``holder`` under a new token; returns the token."""
        self.n += 1
        token = f"{self.replica}.{self.n}"
        self.open[token] = (time.monotonic(), holder)
        return token

    def take(self, token: str) -> Holder | None:
        """The holder parked under ``token``, removed; None when there is none (counted in :attr:`foreign`)."""
        got = self.open.pop(token, None)
        if got is None:
            self.foreign += 1
            log.debug("observer stream for lease %s: not handed off here", token)
            return None
        return got[1]

    def expire(self, now: float | None = None) -> int:
        """End (``close()``) the holders nobody took within :attr:`claim_s` of ``now``
        (``time.monotonic()``, seconds). Returns how many."""
        now = time.monotonic() if now is None else now
        old = []
        for token, (t, _) in self.open.items():   # oldest first
            if now - t < self.claim_s:
                break
            old.append(token)
        for token in old:
            self.open.pop(token)[1].close()
        if old:
            self.expired += len(old)
            log.warning("%d handed-off lease(s) ended without their response side (observer stream on another "
                        "picker replica, or the request never went upstream); %d so far", len(old), self.expired)
        return len(old)

    async def tick(self) -> None:
        """Health-tick extra (:class:`router.health.HealthMonitor`): :meth:`expire`."""
        self.expire()


__all__ = ["CLAIM_S", "Handoffs", "Holder"]
