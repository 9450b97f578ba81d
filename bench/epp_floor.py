"""The cheapest ext_proc picker this machine can run: the floor under ``dplb-epp`` behind Envoy.
``python -m bench.epp_floor --port P --endpoint 127.0.0.1:W``

Every request goes to the one ``--endpoint``; nothing is parsed beyond what the protocol needs,
nothing is counted. HTTP/2 is written by hand (RFC 9113): the frames' 9-byte heads are read, the
peer's header blocks are never decoded (HPACK state is only needed to decode: this side's blocks
use no dynamic table, RFC 7541 section 6.2.2 "literal without indexing" and static-table
indices), every answer is a byte string encoded once at start-up (gRPC's 5-byte prefix, the
``ProcessingResponse``, the frames' heads and the HPACK blocks). Of each ``ProcessingRequest``
only the oneof's field number (its first byte: field numbers 2-7 come first in a serialized
message, protobuf serializes fields in field-number order) and the inner ``end_of_stream`` are
read.

It answers as ``dplb-epp`` does in its default mode (request body ``STREAMED`` sent without
waiting for the head's answer, response head and body ``STREAMED``; ``epp.stream.Exchange``): the
request head's answer (the routing header, ``clear_route_cache``) and one answer per body chunk
once the request body's end arrived; the response head's answer and one per body chunk once the
response body's end arrived (or at the head when it ends the stream), then the trailers
``grpc-status: 0``, all of one input batch in one write. Receive windows are the largest HTTP/2
allows and the connection's is replenished; ``SETTINGS`` and ``PING`` are acknowledged; a stream
Envoy resets is forgotten. Not a product: it serves ``bench.gateway --floor`` only.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import struct

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoy import HEADER

#: ``FLOOR_NO_TRAILERS=1``: no stream is ended by the picker (no trailers): Envoy resets each
#: ext_proc stream itself once its request is over, trailers or not (``bench.gateway --floor no-trailers``)
NO_TRAILERS = bool(os.environ.get("FLOOR_NO_TRAILERS"))
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WINDOW = (1 << 31) - 1
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0, 1, 3, 4, 6, 7
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
#: ProcessingRequest's oneof field numbers (external_processor.proto)
REQ_HEAD, RESP_HEAD, REQ_BODY, RESP_BODY = 2, 3, 4, 5


def frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    """One HTTP/2 frame: 24-bit length, type, flags, 31-bit stream id, payload (RFC 9113 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def _grpc(*msgs: pb.ProcessingResponse) -> bytes:
    return b"".join(b"\0" + len(b).to_bytes(4, "big") + b for b in (m.SerializeToString() for m in msgs))


def _literal(name: bytes, value: bytes) -> bytes:
    """HPACK literal header field without indexing, new name (RFC 7541 6.2.2; lengths < 127)."""
    return b"\0" + bytes((len(name),)) + name + bytes((len(value),)) + value


#: ``:status: 200`` (static index 8) and ``content-type: application/grpc`` (name: static index 31)
HEAD_BLOCK = b"\x88" + b"\x0f\x10" + bytes((len(b"application/grpc"),)) + b"application/grpc"
TRAILER_BLOCK = _literal(b"grpc-status", b"0")


class Answers:
    """The pre-encoded DATA payloads (gRPC messages) for ``endpoint``."""

    def __init__(self, endpoint: str) -> None:
        route = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=HEADER, raw_value=endpoint.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]), clear_route_cache=True)
        self.route = _grpc(pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=route)))
        self.req_body = _grpc(pb.ProcessingResponse(request_body=pb.BodyResponse()))
        self.resp_head = _grpc(pb.ProcessingResponse(response_headers=pb.HeadersResponse()))
        self.resp_body = _grpc(pb.ProcessingResponse(response_body=pb.BodyResponse()))


def _varint(b: bytes | bytearray, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, i
        shift += 7


def kind_and_end(msg: bytes | bytearray) -> tuple[int, bool]:
    """A serialized ``ProcessingRequest``'s oneof field number and its ``end_of_stream``
    (``HttpHeaders`` field 3, ``HttpBody`` field 2)."""
    kind = msg[0] >> 3
    n, i = _varint(msg, 1)
    stop = i + n
    eos_field = 3 if kind in (REQ_HEAD, RESP_HEAD) else 2
    while i < stop:
        tag, i = _varint(msg, i)
        wire = tag & 7
        if wire == 2:
            n, i = _varint(msg, i)
            i += n
        elif wire == 0:
            v, i = _varint(msg, i)
            if tag >> 3 == eos_field:
                return kind, bool(v)
        else:   # no fixed-width fields in HttpHeaders / HttpBody
            return kind, False
    return kind, False


class _Stream:
    __slots__ = ("buf", "owed", "started")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.owed = 0          # body chunks answered with their end
        self.started = False   # response HEADERS sent


class FloorConnection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (module docstring)."""

    def __init__(self, answers: Answers) -> None:
        self.a = answers
        self.inbuf = bytearray()
        self.preface = False
        self.streams: dict[int, _Stream] = {}
        self.consumed = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        settings = struct.pack(">HIHI", 0x4, WINDOW, 0x3, WINDOW)   # INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS
        transport.write(frame(SETTINGS, 0, 0, settings)  # type: ignore[attr-defined]
                        + frame(8, 0, 0, (WINDOW - 65_535).to_bytes(4, "big")))

    def data_received(self, data: bytes) -> None:
        b = self.inbuf
        b += data
        if not self.preface:
            if len(b) < len(PREFACE):
                return
            del b[:len(PREFACE)]
            self.preface = True
        out: list[bytes] = []
        i = 0
        while len(b) - i >= 9:
            n = int.from_bytes(b[i:i + 3], "big")
            if len(b) - i < 9 + n:
                break
            kind, flags = b[i + 3], b[i + 4]
            sid = int.from_bytes(b[i + 5:i + 9], "big") & 0x7FFFFFFF
            payload = b[i + 9:i + 9 + n]
            i += 9 + n
            if kind == DATA:
                self.consumed += n
                st = self.streams.get(sid)
                if st is not None:
                    self._data(sid, st, payload, out)
            elif kind == HEADERS:
                if sid not in self.streams:
                    self.streams[sid] = _Stream()
            elif kind == SETTINGS:
                if not flags & ACK:
                    out.append(frame(SETTINGS, ACK, 0, b""))
            elif kind == PING:
                if not flags & ACK:
                    out.append(frame(PING, ACK, 0, bytes(payload)))
            elif kind == RST_STREAM:
                self.streams.pop(sid, None)
            elif kind == GOAWAY:
                assert self.transport is not None
                self.transport.close()
        del b[:i]
        if self.consumed > (1 << 30):
            out.append(frame(8, 0, 0, self.consumed.to_bytes(4, "big")))
            self.consumed = 0
        if out and self.transport is not None:
            self.transport.write(b"".join(out))

    def _data(self, sid: int, st: _Stream, payload: bytearray, out: list[bytes]) -> None:
        rb = st.buf
        rb += payload
        a = self.a
        while len(rb) >= 5:
            n = int.from_bytes(rb[1:5], "big")
            if len(rb) < 5 + n:
                return
            kind, end = kind_and_end(rb[5:5 + n])
            del rb[:5 + n]
            answer = b""
            last = False
            if kind == REQ_BODY:
                st.owed += 1
                if end:
                    answer, st.owed = a.route + a.req_body * st.owed, 0
            elif kind == RESP_HEAD:
                if end:
                    answer, last = a.resp_head, True
            elif kind == RESP_BODY:
                st.owed += 1
                if end:
                    answer, st.owed, last = a.resp_head + a.resp_body * st.owed, 0, True
            elif kind == REQ_HEAD and end:   # a request without a body: routed at its head
                answer = a.route
            if answer:
                if not st.started:
                    st.started = True
                    out.append(frame(HEADERS, END_HEADERS, sid, HEAD_BLOCK))
                out.append(frame(DATA, 0, sid, answer))
            if last:
                if not NO_TRAILERS:
                    out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, TRAILER_BLOCK))
                self.streams.pop(sid, None)
                return


async def serve(host: str, port: int, endpoint: str) -> None:
    """Serve until cancelled."""
    answers = Answers(endpoint)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FloorConnection(answers), host, port, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    """Parse the flags and serve (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.epp_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--endpoint", required=True, help="ip:port every request goes to")
    a = ap.parse_args(argv)
    try:
        asyncio.run(serve(a.host, a.port, a.endpoint))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
