"""The ext_proc stream handler: **one ext_proc stream per request**
(``envoy.service.ext_proc.v3.ExternalProcessor/Process``, Envoy's processing mode from
:mod:`epp.envoy`). :class:`Exchange` follows it:

==================  ===========================================================================
request headers     kept (``:path``, ``x-session-id``); answered at once in ``BUFFERED`` mode,
                    not before the body's end in ``FULL_DUPLEX_STREAMED`` and in *eager*
                    ``STREAMED`` (Envoy's ``send_body_without_waiting_for_header_response``: the
                    body's chunks follow the head without waiting for its answer; the modes come
                    in the stream's ``protocol_config``). A request without a body (``GET``) gets
                    a worker at once, without a lease; a ``POST`` without one is a 400.
request body        ``BUFFERED``: one message, the whole body. ``FULL_DUPLEX_STREAMED`` and eager
                    ``STREAMED``: chunks, buffered to the end of stream. At its end, request control
                    (:class:`router.director.Director`, the HTTP router's too): parse once and
                    check the model (400, 404), admission (the stream is held while the request
                    waits), choose and take the lease (503 with
                    ``retry-after`` when no worker can take it), answer with the header
                    ``x-gateway-destination-endpoint: ip:port`` and the same value in the dynamic
                    metadata (``envoy.lb``), followed by up to :attr:`Picker.fallbacks` other
                    endpoints (``ip:port,ip:port``: Envoy's pool cluster retries down that list,
                    :mod:`epp.envoy`); full duplex re-sends the body in chunks of at most
                    :data:`CHUNK` bytes after the headers answer (GIE's protocol); eager
                    ``STREAMED`` answers the head (the pick) then each chunk, unchanged, in order:
                    two exchanges with the picker per tiny request instead of four.
response headers    ``:status``: below 500 is liveness evidence (the health monitor) and the
                    breaker's "ok"; the answer adds ``x-dplb-worker-id``. An event stream, or a
                    streamed request, is metered (:class:`router.stream_meter.StreamMeter`); any
                    other answer's body is asked for whole, in one message (:data:`WHOLE_ANSWER`,
                    response body mode ``STREAMED`` only), or, eager, its head's answer is held
                    until the body's end (Envoy sends the body without waiting; past
                    :data:`ANSWER_KEEP` bytes the head goes on with what came so far).
                    When Envoy reports (``envoy.lb`` / ``x-gateway-destination-endpoint-served``)
                    that a fallback served, the pick's lease is judged a failure and a lease is
                    taken on the worker that served.
response body       each chunk is answered unchanged (``FULL_DUPLEX_STREAMED``: sent back as a
                    streamed body mutation); the first content event is the TTFT
                    (the lease leaves prefill, the prefill rate is learned); the end of stream
                    releases the lease with the output token count (TPOT) and the verdict.
                    Response body mode ``NONE``: prefill is taken as done at the head, the gRPC
                    stream's end settles the lease as complete (no token counts).
stream's end        a stream that ends before the response's end (Envoy reset it: client gone,
                    engine failed, timeout) is told apart by one probe of its engine
                    (``GET /health``, :data:`CUT_PROBE_S`): the engine gone, the stream broke
                    under the client (status 502 and a ``stream_broken`` error, as the HTTP
                    router counts it, a breaker failure); else the client left (status 499, no
                    verdict); the lease is released exactly once (:class:`router.scheduling.Lease`);
                    unless its SSE ``data: [DONE]`` had passed: that stream was complete (the
                    ``openai`` client closes its connection there). An engine-side abort
                    (``finish_reason: "abort"``) ends a stream with an OpenAI-shaped SSE error
                    event added to the chunk that carries it (before the engine's ``data:
                    [DONE]``, never after it), and counts 502 ``engine_abort``. A non-streamed
                    answer is asked whole at its head (:data:`WHOLE_ANSWER`: Envoy holds the
                    head until the picker answers the body), so one its engine aborted is answered **502** in the OpenAI shape,
                    as counted; with response body mode ``FULL_DUPLEX_STREAMED`` its 200 head has
                    left by then and only the count says 502.
==================  ===========================================================================

Once the response's end (or an immediate response) is answered the exchange is :attr:`Exchange.done`:
the ext_proc server ends the gRPC stream with that answer (:mod:`epp.h2grpc`) instead of waiting for
Envoy's end of stream.

Errors are immediate responses with OpenAI-shaped bodies (:func:`dplb_protocol.wire.error_body`),
``content-type: application/json`` and ``x-dplb-worker-id: none``.

The decisions are the picker's (:class:`epp.picker.Picker`) and request control's
(:class:`router.director.Director`); this module speaks Envoy's protocol only.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from dplb_protocol.wire import BadRequest, OpenAIError
from epp.answers import (
    WHOLE_ANSWER,
    _headers,
    _hv,
    destination,
    head_answer,
    hold_response,
    immediate,
    response_status,
    route_answer,
    served_endpoint,
    shared,
)
from epp.envoy import LEASE_HEADER, SIDE_KEY
from epp.picker import Picker, envoy_target
from router.director import ENGINE_ABORT, route_of
from router.errors import BodyTooLarge, TransportError, UpstreamError
from router.policies.base import RequestInfo
from router.scheduling import Lease
from router.stream_meter import StreamMeter, is_event_stream, split_done
from router.workers import WorkerHandle

log = logging.getLogger("dplb.epp")

#: largest body chunk sent back in FULL_DUPLEX_STREAMED mode (GIE's EPP: 62,000 bytes, under
#: Envoy's 64 KiB default gRPC message budget with headroom)
CHUNK = 62_000
#: a non-streamed answer is kept up to this many bytes to read its ``usage`` (then its tail only)
ANSWER_KEEP = 1 << 20
#: seconds the probe that tells a broken stream from a client that left may take (module docstring)
CUT_PROBE_S = 1.0
#: the probes of cut streams under way (kept referenced until done)
_JUDGING: set[asyncio.Task[None]] = set()
_PROBING = "probing"   # Exchange.cut while the probe of a cut stream is out
_FULL_DUPLEX = 4   # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_NONE = 0          # ProcessingMode.BodySendMode.NONE
_STREAMED = 1      # ProcessingMode.BodySendMode.STREAMED


#: the observer's response mode (:mod:`epp.observe`; no ``BodySendMode``): nothing held or asked for
OBSERVED = -1
#: the answer to a body chunk that goes on unchanged (never mutated: shared)
_REQUEST_BODY_OK = shared(pb.ProcessingResponse(request_body=pb.BodyResponse()))
_RESPONSE_BODY_OK = shared(pb.ProcessingResponse(response_body=pb.BodyResponse()))


class Exchange:
    """One request's ext_proc stream (module docstring). :meth:`on_message` answers each message
    (a list of responses, possibly empty); :meth:`close` at the stream's end, always."""

    __slots__ = ("body", "body_mode", "cut", "done", "duplex", "eager", "fallbacks", "handle", "head", "headers", "info", "kept",
                 "lease", "lookup", "meter", "observed", "owed", "path", "picker", "resp_mode", "route", "size", "status",
                 "streaming", "t0", "trailers", "waiting", "whole")

    def __init__(self, picker: Picker, body_mode: int, resp_mode: int = 1, eager: bool | None = None) -> None:
        self.picker = picker
        self.body_mode = body_mode
        #: Envoy sends a ``STREAMED`` body without waiting for the head's answer
        #: (``send_body_without_waiting_for_header_response``): the head is answered with the body's
        #: end, the answers to the chunks after it (module docstring); None: as the request body mode
        #: says until Envoy's ``protocol_config`` does
        self.eager = body_mode == _STREAMED if eager is None else eager
        #: body chunks seen whose answers wait for the head's (eager mode), this side and the response's
        self.owed = 0
        #: the held answer to a non-streamed response head (eager mode), sent with its body's end
        self.head: pb.ProcessingResponse | None = None
        #: nothing more will come or be answered: the response ended, or an immediate response went
        #: (the ext_proc server may end the stream at once, :mod:`epp.h2grpc`)
        self.done = False
        #: the response body mode (``ProcessingMode.BodySendMode``: 1 STREAMED, 4 full duplex, 0 none)
        self.resp_mode = resp_mode
        #: the response side is observed on another stream (:mod:`epp.observe`): the lease is handed off at the pick
        self.observed = False
        self.info: RequestInfo | None = None
        #: a request admission holds back (:meth:`Director.may_dispatch` said no): ``(body,
        #: trailers)`` to dispatch once :meth:`admit` returns; the stream's driver awaits it
        self.waiting: tuple[bytes, bool] | None = None
        #: the request waiting is a prefix miss that first reads the other replicas' pushes
        #: (:meth:`epp.share.PickerShare.wants_lookup`), then passes admission
        self.lookup = False
        self.fallbacks: list[WorkerHandle] = []
        self.t0 = time.perf_counter()
        self.duplex = False
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.size = 0
        self.path = "/"
        self.route = "/v1/other"
        self.handle: WorkerHandle | None = None
        self.lease: Lease | None = None
        self.meter: StreamMeter | None = None
        self.streaming = False
        self.status = 0
        self.kept: list[bytes] = []
        #: a non-streamed answer asked whole (:data:`WHOLE_ANSWER`): its head waits for its body
        self.whole = False
        self.trailers = False
        #: why an answer that reached its end is a failure (502): ``engine_abort``, ``stream_broken``
        self.cut: str | None = None

    # -- request side --------------------------------------------------------------------------
    def on_message(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The answers to one message of Envoy's."""
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(req)
        if kind == "request_body":
            b = req.request_body
            if b.body:
                self.body.append(b.body)
                self.size += len(b.body)
                limit = self.picker.state.cfg.router.max_body_bytes
                if self.size > limit:   # full duplex buffers here: the router's limit holds (413)
                    self.body = []
                    return [self._refuse(BodyTooLarge(f"request body is larger than {limit} bytes "
                                                      "(router.max_body_bytes)"))]
            if self.early:
                self.owed += 1   # answered after the head's answer (_dispatch)
            if not b.end_of_stream:
                return [] if self.duplex or self.early else [_REQUEST_BODY_OK]
            return self._pick(b"".join(self.body))
        if kind == "request_trailers":
            late = (self.duplex or self.early) and self.handle is None
            out = self._pick(b"".join(self.body), trailers=True) if late else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            self._served(req)
            return self._response_headers(req.response_headers)
        if kind == "response_body":
            return self._response_body(req.response_body)
        if kind == "response_trailers":
            self.done = True
            self._end(True)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = _headers(req.request_headers)
        self.path = self.headers.get(":path", "/").split("?", 1)[0]
        self.route = route_of(self.path)
        if req.HasField("protocol_config"):
            pc = req.protocol_config
            self.body_mode, self.resp_mode = pc.request_body_mode, pc.response_body_mode
            self.eager = pc.send_body_without_waiting_for_header_response
        self.duplex = self.body_mode == _FULL_DUPLEX
        if req.request_headers.end_of_stream:
            if self.headers.get(":method") == "POST":   # as the router answers it (dplb_protocol.wire)
                return [self._refuse(BadRequest("request body is empty; expected a JSON object"))]
            try:
                h = self.picker.any_worker(self.path)
            except OpenAIError as e:
                return [self._refuse(e)]
            self.handle = h
            return [route_answer((h.endpoint,), False)]
        if self.duplex or self.early:
            return []   # answered with the body's end (the pick changes the headers)
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    @property
    def early(self) -> bool:
        """The request body comes without waiting for the head's answer (``STREAMED`` and Envoy's
        ``send_body_without_waiting_for_header_response``): the head is answered at the body's end."""
        return self.eager and self.body_mode == _STREAMED

    def _refuse(self, e: OpenAIError) -> pb.ProcessingResponse:
        """The immediate response refusing the request with ``e``, counted (no worker chosen)."""
        self.picker.director.refused(e, self.route, self.t0)
        self.done = True
        return immediate(e)

    def _pick(self, body: bytes, trailers: bool = False) -> list[pb.ProcessingResponse]:
        """Parse and check the request (:meth:`Director.request`), then, when admission lets it
        through at once, :meth:`_dispatch` it; else it waits (:attr:`waiting`, :meth:`admit`) and
        the answer is :func:`hold_response` (Envoy asked to wait for the next one). A prefix miss
        on a picker sharing with others through Redis waits the same way, for one read of what
        they pushed (:attr:`lookup`), before admission and the pick."""
        p = self.picker
        director = p.director
        try:
            session = self.headers.get(p.session_header)
            info = director.request(self.path, body, session.encode("latin-1") if session else None)
        except OpenAIError as e:
            return [self._refuse(e)]
        self.streaming = info.stream
        self.info = info
        director.tag(info, ((k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()),
                     (self.headers.get("authorization") or "").encode("latin-1") or None)
        share = p.share
        self.lookup = share is not None and share.wants_lookup(info.text, info.model)
        if self.lookup or not director.may_dispatch(info):
            self.waiting = (body, trailers)
            # Envoy waits message_timeout for each answer; the queue may hold the request longer
            return [hold_response(p.state.cfg.admission)]
        return self._dispatch(info, body, trailers)

    async def admit(self) -> list[pb.ProcessingResponse]:
        """The request :attr:`waiting` reads the other replicas' pushes when it is a prefix miss
        (:attr:`lookup`: :meth:`router.share.Share.sync`, bounded by ``share.lookup_ms``), passes
        admission (:meth:`Director.admit`; the ext_proc stream is held meanwhile), then is
        dispatched: the answers that send it on, or the immediate response refusing it."""
        assert self.waiting is not None and self.info is not None
        (body, trailers), self.waiting = self.waiting, None
        share = self.picker.share
        if self.lookup and share is not None and share.share is not None:
            self.lookup = False
            await share.share.sync()   # bounded (share.lookup_ms); never raises
        try:
            await self.picker.director.admit(self.info)
        except OpenAIError as e:
            return [self._refuse(e)]
        return self._dispatch(self.info, body, trailers)

    def _dispatch(self, info: RequestInfo, body: bytes, trailers: bool) -> list[pb.ProcessingResponse]:
        """Choose and lease (:meth:`Picker.dispatch`); the answers that send the request to the
        chosen worker (and its fallbacks)."""
        try:
            self.handle, self.lease, self.fallbacks = self.picker.dispatch(info)
        except OpenAIError as e:
            return [self._refuse(e)]
        endpoints = (self.handle.endpoint, *(f.endpoint for f in self.fallbacks))
        if self.early:   # the head's answer routes; then one answer per body chunk, in order
            owed, self.owed, self.body = self.owed, 0, []
            return [self._route(endpoints, False), *[_REQUEST_BODY_OK] * owed]
        if not self.duplex:
            return [self._route(endpoints, True)]
        out = [self._route(endpoints, False)]
        n = len(body)
        for i in range(0, max(n, 1), CHUNK):
            last = i + CHUNK >= n
            out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=body[i:i + CHUNK], end_of_stream=last and not trailers))))))
        self.body = []
        return out

    def _route(self, endpoints: tuple[str, ...], on_body: bool) -> pb.ProcessingResponse:
        """:func:`route_answer`; with the response side observed (:mod:`epp.observe`) the lease is
        handed off and the answer carries its token."""
        if not self.observed:
            return route_answer(endpoints, on_body)
        assert self.handle is not None
        held = Exchange(self.picker, self.body_mode, OBSERVED, eager=False)   # the lease, parked for the observer
        for k in ("lease", "handle", "info", "fallbacks", "route", "t0", "streaming", "path"):
            setattr(held, k, getattr(self, k))
        self.lease = None
        out = pb.ProcessingResponse()
        out.CopyFrom(route_answer(endpoints, on_body, self.handle.label))
        common = out.request_body.response if on_body else out.request_headers.response
        common.header_mutation.set_headers.append(_hv(LEASE_HEADER, self.picker.handoffs.put(held)))
        return out

    # -- response side -------------------------------------------------------------------------
    def _served(self, req: pb.ProcessingRequest) -> None:
        """Envoy retried the request on a fallback (a connect failure or a reset before the head on
        the pick): the pick's attempt failed (refused: the health monitor takes the worker out until
        a probe passes; breaker verdict False) and the lease moves to the worker that served."""
        lease, h = self.lease, self.handle
        if lease is None or h is None or lease.judged:
            return
        served = served_endpoint(req)
        if served is None or served == envoy_target(h.endpoint):
            return
        metrics = self.picker.state.metrics
        lease.refused()
        lease.finish(False)
        metrics.errors.labels(h.label, "connect").inc()
        metrics.retries.labels("connect").inc()
        log.info("worker %s (%s) failed before answering; Envoy retried on %s", h.label, h.endpoint, served)
        assert self.info is not None   # a lease was taken for it
        moved = self.picker.served_by(self.info, served)
        self.handle, self.lease = moved if moved is not None else (None, None)

    def _response_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        self.status, ctype = response_status(msg)
        h = self.handle
        if self.lease is not None:
            if 0 < self.status < 500:
                self.lease.head_seen()
            sse = is_event_stream([(b"content-type", ctype.encode("latin-1"))])
            self.streaming = self.streaming or sse
            if self.resp_mode == _NONE:
                # no body comes: prefill is taken as done at the head (no TTFT learned) and the end is
                # the stream's (no token counts, no TPOT; a client that left looks complete)
                self.lease.first_token(observed=False)
            elif self.streaming:
                self.meter = StreamMeter(sse)
                self.lease.progress = self.meter.content_events   # tokens so far (the TPOT-SLO term)
        label = h.label if h else "none"
        resp = head_answer(label, False)
        if msg.end_of_stream:
            self.done = True
            self._end(True)
        elif self.resp_mode == _STREAMED and not self.streaming:
            self.whole = True   # its head waits for the body: an aborted answer can still become a 502
            if self.eager and self.lease is not None:
                self.head = resp   # the body comes without waiting: the head is answered with its end
                return []
            resp = head_answer(label, True)   # WHOLE_ANSWER: Envoy's allow_mode_override (epp.envoy)
        return [resp]

    def _response_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        lease = self.lease
        extra = b""   # an SSE error event after an engine's abort
        if lease is not None and b.body:
            m = self.meter
            if m is not None:
                if m.feed(b.body):
                    self.picker.director.first_content(self.route, self.t0, lease)
                if self.cut is None and m.sse and (c := self.picker.director.aborted_stream(m, lease.handle.worker_id)):
                    self.cut, extra = ENGINE_ABORT, c[2]
            elif sum(len(x) for x in self.kept) < ANSWER_KEEP:
                self.kept.append(b.body)
        if self.head is not None:   # the head waits for this answer's end (eager mode)
            self.owed += 1
            if not b.end_of_stream:
                if sum(len(x) for x in self.kept) < ANSWER_KEEP:
                    return []
                self.whole = False   # too long to hold: the head goes on, an abort can only be counted
                return self._release()
        elif not b.end_of_stream:
            self.whole = False   # a part went on (an answer above Envoy's buffer limit): its head with it
        if b.end_of_stream:
            self.done = True
            self._end(True)
            if self.whole and self.cut == ENGINE_ABORT and lease is not None:
                # the head is still held: the aborted answer becomes the 502 it was counted
                self.head = None
                return [immediate(UpstreamError(f"worker {lease.handle.worker_id}'s engine aborted the request "
                                                "(finish_reason \"abort\"): the answer is truncated",
                                                worker_id=lease.handle.worker_id), lease.handle.label)]
            if self.head is not None:
                return self._release()
        if extra:   # the abort's error event goes before the engine's [DONE], never after it
            body, done = split_done(b.body)
            extra = body + extra + done
        if self.resp_mode == _FULL_DUPLEX:   # the chunk goes on only as the picker sends it back
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=extra or b.body, end_of_stream=b.end_of_stream)))))]
        if extra:
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(body=extra))))]
        return [_RESPONSE_BODY_OK]

    def _release(self) -> list[pb.ProcessingResponse]:
        """The held head's answer (eager mode), then one answer per body chunk it waited for."""
        assert self.head is not None
        out = [self.head, *[_RESPONSE_BODY_OK] * self.owed]
        self.head, self.owed = None, 0
        return out

    def _end(self, complete: bool) -> None:
        """The response ended (``complete``) or the stream did before it: release the lease once."""
        lease = self.lease
        if lease is None or lease.judged:
            return
        director = self.picker.director
        label = lease.handle.label
        if self.meter is not None:
            director.stream_end(self.meter, lease, complete and self.cut is None)
        elif complete:
            body = b"".join(self.kept)
            director.answer(lease, body)
            if self.cut is None and director.aborted_anywhere(body, False):
                director.abort_error(lease.handle.worker_id)   # counted; its head (200) has left
                self.cut = ENGINE_ABORT
        if self.cut is not None:   # a truncated answer: a failure, counted 502
            lease.finish(False)
            director.finished(label, 502, self.route, self.t0)
        elif complete:
            lease.finish(0 < self.status < 500)
            director.finished(label, self.status, self.route, self.t0)
        else:
            lease.finish(None)
            director.client_left(label, self.route, self.t0)

    def close(self) -> None:
        """The stream ended: a lease still open is released, complete when the stream had its
        whole answer (its SSE ``data: [DONE]`` passed: the official ``openai`` client closes its
        connection there, before the engine's terminating chunk, as :func:`router.relay.delivered`
        counts it); a response cut before its end is judged by a probe of its engine
        (:meth:`_judge_cut`)."""
        complete = (self.meter.ended_with_done() if self.meter is not None
                    else self.resp_mode == _NONE and self.status > 0)
        lease = self.lease
        if complete or lease is None or lease.judged or self.status == 0:
            self._end(complete)
            return
        if self.cut == _PROBING:
            return                   # closed again while its probe is out
        self.cut = _PROBING
        task = asyncio.get_running_loop().create_task(self._judge_cut(lease))
        _JUDGING.add(task)
        task.add_done_callback(_JUDGING.discard)

    async def _judge_cut(self, lease: Lease) -> None:
        """A response cut before its end: did the client leave (499), or did the engine fail
        under it (502 ``stream_broken``, as the HTTP router counts a stream that broke)? One
        ``GET /health`` of the engine within :data:`CUT_PROBE_S` tells: no answer, or a 5xx, and
        the engine is taken to have failed."""
        h = lease.handle
        try:
            status, _ = await self.picker.state.transport.get(h.endpoint, "/health", CUT_PROBE_S)
            alive = status < 500
        except TransportError:
            alive = False
        self.cut = None
        if not alive:
            self.cut = "stream_broken"
            self.picker.director.metrics.errors.labels(h.label, "stream_broken").inc()
        self._end(False)


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """``ExternalProcessor/Process`` over a :class:`Picker`: ``new_exchange(side)`` makes each
    stream's exchange from its ``x-dplb-side`` gRPC request header (:func:`epp.observe.new_exchange`)."""

    def __init__(self, new_exchange: Callable[[str | None], Exchange]) -> None:
        self.new_exchange = new_exchange

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        """One request's stream (module docstring); the lease is released in ``finally``."""
        ex = self.new_exchange(next((m.value for m in context.invocation_metadata() or () if m.key == SIDE_KEY), None))
        try:
            async for req in request_iterator:
                out = ex.on_message(req)
                if ex.waiting is not None:   # admission holds the request: wait here, the stream held
                    for resp in out:         # the hold answer (override_message_timeout) first
                        yield resp
                    out = await ex.admit()
                for resp in out:
                    yield resp
        finally:
            ex.close()


__all__ = ["ANSWER_KEEP", "CHUNK", "WHOLE_ANSWER", "Exchange", "ExtProcServicer", "destination", "immediate", "route_answer",
           "served_endpoint"]
