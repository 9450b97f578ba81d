"""bench.epp_floor: the hand-written ext_proc floor answers what Envoy sends, decodable by a real
HTTP/2 client (python-hyper's ``h2``: HPACK blocks, frames, trailers)."""
from __future__ import annotations

import h2.config
import h2.connection
import h2.events
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from bench.epp_feed import _grpc, batches
from bench.epp_floor import (
    REQ_BODY,
    REQ_HEAD,
    RESP_BODY,
    RESP_HEAD,
    Answers,
    FloorConnection,
    kind_and_end,
)
from epp.envoy import HEADER


def test_kind_and_end_reads_the_oneof_and_end_of_stream() -> None:
    head = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=True))
    head.protocol_config.request_body_mode = 1   # a field after the oneof
    assert kind_and_end(head.SerializeToString()) == (REQ_HEAD, True)
    # a body whose own bytes end like an end_of_stream field
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"x\x10\x01"))
    assert kind_and_end(body.SerializeToString()) == (REQ_BODY, False)
    body.request_body.end_of_stream = True
    assert kind_and_end(body.SerializeToString()) == (REQ_BODY, True)
    assert kind_and_end(pb.ProcessingRequest(response_headers=pb.HttpHeaders()).SerializeToString()) == (RESP_HEAD, False)
    long_body = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"y" * 1000, end_of_stream=True))
    assert kind_and_end(long_body.SerializeToString()) == (RESP_BODY, True)


class _Sink:
    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, b: bytes) -> None:
        self.out += b


def _messages(data: bytes) -> list[pb.ProcessingResponse]:
    out = []
    while data:
        n = int.from_bytes(data[1:5], "big")
        out.append(pb.ProcessingResponse.FromString(data[5:5 + n]))
        data = data[5 + n:]
    return out


def test_one_request_is_routed_and_its_stream_ended() -> None:
    conn, sink = FloorConnection(Answers("127.0.0.1:7")), _Sink()
    conn.connection_made(sink)   # type: ignore[arg-type]
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    conn.data_received(client.data_to_send())
    client.receive_data(bytes(sink.out))
    sink.out.clear()
    received = bytearray()
    events: list[h2.events.Event] = []
    for _ in range(2):   # two requests on the connection: the second stream's blocks decode too
        sid = client.get_next_available_stream_id()
        client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "epp"),
                                  (":path", "/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                                  ("content-type", "application/grpc")])
        request, response = batches(True)
        for batch in (request, response):
            client.send_data(sid, b"".join(_grpc(m) for m in batch))
            conn.data_received(client.data_to_send())
            evs = client.receive_data(bytes(sink.out))
            sink.out.clear()
            events += evs
            received += b"".join(e.data for e in evs if isinstance(e, h2.events.DataReceived) and e.stream_id == sid)
        answers = _messages(bytes(received))
        received.clear()
        assert [a.WhichOneof("response") for a in answers] == [
            "request_headers", "request_body", "request_body", "response_headers", "response_body", "response_body"]
        hv = answers[0].request_headers.response.header_mutation.set_headers[0].header
        assert (hv.key, hv.raw_value) == (HEADER, b"127.0.0.1:7")
        assert answers[0].request_headers.response.clear_route_cache
        heads = [e for e in events if isinstance(e, h2.events.ResponseReceived) and e.stream_id == sid]
        assert heads and dict(heads[0].headers)[":status"] == "200"
        assert dict(heads[0].headers)["content-type"] == "application/grpc"
        trailers = [e for e in events if isinstance(e, h2.events.TrailersReceived) and e.stream_id == sid]
        assert trailers and dict(trailers[0].headers)["grpc-status"] == "0"
        assert any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in events)
        assert sid not in conn.streams
