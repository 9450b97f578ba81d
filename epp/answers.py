"""The ext_proc answers the picker builds (:mod:`epp.stream` sends them): immediate (error)
responses, the hold while admission keeps a request waiting, the routing answer, and what Envoy
reports with the response (the address that served)."""
from __future__ import annotations

import functools

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import duration_pb2, struct_pb2

from dplb_protocol.wire import WORKER_HEADER, OpenAIError
from epp.envoy import HEADER, MAX_HOLD_S, NAMESPACE, SERVED, WORKER_KEY
from epp.picker import envoy_target
from router.config import AdmissionSection

#: seconds Envoy is asked to wait beyond the longest queue budget for a held request's answer
HOLD_MARGIN_S = 5.0
#: the most shared answers :func:`shared` keeps framed (then it starts again)
FRAMED_MAX = 4096
#: ``id(answer)`` -> (the answer, its gRPC message frame) for the answers :func:`shared` registered;
#: the answer itself is kept, so its id stays its own while the entry lives
_FRAMED: dict[int, tuple[pb.ProcessingResponse, bytes]] = {}


def grpc_frame(msg: pb.ProcessingResponse) -> bytes:
    """``msg`` as one length-prefixed gRPC message (uncompressed; "PROTOCOL-HTTP2.md" in
    grpc/grpc): kept from :func:`shared` for a shared answer, else serialized now."""
    got = _FRAMED.get(id(msg))
    if got is not None and got[0] is msg:
        return got[1]
    b = msg.SerializeToString()
    return len(b).to_bytes(5, "big") + b


def shared(msg: pb.ProcessingResponse) -> pb.ProcessingResponse:
    """Register ``msg``, an answer shared by many streams and never mutated (the unchanged-body
    answers, :func:`route_answer`, :func:`head_answer`), so that :func:`grpc_frame` serializes it
    once instead of for every stream (four answers per tiny request). Returns ``msg``."""
    if len(_FRAMED) >= FRAMED_MAX:
        _FRAMED.clear()
    b = msg.SerializeToString()
    _FRAMED[id(msg)] = (msg, len(b).to_bytes(5, "big") + b)
    return msg


def _hv(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                                      append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _headers(msg: pb.HttpHeaders) -> dict[str, str]:
    """An ext_proc ``HttpHeaders`` message's headers, lower-case names → values (the last wins)."""
    out = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def immediate(e: OpenAIError, worker: str = "none") -> pb.ProcessingResponse:
    """An immediate response for ``e``: its status, its OpenAI-shaped body, ``content-type:
    application/json``, ``x-dplb-worker-id: <worker>`` and its own headers (``retry-after``)."""
    hs = [_hv("content-type", "application/json"), _hv(WORKER_HEADER, worker)]
    hs += [_hv(k, v) for k, v in e.headers.items()]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=e.status), 
        headers=pb.HeaderMutation(set_headers=hs), body=e.body(), details=f"dplb_epp_{e.status}"))


def hold_response(adm: AdmissionSection) -> pb.ProcessingResponse:
    """The answer that asks Envoy to wait for the picker's next answer up to the longest queue
    budget of ``adm`` plus :data:`HOLD_MARGIN_S` (at most :data:`MAX_HOLD_S`), seconds, while a
    request waits in the admission queue: ext_proc's ``override_message_timeout``, honoured once
    per processing state by an Envoy whose ``max_message_timeout`` is at least that
    (:func:`epp.envoy.bootstrap_yaml` sets it; without one Envoy ignores it and answers 504 after
    ``message_timeout``)."""
    longest = max([adm.queue_budget_s, *(c.queue_budget_s for c in adm.classes.values() if c.queue_budget_s)])
    d = duration_pb2.Duration()
    d.FromMilliseconds(int(1000 * min(MAX_HOLD_S, longest + HOLD_MARGIN_S)))
    return pb.ProcessingResponse(override_message_timeout=d)


def destination(endpoint: str, *fallbacks: str) -> tuple[pb.HeaderMutation, struct_pb2.Struct]:
    """The header mutation and the dynamic metadata that send a request to ``endpoint``, then, when
    Envoy retries, to each of ``fallbacks`` in turn (GIE: ``ip:port,ip:port,...``; every address
    through :func:`envoy_target`)."""
    value = ",".join(envoy_target(e) for e in (endpoint, *fallbacks))
    md = struct_pb2.Struct()
    md.update({NAMESPACE: {HEADER: value}})
    return pb.HeaderMutation(set_headers=[_hv(HEADER, value)]), md


@functools.lru_cache(maxsize=1024)
def route_answer(endpoints: tuple[str, ...], on_body: bool, worker: str = "") -> pb.ProcessingResponse:
    """The answer that sends a request to ``endpoints[0]``, then on Envoy's retries down the rest
    (:func:`destination`; the route cache cleared so that the header counts): to the request head,
    or with ``on_body`` to the request body; ``worker``: a label also set as the dynamic metadata
    ``envoy.lb`` / ``x-dplb-worker-id`` (the observed response side's header, :mod:`epp.observe`). Cached per destination (the same few endpoints serve
    every request; building the mutation and the metadata cost ~3 % of the picker's CPU per tiny
    request, bench/results/gateway.md round 4): the message is shared, never to be mutated."""
    mutation, md = destination(*endpoints)
    if worker:
        md.fields[NAMESPACE].struct_value.fields[WORKER_KEY].string_value = worker
    common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
    if on_body:
        return shared(pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=md))
    return shared(pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=md))


def response_status(msg: pb.HttpHeaders) -> tuple[int, str]:
    """A response head's status (0 when absent or not a number) and ``content-type`` ("" when
    absent), the only two headers the picker reads there (the last of each wins, as in
    :func:`_headers`)."""
    status, ctype = "0", ""
    for h in msg.headers.headers:
        k = h.key.lower()
        if k == ":status":
            status = h.raw_value.decode("latin-1") if h.raw_value else h.value
        elif k == "content-type":
            ctype = h.raw_value.decode("latin-1") if h.raw_value else h.value
    try:
        return int(status), ctype
    except ValueError:
        return 0, ctype


#: the rest of a non-streamed answer's exchange, asked for at its head: the body in one message
#: (``BUFFERED_PARTIAL``: up to Envoy's buffer limit, 16 MiB, whatever that answer's size),
#: instead of each chunk and then an empty end of stream, each a round trip with the head held
WHOLE_ANSWER = processing_mode_pb2.ProcessingMode(
    response_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL)


@functools.lru_cache(maxsize=1024)
def head_answer(worker: str, whole: bool) -> pb.ProcessingResponse:
    """The answer to a response head: the ``x-dplb-worker-id: <worker>`` response header, and
    with ``whole`` the rest of the answer asked for in one message (:data:`WHOLE_ANSWER`, Envoy's
    ``allow_mode_override``). Cached per worker label (built per request it cost ~3 % of the
    picker's CPU per tiny request, bench/results/gateway.md round 6): shared, never to be mutated."""
    resp = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[_hv(WORKER_HEADER, worker)]))))
    if whole:
        resp.mode_override.CopyFrom(WHOLE_ANSWER)
    return shared(resp)


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


__all__ = ["HOLD_MARGIN_S", "WHOLE_ANSWER", "destination", "grpc_frame", "head_answer", "hold_response", "immediate",
           "response_status", "route_answer", "served_endpoint", "shared"]
