"""The response side without a held round trip: a second ext_proc filter in Envoy's
``observability_mode`` (:attr:`epp.envoy.EnvoySettings.observe_response`).

With the response side on the request's own ext_proc stream, Envoy holds every answer's head
(and a non-streamed answer's body) until the picker has answered it: one more wake-up of the
picker and two of Envoy on each request's critical path. Observed instead:

- the first filter processes the request only (head and body; no response processing), so Envoy
  ends its stream once the request has gone upstream;
- at the pick, the lease is handed off (:class:`epp.handoff.Handoffs`): the routing answer also sets the
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
counts it, :attr:`epp.handoff.Handoffs.foreign`); the pick's replica ends the lease it handed off
after :data:`epp.handoff.CLAIM_S` without a verdict and counts it as a client that left. Use the synchronous
response side (the default) with several replicas.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoy import LEASE_HEADER
from epp.stream import OBSERVED, Exchange, _headers

if TYPE_CHECKING:
    from epp.picker import Picker


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
        """Take over the lease handed off under ``token`` (:meth:`epp.handoff.Handoffs.take`)."""
        src = self.picker.handoffs.take(token) if token else None
        if not isinstance(src, Exchange):
            return
        self.lease, self.handle, self.info, self.fallbacks = src.lease, src.handle, src.info, src.fallbacks
        self.route, self.t0, self.streaming, self.path = src.route, src.t0, src.streaming, src.path


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


__all__ = ["LEASE_HEADER", "Observer", "new_exchange"]
