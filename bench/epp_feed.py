"""The picker's own CPU per tiny request, without Envoy, sockets or the machine's other load:
``python -m bench.epp_feed [--requests 3000] [--mode eager|buffered] [--profile]``

An ``h2`` client plays Envoy's side of ext_proc for ``--requests`` tiny non-streamed chat requests
(the messages Envoy 1.40 sends per request, each in its own DATA frame after a gRPC head whose
``:path`` is a literal that is not indexed, the stream reset by Envoy once answered: ``eager`` =
request body ``STREAMED`` without waiting for the head's answer, head + body chunk + empty end in
one write, then the answer's head + body + end in one write; ``buffered`` = four exchanges: head, whole body, answer head, whole answer;
``observe`` = eager's request on one stream, reset once answered, and the observer filter's request
head, answer head, body and end on a second, :mod:`epp.observe`); its
bytes are recorded once, then fed again into a fresh :class:`epp.h2grpc.ExtProcConnection` over a
real :class:`epp.picker.Picker` (one ready worker in a fresh segment) and the process CPU time of
that replay is divided by the requests. Only the picker runs during the replay (HTTP/2 with ``h2``,
the messages, the decision, the lease); no system calls, so it is a floor under what the picker
costs behind a real Envoy (``bench.gateway``). ``--profile``: cProfile of the replay, 30 costliest
functions by own time.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

if TYPE_CHECKING:
    from epp.picker import Picker

BODY = (b'{"model":"bench","messages":[{"role":"user","content":"Say hello in one word, please."}],'
        b'"max_tokens":8}')
ANSWER = (b'{"id":"x","object":"chat.completion","model":"bench","choices":[{"index":0,"message":{"role":'
          b'"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,'
          b'"completion_tokens":1,"total_tokens":10}}')
#: the gRPC request head Envoy's client sends for each ext_proc stream
#: (``:path`` as a literal that is not indexed, as Envoy 1.40 sends it: decoded every time)
GRPC_HEAD = [(":method", "POST"), (":scheme", "http"),
             hpack.NeverIndexedHeaderTuple(":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
             (":authority", "epp"), ("content-type", "application/grpc"), ("te", "trailers"),
             ("grpc-timeout", "300000m"), ("x-envoy-internal", "true"), ("x-forwarded-for", "127.0.0.1")]
WINDOW = 268_435_456   # Envoy's default HTTP/2 windows (256 MiB)


def _headers(d: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in d.items()])


def _grpc(m: pb.ProcessingRequest) -> bytes:
    b = m.SerializeToString()
    return b"\0" + len(b).to_bytes(4, "big") + b


def batches(eager: bool) -> list[list[pb.ProcessingRequest]]:
    """The messages of one request, grouped as Envoy writes them (module docstring)."""
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers({
        ":authority": "bench", ":path": "/v1/chat/completions", ":method": "POST", ":scheme": "http",
        "content-type": "application/json", "content-length": str(len(BODY)), "x-forwarded-proto": "http",
        "x-request-id": str(uuid.uuid4())})))
    head.protocol_config.request_body_mode = 1 if eager else 2
    head.protocol_config.response_body_mode = 1
    head.protocol_config.send_body_without_waiting_for_header_response = eager
    answer_head = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers({
        ":status": "200", "content-type": "application/json", "date": "Mon, 07 Dec 2026 09:00:00 GMT",
        "server": "envoy", "x-envoy-upstream-service-time": "1"})))
    if eager:
        return [[head, pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY)),
                 pb.ProcessingRequest(request_body=pb.HttpBody(end_of_stream=True))],
                [answer_head, pb.ProcessingRequest(response_body=pb.HttpBody(body=ANSWER)),
                 pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))]]
    return [[head], [pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))], [answer_head],
            [pb.ProcessingRequest(response_body=pb.HttpBody(body=ANSWER, end_of_stream=True))]]


class _Sink:
    """A transport that keeps what the server writes."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, b: bytes) -> None:
        self.out.append(bytes(b))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def take(self) -> bytes:
        data, self.out = b"".join(self.out), []
        return data


def observed(token: str) -> list[list[pb.ProcessingRequest]]:
    """The observer filter's messages of one request (``--mode observe``, :mod:`epp.observe`): the
    request head with the lease's ``token``, then the answer's head, body and end, as Envoy writes them."""
    # the headers Envoy forwards to the observer (epp.envoy.OBSERVED_HEADERS)
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers({"x-dplb-lease": token})))
    answer_head = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers({
        ":status": "200", "content-type": "application/json"})))
    return [[head], [answer_head, *batches(True)[1][1:]]]


def one_request(client: h2.connection.H2Connection, feed: Callable[[bytes], None], picker: Picker, eager: bool,
                observe: bool) -> None:
    """Envoy's side of one request through ``client`` (each write handed to ``feed``): its stream
    (module docstring); ``observe``: the first filter's, reset once answered, then the observer's."""
    msgs = batches(eager)
    if observe:   # the first filter's stream: the request only, reset by Envoy once it went upstream
        msgs[0][0].protocol_config.response_body_mode = 0
        msgs = msgs[:1]
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, GRPC_HEAD + ([("x-dplb-side", "request")] if observe else []))
    for batch in msgs:   # each message its own DATA frame, as Envoy sends them
        for m in batch:
            client.send_data(sid, _grpc(m))
        feed(client.data_to_send())
    if observe:
        client.reset_stream(sid)
        feed(client.data_to_send())
        token = next(reversed(picker.handoffs.open))
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, GRPC_HEAD + [("x-dplb-side", "response")])
        for batch in observed(token):
            for m in batch:
                client.send_data(sid, _grpc(m))
            feed(client.data_to_send())
    if not client.streams[sid].closed:   # Envoy resets the stream once the request is over
        client.reset_stream(sid)
        feed(client.data_to_send())


async def run(requests: int, eager: bool, profile: bool, observe: bool = False) -> float:
    """CPU µs of the picker per request (module docstring)."""
    import cProfile
    import pstats

    from dplb_shm import Segment
    from epp.h2grpc import ExtProcConnection
    from epp.handoff import Handoffs
    from epp.observe import new_exchange
    from epp.picker import Picker
    from router.config import Config

    name = f"dplb-feed-{uuid.uuid4().hex[:8]}"
    seg = Segment.create(name, num_slots=8)
    w = seg.writer(0)
    w.claim(worker_id=0, pid=os.getpid(), endpoint="127.0.0.1:9", model="bench")
    w.publish(state=2)
    w.heartbeat()
    cfg = Config.model_validate({"health_check": {"enabled": False},
                                 "router": {"state_dir": os.path.join(tempfile.mkdtemp(prefix="dplb-feed-"), "st")}})
    picker = Picker(cfg, seg)
    await picker.start()
    mode = 1 if eager else 2
    try:
        def server() -> tuple[ExtProcConnection, _Sink]:
            conn, sink = ExtProcConnection(lambda side: new_exchange(picker, mode, 1, side), set()), _Sink()
            conn.connection_made(sink)   # type: ignore[arg-type]
            return conn, sink

        conn, sink = server()
        client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        client.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        client.initiate_connection()
        client.increment_flow_control_window(WINDOW - 65_535)
        record = [client.data_to_send()]

        def feed(data: bytes) -> None:
            record.append(data)
            conn.data_received(data)
            for ev in client.receive_data(sink.take()):
                if isinstance(ev, h2.events.DataReceived) and ev.stream_id in client.streams:
                    client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)

        conn.data_received(record[0])
        client.receive_data(sink.take())
        replica = picker.handoffs.replica
        for _ in range(requests):
            one_request(client, feed, picker, eager, observe)
            w.heartbeat()
        picker.handoffs = Handoffs()   # the replay hands off under the recorded tokens
        picker.handoffs.replica = replica
        replay, sink2 = server()
        prof = cProfile.Profile() if profile else None
        t0 = time.process_time()
        if prof:
            prof.enable()
        for data in record:
            replay.data_received(data)
            sink2.out.clear()
        if prof:
            prof.disable()
        cpu = time.process_time() - t0
        if prof:
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        assert seg.router_line(0)["router_inflight"] == 0, "a lease was left open"
        return 1e6 * cpu / requests
    finally:
        await picker.stop()
        w.release()
        seg.close()
        os.unlink(f"/dev/shm/{name}")


def main(argv: list[str] | None = None) -> int:
    """Print the picker's CPU per tiny request (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.epp_feed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--mode", choices=["eager", "buffered", "observe"], action="append",
                    help="the request body mode Envoy uses (repeatable; default: eager and buffered); observe: "
                         "eager with the response side on a second, observing stream (epp.observe)")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)
    for mode in a.mode or ["eager", "buffered"]:
        us = asyncio.run(run(a.requests, mode != "buffered", a.profile, mode == "observe"))
        print(f"{mode:<9} picker CPU per tiny request {us:6.0f} µs ({a.requests} requests fed in-process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
