"""The response side without a held round trip: a second ext_proc filter in Envoy's
``observability_mode`` (:attr:`epp.envoy.EnvoySettings.observe_response`).

With the response side on the request's own ext_proc stream, Envoy holds every answer's head
(and a non-streamed answer's body) until the picker has answered it: one more wake-up of the
picker and two of Envoy on each request's critical path. Observed instead:

- the first filter processes the request only (head and body; no response processing), so Envoy
  ends its stream once the request has gone upstream;
- at the pick, the lease is handed off (:class:`Handoffs`): the routing answer also sets the
  request header ``x-dplb-lease: <token>`` (:data:`LEASE_HEADER`);
- a second ext_proc filter in ``observability_mode`` (Envoy sends without waiting for, or
  applying, any answer) sends the request head (with the token), the response head, each response
  body chunk and the body's end on its own gRPC stream, marked with the gRPC request header
  ``x-dplb-side: response`` (:data:`epp.envoy.SIDE_KEY`); its :class:`Observer` takes the lease over by
  the token and keeps the same accounting as the synchronous side (status, TTFT, token counts,
  the end, a cut stream judged by a probe of its engine), then ends that gRPC stream itself.

What the answer loses (nothing can be changed on a response Envoy does not hold): the
``x-dplb-worker-id`` response header comes from the route (Envoy copies the dynamic metadata the
pick sets, the picked worker's label: a request Envoy retried on a fallback shows the pick's);
an engine's abort is counted (502) but a non-streamed aborted answer still reaches the client as
its engine's 200, and a stream gets no SSE error event. A client that leaves is seen when Envoy
closes the observer's stream, ``deferred_close_timeout`` (:data:`epp.envoy.OBSERVE_CLOSE_S`) after
the request ended.

**One picker replica per Envoy.** Envoy balances each ext_proc stream on its own, so with several
replicas in the ``epp`` cluster the response stream reaches another replica than the pick's in
most cases. That replica cannot account for a lease it does not hold (it ends the stream and
counts it, :attr:`Handoffs.foreign`); the pick's replica ends the lease it handed off after
:data:`CLAIM_S` without a verdict and counts it as a client that left. Use the synchronous
response side (the default) with several replicas.
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoy import OBSERVED_HEADERS
from epp.stream import Exchange, _headers, _hv

if TYPE_CHECKING:
    from epp.picker import Picker

log = logging.getLogger("dplb.epp")

#: the request header that carries a handed-off lease's token from the pick to the observer
LEASE_HEADER = OBSERVED_HEADERS[0]
#: seconds a handed-off lease waits for its observer's stream before it is ended without a verdict
#: (the observer's stream opens within milliseconds of the pick: Envoy sends the request head on
#: it as soon as the first filter lets the head go)
CLAIM_S = 10.0
#: the observer's response mode (never one of ``ProcessingMode.BodySendMode``'s values): no answer
#: is held or asked for, every body chunk comes (``STREAMED``)
OBSERVED = -1


class Observer(Exchange):
    """The response side of one request on the observer filter's stream (module docstring):
    adopts the lease handed off under the token of the request head, then accounts for the
    response as :class:`epp.stream.Exchange` does. Sends no answer (Envoy ignores them)."""

    __slots__ = ()

    def __init__(self, picker: Picker) -> None:
        super().__init__(picker, 1, OBSERVED, eager=False)

    def on_message(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """Account for one message (the request head: adopt the lease; the response's parts);
        returns no answer."""
        if req.WhichOneof("request") == "request_headers":
            self._adopt(_headers(req.request_headers).get(LEASE_HEADER))   # the only header (epp.envoy.OBSERVED_HEADERS)
            return []
        super().on_message(req)
        return []

    def _adopt(self, token: str | None) -> None:
        """Take over the lease handed off under ``token`` (:meth:`Handoffs.take`)."""
        handoffs = self.picker.handoffs
        src = handoffs.take(token) if token else None
        if src is None:
            if token:
                handoffs.foreign += 1
                log.debug("observer stream for lease %s: not handed off here", token)
            return
        self.lease, self.handle, self.info, self.fallbacks = src.lease, src.handle, src.info, src.fallbacks
        self.route, self.t0, self.streaming, self.path = src.route, src.t0, src.streaming, src.path


class Handoffs:
    """The leases handed off at the pick and not yet adopted by their :class:`Observer`, by token
    (``<replica>.<n>``: a random replica id, then a counter)."""

    def __init__(self, claim_s: float = CLAIM_S) -> None:
        self.claim_s = claim_s
        self.replica = uuid.uuid4().hex[:8]
        self.n = 0
        #: token -> (time handed off, the pick's exchange holding the lease), oldest first
        self.open: dict[str, tuple[float, Exchange]] = {}
        #: observer streams whose token was not handed off here (another replica's, or expired)
        self.foreign = 0
        #: leases ended because no observer adopted them within :attr:`claim_s`
        self.expired = 0

    def put(self, ex: Exchange, answer: pb.ProcessingResponse, on_body: bool) -> pb.ProcessingResponse:
        """Hand off ``ex``'s lease (``ex`` no longer ends it) and return ``answer`` (the routing
        answer to the request head, or with ``on_body`` to its body) with :data:`LEASE_HEADER`
        set to the new token."""
        self.n += 1
        token = f"{self.replica}.{self.n}"
        held = Exchange(ex.picker, ex.body_mode, OBSERVED, eager=False)
        held.lease, held.handle, held.info, held.fallbacks = ex.lease, ex.handle, ex.info, ex.fallbacks
        held.route, held.t0, held.streaming, held.path = ex.route, ex.t0, ex.streaming, ex.path
        ex.lease = None
        now = time.monotonic()
        self.open[token] = (now, held)
        out = pb.ProcessingResponse()
        out.CopyFrom(answer)
        common = out.request_body.response if on_body else out.request_headers.response
        common.header_mutation.set_headers.append(_hv(LEASE_HEADER, token))
        return out

    def take(self, token: str) -> Exchange | None:
        """The exchange holding the lease handed off under ``token``, removed; None when there is none."""
        got = self.open.pop(token, None)
        return got[1] if got is not None else None

    def expire(self, now: float | None = None) -> int:
        """End the leases no observer adopted within :attr:`claim_s` (no verdict; counted as a
        client that left, :meth:`epp.stream.Exchange.close`'s rule for a stream without a
        response). Returns how many."""
        now = time.monotonic() if now is None else now
        old = []
        for token, (t, _) in self.open.items():   # oldest first
            if now - t < self.claim_s:
                break
            old.append(token)
        for token in old:
            _, ex = self.open.pop(token)
            ex.close()
        if old:
            self.expired += len(old)
            log.warning("%d handed-off lease(s) ended without their response side (observer stream on another "
                        "picker replica, or the request never went upstream); %d so far", len(old), self.expired)
        return len(old)

    async def tick(self) -> None:
        """Health-tick extra (:class:`router.health.HealthMonitor`): :meth:`expire`."""
        self.expire()


def new_exchange(picker: Picker, body_mode: int, resp_mode: int, side: str | None) -> Exchange:
    """The exchange of a new ext_proc stream whose gRPC request header ``x-dplb-side``
    (:data:`epp.envoy.SIDE_KEY`) is ``side``: ``response``, an :class:`Observer`; ``request``, an
    :class:`epp.stream.Exchange` that hands its lease off at the pick; None (or anything else), an
    exchange that keeps the response side on its own stream. ``body_mode``/``resp_mode``: assumed
    until Envoy's ``protocol_config`` says."""
    if side == "response":
        return Observer(picker)
    ex = Exchange(picker, body_mode, resp_mode)
    ex.observed = side == "request"
    return ex


__all__ = ["CLAIM_S", "LEASE_HEADER", "OBSERVED", "Handoffs", "Observer", "new_exchange"]
