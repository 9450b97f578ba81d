"""The endpoint picker's servers: ext_proc (gRPC), gRPC health, ``/metrics`` (HTTP).

**One ext_proc stream per request** (``envoy.service.ext_proc.v3.ExternalProcessor/Process``,
Envoy's processing mode from :mod:`epp.envoy`). :class:`Exchange` follows it:

==================  ===========================================================================
request headers     kept (``:path``, ``x-session-id``); answered at once in ``BUFFERED`` mode,
                    not before the body's end in ``FULL_DUPLEX_STREAMED`` (the mode comes in the
                    stream's ``protocol_config``). A request without a body (``GET``) gets a
                    worker at once, without a lease; a ``POST`` without one is a 400.
request body        ``BUFFERED``: one message, the whole body. ``FULL_DUPLEX_STREAMED``: chunks,
                    buffered to the end of stream. At its end, request control
                    (:class:`router.director.Director`, the HTTP router's too): parse once and
                    check the model (400, 404), admission (the stream is held while the request
                    waits), choose and take the lease (503 with
                    ``retry-after`` when no worker can take it), answer with the header
                    ``x-gateway-destination-endpoint: ip:port`` and the same value in the dynamic
                    metadata (``envoy.lb``), followed by up to :attr:`Picker.fallbacks` other
                    endpoints (``ip:port,ip:port``: Envoy's pool cluster retries down that list,
                    :mod:`epp.envoy`); full duplex re-sends the body in chunks of at most
                    :data:`CHUNK` bytes after the headers answer (GIE's protocol).
response headers    ``:status``: below 500 is liveness evidence (the health monitor) and the
                    breaker's "ok"; the answer adds ``x-dplb-worker-id``. An event stream, or a
                    streamed request, is metered (:class:`router.stream_meter.StreamMeter`).
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
                    engine failed, timeout) releases the lease with no verdict (status 499 in
                    ``dplb_router_requests_total``), exactly once (:class:`router.scheduling.Lease`);
                    unless its SSE ``data: [DONE]`` had passed: that stream was complete (the
                    ``openai`` client closes its connection there).
==================  ===========================================================================

Errors are immediate responses with OpenAI-shaped bodies (:func:`router.protocol.error_body`),
``content-type: application/json`` and ``x-dplb-worker-id: none``. Workers whose engine listens
on a Unix socket cannot be Envoy ``ORIGINAL_DST`` targets and are left out (logged once).

The picker (:class:`Picker`) is the router's own :class:`router.state.RouterState` (scheduler,
policies and native kernel, registry, breaker, health monitor with probes, accounting on the
segment's router lines and the process ledger, metrics) without its HTTP server; endpoints from a
file are scraped into slots by :class:`epp.discovery.ScrapeManager`.

**Health** (gRPC ``grpc.health.v1.Health``, its own port): ``liveness`` is SERVING while the
process runs; ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (and ``""``) are
SERVING while at least one worker is eligible, NOT_SERVING otherwise (updated every health tick).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from epp.discovery import EndpointsFile, ScrapeManager
from epp.envoy import HEADER, NAMESPACE, SERVED, write_eds
from router.config import Config
from router.director import Director, route_of
from router.errors import BodyTooLarge, NoEligibleWorker
from router.policies.base import Decision, RequestInfo, pending
from router.protocol import WORKER_HEADER, BadRequest, OpenAIError
from router.scheduling import Lease
from router.state import RouterState
from router.stream_meter import StreamMeter, is_event_stream
from router.workers import WorkerHandle

if TYPE_CHECKING:
    from router.admin_store import MirrorSpec

log = logging.getLogger("dplb.epp")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: largest body chunk sent back in FULL_DUPLEX_STREAMED mode (GIE's EPP: 62,000 bytes, under
#: Envoy's 64 KiB default gRPC message budget with headroom)
CHUNK = 62_000
#: a non-streamed answer is kept up to this many bytes to read its ``usage`` (then its tail only)
ANSWER_KEEP = 1 << 20
_FULL_DUPLEX = 4   # ProcessingMode.BodySendMode.FULL_DUPLEX_STREAMED
_NONE = 0          # ProcessingMode.BodySendMode.NONE


def _hv(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _headers(msg: Any) -> dict[str, str]:
    """An ext_proc ``HttpHeaders`` message's headers, lower-case names → values (the last wins)."""
    out = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def immediate(e: OpenAIError) -> pb.ProcessingResponse:
    """An immediate response for ``e``: its status, its OpenAI-shaped body, ``content-type:
    application/json``, ``x-dplb-worker-id: none`` and its own headers (``retry-after``)."""
    hs = [_hv("content-type", "application/json"), _hv(WORKER_HEADER, "none")]
    hs += [_hv(k, v) for k, v in e.headers.items()]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=e.status), 
        headers=pb.HeaderMutation(set_headers=hs), body=e.body(), details=f"dplb_epp_{e.status}"))


#: hosts an engine may publish that Envoy's ORIGINAL_DST cannot connect to as such (it needs an
#: IP literal; an unspecified address means "this node")
_LOCAL = {"0.0.0.0": "127.0.0.1", "localhost": "127.0.0.1", "[::]": "[::1]"}


def envoy_target(endpoint: str) -> str:
    """``endpoint`` as Envoy's ORIGINAL_DST cluster connects to it: an unspecified host
    (``0.0.0.0``, ``[::]``) or ``localhost`` becomes the loopback address, anything else is kept."""
    host, sep, port = endpoint.rpartition(":")
    local = _LOCAL.get(host)
    return f"{local}:{port}" if sep and local else endpoint


def destination(endpoint: str, *fallbacks: str) -> tuple[pb.HeaderMutation, struct_pb2.Struct]:
    """The header mutation and the dynamic metadata that send a request to ``endpoint``, then, when
    Envoy retries, to each of ``fallbacks`` in turn (GIE: ``ip:port,ip:port,...``; every address
    through :func:`envoy_target`)."""
    value = ",".join(envoy_target(e) for e in (endpoint, *fallbacks))
    md = struct_pb2.Struct()
    md.update({NAMESPACE: {HEADER: value}})
    return pb.HeaderMutation(set_headers=[_hv(HEADER, value)]), md


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The address that served, as Envoy reports it with the response (``metadata_context``,
    namespace ``envoy.lb``, key ``x-gateway-destination-endpoint-served``: the pool cluster's
    ``override_host`` policy writes it, :mod:`epp.envoy`); None when absent."""
    if not req.HasField("metadata_context"):
        return None
    ns = req.metadata_context.filter_metadata.get(NAMESPACE)
    if ns is None or SERVED not in ns.fields:
        return None
    v = ns.fields[SERVED].string_value
    return v or None


class Picker:
    """The router's pipeline for ``cfg`` without its HTTP server (module docstring). ``seg``: an
    attached segment to use (a private one; None: attach ``cfg.shm_name`` and share the node's
    router lines and ledger under ``cfg.state_dir``); ``endpoints_file``: engines without agents
    to scrape into slots (:mod:`epp.discovery`); ``kube``: an :class:`epp.kube.PoolWatcher` (not
    started; :meth:`start` starts it, :meth:`stop` stops it) whose endpoints are scraped the same way."""

    def __init__(self, cfg: Config, seg: Any = None, endpoints_file: str | None = None, kube: Any = None,
                 fallbacks: int = 0, eds_path: str | None = None) -> None:
        self.state = RouterState(cfg, seg)
        #: the session header's name as the ext_proc headers carry it (lower case)
        self.session_header = cfg.routing_policy.session_header.lower()
        #: how many fallback endpoints follow the pick in the header (Envoy's pool cluster walks
        #: them on a connect failure or a reset before the response head; 0 for ORIGINAL_DST)
        self.fallbacks = fallbacks
        #: the pool cluster's EDS file, rewritten when the eligible endpoints change (:mod:`epp.envoy`)
        self.eds_path = eds_path
        self._eds: list[str] | None = None
        self._unix_only_warned = False
        self.endpoints = EndpointsFile(endpoints_file) if endpoints_file else None
        self.kube = kube
        self._file_eps: dict[str, dict[str, Any]] = {}
        self._kube_eps: dict[str, dict[str, Any]] = {}
        self.scrape: ScrapeManager | None = None
        self._unix_warned: set[int] = set()
        self.ready = False
        self.on_ready_change: Any = None

    async def start(self) -> None:
        """Start the router state (attach, registry, probes), then the endpoint scraping."""
        st = self.state
        await st.start()
        hc = st.cfg.health_check
        if self.kube is not None:
            self.kube.start()
        if self.endpoints is not None or self.kube is not None:
            self.scrape = ScrapeManager(st.seg, st.transport, st.cfg.state_dir,
                                        timeout_s=max(0.2, hc.interval_ms / 1000.0), max_failures=hc.max_failures)
            await self._discover()
            st.monitor.sync()
            st.monitor.extra.insert(0, self._discover)
        st.monitor.extra.append(self._readiness)
        await self._readiness()
        self.warn_unix_only()

    async def stop(self) -> None:
        """Give the scraped slots back, then stop the router state."""
        await self.state.monitor.stop()
        if self.kube is not None:
            await asyncio.to_thread(self.kube.stop)
        if self.scrape is not None:
            self.scrape.close()
        await self.state.stop()

    async def _discover(self) -> None:
        """Health-tick extra: take the endpoints file's and the pool's endpoints when they changed
        (the file's spec wins for an address in both), scrape every endpoint."""
        assert self.scrape is not None
        changed = False
        if self.endpoints is not None and (eps := self.endpoints.poll()) is not None:
            self._file_eps, changed = eps, True
        if self.kube is not None and (keps := self.kube.poll()) is not None:
            self._kube_eps, changed = keps, True
        if changed:
            # the endpoint specs ({"model", "weight"}) as the mirror manager reads them
            self.scrape.wanted = cast("dict[str, MirrorSpec]", {**self._kube_eps, **self._file_eps})
        await self.scrape.tick()
        self.state.registry.refresh()   # this tick's decisions see the scrape's heartbeat and counts

    async def _readiness(self) -> None:
        """Health-tick extra: readiness (the gRPC health statuses), the EDS file, the Unix-socket warning."""
        if self.eds_path is not None:
            self.write_eds()
        self.warn_unix_only()
        ready = bool(self.state.scheduler.ready_handles())
        if ready != self.ready:
            self.ready = ready
            log.info("picker %s", "ready" if ready else "not ready: no eligible worker")
            if self.on_ready_change is not None:
                await self.on_ready_change(ready)

    def write_eds(self) -> bool:
        """Write the eligible workers' TCP endpoints (as Envoy connects to them) to the EDS file
        when they changed; returns True when it wrote. An error is logged, not raised (the next
        tick tries again)."""
        assert self.eds_path is not None
        eps = sorted({envoy_target(h.endpoint) for h in self.state.scheduler.ready_handles()
                      if not h.endpoint.startswith("/")})
        if eps == self._eds:
            return False
        try:
            write_eds(self.eds_path, eps, version=str(time.time_ns()))
        except OSError as e:
            log.error("cannot write Envoy's EDS file %s: %s", self.eds_path, e)
            return False
        self._eds = eps
        log.info("Envoy pool endpoints: %s", ", ".join(eps) or "none")
        return True

    def warn_unix_only(self) -> bool:
        """Log a WARNING (once, until a TCP worker shows up) when every worker there is to pick from
        serves its engine on a Unix socket, which Envoy cannot reach: every request would be a 503.
        Returns True when it warned now."""
        handles = self.state.registry.handles
        if not handles or not all(h.endpoint.startswith("/") for h in handles.values()):
            self._unix_only_warned = False
            return False
        if self._unix_only_warned:
            return False
        self._unix_only_warned = True
        log.warning("every worker (%d) serves its engine on a Unix socket, which Envoy cannot route to: every "
                    "request will be refused with a 503. Start the agents with --engine-host 127.0.0.1 (engines on "
                    "loopback TCP), or launch with ./scripts/launch_dplb.sh --gateway envoy, which does", len(handles))
        return True

    def _unix(self) -> set[int]:
        """Workers whose engine listens on a Unix socket (Envoy cannot route there), logged once."""
        out = set()
        for wid, h in self.state.registry.handles.items():
            if h.endpoint.startswith("/"):
                out.add(wid)
                if wid not in self._unix_warned:
                    self._unix_warned.add(wid)
                    log.warning("worker %d serves its engine on a Unix socket (%s), which Envoy cannot route to: "
                                "left out (start its agent with --engine-host 127.0.0.1, or launch with --gateway envoy)", wid, h.endpoint)
        return out

    @property
    def director(self) -> Director:
        """Request control (:class:`router.director.Director`); the state must be started."""
        d = self.state.director
        assert d is not None, "the picker is not started"
        return d

    def dispatch(self, info: RequestInfo) -> tuple[WorkerHandle, Lease, list[WorkerHandle]]:
        """Choose a worker for ``info`` and take its lease (:meth:`Director.pick`, then
        :meth:`Director.lease`, the workers on Unix sockets left out); also up to :attr:`fallbacks` other
        eligible workers serving the model, least pending first (no lease, no policy state touched:
        they serve only when Envoy retries). Raises NoEligibleWorker."""
        sched = self.state.scheduler
        director = self.director
        unix = self._unix()
        try:
            h, d = director.pick(info, unix)
        except NoEligibleWorker as e:
            if unix:
                e.message += f" ({len(unix)} worker(s) on Unix sockets left out: Envoy routes to ip:port only)"
            raise
        lease = director.lease(h, d, info)
        if not self.fallbacks:
            return h, lease, []
        cands = sched.candidates(info.model, unix | {h.worker_id}, "cached")
        handles = sched.registry.handles
        alts = [handles[s.worker_id] for s in sorted(cands, key=pending)[:self.fallbacks] if s.worker_id in handles]
        return h, lease, alts

    def served_by(self, info: RequestInfo, endpoint: str) -> tuple[WorkerHandle, Lease] | None:
        """A lease on the worker at ``endpoint`` (as Envoy connects to it), which served a request
        picked for another (Envoy retried it there); None when no worker has that address."""
        for h in self.state.registry.handles.values():
            if envoy_target(h.endpoint) == endpoint:
                return h, self.director.lease(h, Decision(h.worker_id, "fallback"), info)
        return None

    def any_worker(self, path: str) -> WorkerHandle:
        """A worker for a request without a body (no lease: nothing to account). Raises
        NoEligibleWorker."""
        from router.protocol import RequestInfo

        self.state.monitor.sync_if_changed()
        h, _ = self.state.scheduler.decide(RequestInfo(path=path), self._unix())
        return h


class Exchange:
    """One request's ext_proc stream (module docstring). :meth:`on_message` answers each message
    (a list of responses, possibly empty); :meth:`close` at the stream's end, always."""

    __slots__ = ("body", "body_mode", "duplex", "fallbacks", "handle", "headers", "info", "kept", "lease", "meter",
                 "path", "picker", "resp_mode", "route", "size", "status", "streaming", "t0", "trailers", "waiting")

    def __init__(self, picker: Picker, body_mode: int, resp_mode: int = 1) -> None:
        self.picker = picker
        self.body_mode = body_mode
        #: the response body mode (``ProcessingMode.BodySendMode``: 1 STREAMED, 4 full duplex, 0 none)
        self.resp_mode = resp_mode
        self.info: RequestInfo | None = None
        #: a request admission holds back (:meth:`Director.may_dispatch` said no): ``(body,
        #: trailers)`` to dispatch once :meth:`admit` returns; the stream's driver awaits it
        self.waiting: tuple[bytes, bool] | None = None
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
        self.trailers = False

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
            if not b.end_of_stream:
                return [] if self.duplex else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
            return self._pick(b"".join(self.body))
        if kind == "request_trailers":
            out = self._pick(b"".join(self.body), trailers=True) if self.duplex and self.handle is None else []
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            self._served(req)
            return self._response_headers(req.response_headers)
        if kind == "response_body":
            return self._response_body(req.response_body)
        if kind == "response_trailers":
            self._end(True)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _request_headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = _headers(req.request_headers)
        self.path = self.headers.get(":path", "/").split("?", 1)[0]
        self.route = route_of(self.path)
        mode = self.body_mode
        if req.HasField("protocol_config"):
            mode, self.resp_mode = req.protocol_config.request_body_mode, req.protocol_config.response_body_mode
        self.duplex = mode == _FULL_DUPLEX
        if req.request_headers.end_of_stream:
            if self.headers.get(":method") == "POST":   # as the router answers it (router.protocol)
                return [self._refuse(BadRequest("request body is empty; expected a JSON object"))]
            try:
                h = self.picker.any_worker(self.path)
            except OpenAIError as e:
                return [self._refuse(e)]
            self.handle = h
            mutation, md = destination(h.endpoint)
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)), dynamic_metadata=md)]
        if self.duplex:
            return []   # answered with the body's end (the pick changes the headers)
        return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]

    def _refuse(self, e: OpenAIError) -> pb.ProcessingResponse:
        """The immediate response refusing the request with ``e``, counted (no worker chosen)."""
        self.picker.director.refused(e, self.route, self.t0)
        return immediate(e)

    def _pick(self, body: bytes, trailers: bool = False) -> list[pb.ProcessingResponse]:
        """Parse and check the request (:meth:`Director.request`), then, when admission lets it
        through at once, :meth:`_dispatch` it; else it waits (:attr:`waiting`, :meth:`admit`)."""
        p = self.picker
        director = p.director
        try:
            session = self.headers.get(p.session_header)
            info = director.request(self.path, body, session.encode("latin-1") if session else None)
        except OpenAIError as e:
            return [self._refuse(e)]
        self.streaming = info.stream
        self.info = info
        if not director.may_dispatch(info):
            self.waiting = (body, trailers)
            return []
        return self._dispatch(info, body, trailers)

    async def admit(self) -> list[pb.ProcessingResponse]:
        """The request :attr:`waiting` passes admission (:meth:`Director.admit`; the ext_proc
        stream is held meanwhile), then is dispatched: the answers that send it on, or the
        immediate response refusing it."""
        assert self.waiting is not None and self.info is not None
        (body, trailers), self.waiting = self.waiting, None
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
        mutation, md = destination(self.handle.endpoint, *(f.endpoint for f in self.fallbacks))
        if not self.duplex:
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(
                response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)), dynamic_metadata=md)]
        out = [pb.ProcessingResponse(request_headers=pb.HeadersResponse(
            response=pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)), dynamic_metadata=md)]
        n = len(body)
        for i in range(0, max(n, 1), CHUNK):
            last = i + CHUNK >= n
            out.append(pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=body[i:i + CHUNK], end_of_stream=last and not trailers))))))
        self.body = []
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

    def _response_headers(self, msg: Any) -> list[pb.ProcessingResponse]:
        hs = _headers(msg)
        try:
            self.status = int(hs.get(":status", "0"))
        except ValueError:
            self.status = 0
        h = self.handle
        if self.lease is not None:
            if 0 < self.status < 500:
                self.lease.head_seen()
            sse = is_event_stream([(b"content-type", hs.get("content-type", "").encode("latin-1"))])
            self.streaming = self.streaming or sse
            if self.resp_mode == _NONE:
                # no body comes: prefill is taken as done at the head (no TTFT learned) and the end is
                # the stream's (no token counts, no TPOT; a client that left looks complete)
                self.lease.first_token(observed=False)
            elif self.streaming:
                self.meter = StreamMeter(sse)
                self.lease.progress = self.meter.content_events   # tokens so far (the TPOT-SLO term)
        resp = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=[_hv(WORKER_HEADER, h.label if h else "none")]))))
        if msg.end_of_stream:
            self._end(True)
        return [resp]

    def _response_body(self, b: Any) -> list[pb.ProcessingResponse]:
        lease = self.lease
        if lease is not None and b.body:
            m = self.meter
            if m is not None:
                if m.feed(b.body):
                    self.picker.director.first_content(self.route, self.t0, lease)
            elif sum(len(x) for x in self.kept) < ANSWER_KEEP:
                self.kept.append(b.body)
        if b.end_of_stream:
            self._end(True)
        if self.resp_mode == _FULL_DUPLEX:   # the chunk goes on only as the picker sends it back
            return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=b.body, end_of_stream=b.end_of_stream)))))]
        return [pb.ProcessingResponse(response_body=pb.BodyResponse())]

    def _end(self, complete: bool) -> None:
        """The response ended (``complete``) or the stream did before it: release the lease once."""
        lease = self.lease
        if lease is None or lease.judged:
            return
        director = self.picker.director
        label = lease.handle.label
        if self.meter is not None:
            director.stream_end(self.meter, lease, complete)
        elif complete:
            director.answer(lease, b"".join(self.kept))
        lease.finish((0 < self.status < 500) if complete else None)
        if complete:
            director.finished(label, self.status, self.route, self.t0)
        else:
            director.client_left(label, self.route, self.t0)

    def close(self) -> None:
        """The stream ended: a lease still open is released, complete when the stream had its
        whole answer (its SSE ``data: [DONE]`` passed: the official ``openai`` client closes its
        connection there, before the engine's terminating chunk, as :func:`router.relay.delivered`
        counts it), else without a verdict (status 499)."""
        self._end(self.meter.ended_with_done() if self.meter is not None
                  else self.resp_mode == _NONE and self.status > 0)


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    """``ExternalProcessor/Process`` over a :class:`Picker`. ``body_mode``: the request body mode
    assumed when Envoy sends no ``protocol_config`` (an int of ``ProcessingMode.BodySendMode``)."""

    def __init__(self, picker: Picker, body_mode: int = 2, resp_mode: int = 1) -> None:
        self.picker = picker
        self.body_mode = body_mode
        self.resp_mode = resp_mode

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],
                      context: Any) -> AsyncIterator[pb.ProcessingResponse]:
        """One request's stream (module docstring); the lease is released in ``finally``."""
        ex = Exchange(self.picker, self.body_mode, self.resp_mode)
        try:
            async for req in request_iterator:
                out = ex.on_message(req)
                if ex.waiting is not None:   # admission holds the request: wait here, the stream held
                    out = await ex.admit()
                for resp in out:
                    yield resp
        finally:
            ex.close()


async def start_grpc(picker: Picker, host: str, port: int, health_port: int,
                     body_mode: int = 2, resp_mode: int = 1) -> tuple[grpc.aio.Server, grpc.aio.Server, Any]:
    """Start the ext_proc server on ``host:port`` and the health server on ``host:health_port``
    (0: a free port each; the bound ports are on the returned servers' ``bound_ports``
    attribute). Returns ``(ext_proc server, health server, health servicer)``; the picker's
    readiness drives the health statuses (module docstring). Raises RuntimeError when a port
    cannot be bound."""
    ext = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExtProcServicer(picker, body_mode, resp_mode), ext)
    ext_port = ext.add_insecure_port(f"{_bracket(host)}:{port}")
    hs = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, hs)
    h_port = hs.add_insecure_port(f"{_bracket(host)}:{health_port}")
    if not ext_port or not h_port:
        raise RuntimeError(f"cannot listen on {host}:{port} (ext_proc) / {host}:{health_port} (health)")
    ext.bound_ports = (ext_port, h_port)
    await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)

    async def ready(ok: bool) -> None:
        st = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("readiness", SERVICE, ""):
            await health.set(name, st)

    picker.on_ready_change = ready
    await ready(picker.ready)
    await ext.start()
    await hs.start()
    return ext, hs, health


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def start_metrics(picker: Picker, host: str, port: int) -> Any:
    """``GET /metrics`` (the router's series, :class:`router.metrics.Metrics`) on ``host:port``
    over HTTP (aiohttp). Returns the runner (``await runner.cleanup()`` stops it)."""
    from aiohttp import web

    async def metrics(_: web.Request) -> web.Response:
        body, ctype = picker.state.metrics.render()
        return web.Response(body=body, headers={"content-type": ctype})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def serve(picker: Picker, host: str, port: int, health_port: int, metrics_port: int | None,
                body_mode: int = 2, stop: asyncio.Event | None = None, resp_mode: int = 1) -> None:
    """Run the picker and its servers until ``stop`` is set (forever when None); everything is
    stopped and the picker's slots given back on the way out."""
    await picker.start()
    runner = None
    servers: tuple[Any, ...] = ()
    try:
        ext, hs, _ = await start_grpc(picker, host, port, health_port, body_mode, resp_mode)
        servers = (ext, hs)
        if metrics_port is not None:
            runner = await start_metrics(picker, host, metrics_port)
        log.warning("dplb-epp: ext_proc on %s:%d, health on %s:%d, metrics %s, policy %s, segment %s", host,
                    ext.bound_ports[0], host, ext.bound_ports[1],
                    f"on {host}:{metrics_port}" if metrics_port is not None else "off",
                    picker.state.policy.name, picker.state.seg.name)
        await (stop or asyncio.Event()).wait()
    finally:
        for s in servers:
            await s.stop(grace=1.0)
        if runner is not None:
            await runner.cleanup()
        await picker.stop()


__all__ = ["CHUNK", "SERVICE", "Exchange", "ExtProcServicer", "Picker", "destination", "envoy_target", "immediate", "serve",
           "served_endpoint",
           "start_grpc", "start_metrics"]
