"""ext_proc's one gRPC method over a minimal HTTP/2 server on the picker's own event loop.

Why not grpcio: Envoy opens one gRPC stream per HTTP request, and grpcio's servers (``grpc.aio``
and the thread-pool one alike) spend about 1.6-2 ms of CPU per stream on a busy 2-core machine
before a line of the picker runs (a servicer that answers every message with a constant: 2.0 ms
``grpc.aio``, 1.6 ms threads; 4 messages or 2 per stream cost the same): the per-call machinery
(call objects, a poller thread handing completions to the loop, tasks, futures) dwarfs the
picker's own ~100 µs. This server reads and writes the frames itself (RFC 9113), on the loop
where the picker runs, and hands each ``ProcessingRequest`` to :class:`epp.stream.Exchange`
synchronously: ``bench/results/gateway.md`` has the figures.

What it serves, and what it leaves out (it only ever talks to Envoy's gRPC client):

- every stream is ``envoy.service.ext_proc.v3.ExternalProcessor/Process``: request headers are
  not decoded (HPACK state is only needed to decode, and this server never uses the dynamic table
  when it encodes); the health service stays on grpcio (:mod:`epp.server`, its own port);
- gRPC messages uncompressed (Envoy does not compress ext_proc); one message may span DATA frames;
- flow control both ways: a 2^31-1 window advertised and topped up as data is consumed; the
  peer's windows and ``SETTINGS_MAX_FRAME_SIZE`` respected when sending (data queued until a
  ``WINDOW_UPDATE``);
- ``PING`` answered, ``PRIORITY`` and unknown frames ignored, ``RST_STREAM`` ends the exchange as
  a cancelled call does in grpcio, ``GOAWAY`` or a lost connection ends them all;
- a stream ends with trailers ``grpc-status: 0`` once Envoy half-closes it and every answer has
  left; an exception in the exchange ends it with ``grpc-status: 2`` (UNKNOWN), as grpcio does for
  a handler that raises.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

if TYPE_CHECKING:
    from epp.stream import Exchange

log = logging.getLogger("dplb.epp")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
#: the window this side advertises (connection and streams): the largest HTTP/2 allows
WINDOW = (1 << 31) - 1
#: the largest frame this side accepts (SETTINGS_MAX_FRAME_SIZE): fewer frames for long prompts
MAX_FRAME = 1 << 20
#: ``:status: 200`` (static table index 8), ``content-type: application/grpc`` (literal, not
#: indexed, name from static index 31): RFC 7541 appendix A and section 6.2.2
RESPONSE_HEAD = b"\x88\x0f\x10\x10application/grpc"


def _int(n: int, prefix: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 section 5.1) with a ``prefix``-bit prefix, OR-ed into ``first``."""
    top = (1 << prefix) - 1
    if n < top:
        return bytes((first | n,))
    out = [first | top]
    n -= top
    while n >= 128:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as a literal without indexing, new name, no Huffman (RFC 7541 section 6.2.2)."""
    return b"\x00" + _int(len(name), 7) + name + _int(len(value), 7) + value


def trailers(status: int, message: str = "") -> bytes:
    """The HPACK block of a stream's gRPC trailers (``grpc-status``, ``grpc-message`` percent-encoded)."""
    block = _literal(b"grpc-status", str(status).encode())
    if message:
        from urllib.parse import quote

        block += _literal(b"grpc-message", quote(message[:500], safe=" ").encode())
    return block


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 section 4.1)."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload


class _Stream:
    __slots__ = ("admitting", "closed", "ex", "half_closed", "head_sent", "outq", "pending", "rbuf",
                 "recv_unacked", "send_window", "sid", "trailer_block")

    def __init__(self, sid: int, ex: Exchange, send_window: int) -> None:
        self.sid = sid
        self.ex = ex
        self.rbuf = bytearray()
        self.send_window = send_window
        self.recv_unacked = 0
        self.head_sent = False
        self.half_closed = False       # Envoy sent END_STREAM
        self.closed = False
        self.admitting = False         # admission holds the request: later messages wait in pending
        self.pending: list[pb.ProcessingRequest] = []
        self.outq = bytearray()        # DATA payload waiting for window
        self.trailer_block: bytes | None = None   # trailers to send once outq is empty


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (module docstring); ``new_exchange`` makes the
    :class:`epp.stream.Exchange` of each stream."""

    def __init__(self, new_exchange: Callable[[], Exchange], conns: set[H2Connection]) -> None:
        self.new_exchange = new_exchange
        self.conns = conns
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.streams: dict[int, _Stream] = {}
        self.conn_window = 65_535            # what this side may still send on the connection
        self.peer_window = 65_535            # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.peer_frame = 16_384             # the peer's SETTINGS_MAX_FRAME_SIZE
        self.recv_unacked = 0
        self.cont_sid = 0                    # a header block continues on this stream (CONTINUATION)
        self.cont_end = False
        #: frames written while a batch of input is handled, sent in one write at its end (each
        #: loopback send wakes Envoy: one per batch, not one per frame)
        self.out: list[bytes] | None = None

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's is not an asyncio.Transport subclass
        self.conns.add(self)
        settings = (b"\x00\x04" + WINDOW.to_bytes(4, "big") + b"\x00\x05" + MAX_FRAME.to_bytes(4, "big"))
        self.transport.write(frame(SETTINGS, 0, 0, settings)
                        + frame(WINDOW_UPDATE, 0, 0, (WINDOW - 65_535).to_bytes(4, "big")))

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        for st in list(self.streams.values()):
            if not st.closed:
                st.closed = True
                self._end(st)
        self.streams.clear()

    def goaway(self) -> None:
        """Tell Envoy to open no new stream here (``GOAWAY``, no error; the last stream id it may use)."""
        if self.transport is not None and not self.transport.is_closing():
            last = max(self.streams, default=0)
            self.transport.write(frame(GOAWAY, 0, 0, last.to_bytes(4, "big") + b"\x00\x00\x00\x00"))

    def data_received(self, data: bytes) -> None:
        self.out = []
        try:
            self._received(data)
        finally:
            self._uncork()

    def _uncork(self) -> None:
        out, self.out = self.out, None
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def _received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if not self.preface:
            if len(buf) < len(PREFACE):
                return
            if bytes(buf[:len(PREFACE)]) != PREFACE:
                log.warning("ext_proc connection without the HTTP/2 preface: closed")
                assert self.transport is not None
                self.transport.close()
                return
            del buf[:len(PREFACE)]
            self.preface = True
        pos = 0
        n = len(buf)
        try:
            while n - pos >= 9:
                size = int.from_bytes(buf[pos:pos + 3], "big")
                if n - pos < 9 + size:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFF_FFFF
                payload = bytes(buf[pos + 9:pos + 9 + size])
                pos += 9 + size
                self._frame(kind, flags, sid, payload)
        finally:
            del buf[:pos]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == DATA:
            self._data(flags, sid, payload)
        elif kind == HEADERS:
            st = self.streams.get(sid)
            if st is None:
                st = self.streams[sid] = _Stream(sid, self.new_exchange(), self.peer_window)
            if not flags & END_HEADERS:
                self.cont_sid, self.cont_end = sid, bool(flags & END_STREAM)
            elif flags & END_STREAM:
                self._half_close(st)
        elif kind == CONTINUATION:
            if flags & END_HEADERS and sid == self.cont_sid:
                self.cont_sid = 0
                if self.cont_end and (st := self.streams.get(sid)) is not None:
                    self._half_close(st)
        elif kind == SETTINGS:
            if not flags & ACK:
                self._settings(payload)
        elif kind == WINDOW_UPDATE:
            inc = int.from_bytes(payload[:4], "big") & 0x7FFF_FFFF
            if sid == 0:
                self.conn_window += inc
                for st in list(self.streams.values()):
                    self._flush(st)
            elif (st := self.streams.get(sid)) is not None:
                st.send_window += inc
                self._flush(st)
        elif kind == PING:
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            st = self.streams.pop(sid, None)
            if st is not None and not st.closed:
                st.closed = True
                self._end(st)
        elif kind == GOAWAY:
            assert self.transport is not None
            self.transport.close()
        # PRIORITY, PUSH_PROMISE (never from a client) and unknown types: ignored (RFC 9113 section 4.1)

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - 5, 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == 0x4:
                delta, self.peer_window = value - self.peer_window, value
                for st in self.streams.values():
                    st.send_window += delta
            elif key == 0x5:
                self.peer_frame = value
        self._write(frame(SETTINGS, ACK, 0))

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        size = len(payload)
        self.recv_unacked += size
        if self.recv_unacked >= WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, self.recv_unacked.to_bytes(4, "big")))
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.closed:
            return
        st.recv_unacked += size
        if st.recv_unacked >= WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, sid, st.recv_unacked.to_bytes(4, "big")))
            st.recv_unacked = 0
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        rbuf = st.rbuf
        rbuf += payload
        while len(rbuf) >= 5:
            n = int.from_bytes(rbuf[1:5], "big")
            if len(rbuf) < 5 + n:
                break
            if rbuf[0]:
                self._fail(st, "compressed gRPC messages are not supported")
                return
            msg = pb.ProcessingRequest.FromString(bytes(rbuf[5:5 + n]))
            del rbuf[:5 + n]
            if st.admitting:
                st.pending.append(msg)
            else:
                self._message(st, msg)
            if st.closed:
                return
        if flags & END_STREAM:
            self._half_close(st)

    # -- a stream ----------------------------------------------------------------------------------
    def _message(self, st: _Stream, msg: pb.ProcessingRequest) -> None:
        ex = st.ex
        try:
            out = ex.on_message(msg)
        except Exception as e:
            log.exception("ext_proc stream failed")
            self._fail(st, f"{type(e).__name__}: {e}")
            return
        if ex.waiting is not None:   # admission holds the request: the stream waits, the loop does not
            st.admitting = True
            task = asyncio.get_running_loop().create_task(ex.admit())
            task.add_done_callback(functools.partial(self._admitted, st))
        self._send(st, out)

    def _admitted(self, st: _Stream, task: asyncio.Task[list[pb.ProcessingResponse]]) -> None:
        self.out = []
        try:
            self._admitted_batch(st, task)
        finally:
            self._uncork()

    def _admitted_batch(self, st: _Stream, task: asyncio.Task[list[pb.ProcessingResponse]]) -> None:
        st.admitting = False
        if st.closed:
            return
        if task.cancelled() or task.exception() is not None:
            self._fail(st, f"admission failed: {task.exception()!r}")
            return
        self._send(st, task.result())
        while st.pending and not st.admitting and not st.closed:
            self._message(st, st.pending.pop(0))
        if st.half_closed and not st.admitting:
            self._finish(st)

    def _send(self, st: _Stream, out: list[pb.ProcessingResponse]) -> None:
        if not out or st.closed:
            return
        data = b"".join(len(p).to_bytes(5, "big") + p for p in (r.SerializeToString() for r in out))
        if not st.head_sent:
            st.head_sent = True
            self._write(frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEAD))
        st.outq += data
        self._flush(st)

    def _flush(self, st: _Stream) -> None:
        """Send what ``st`` has queued as far as the windows allow; then its trailers if due."""
        q = st.outq
        while q:
            n = min(len(q), self.conn_window, st.send_window, self.peer_frame)
            if n <= 0:
                return
            self._write(frame(DATA, 0, st.sid, bytes(q[:n])))
            del q[:n]
            self.conn_window -= n
            st.send_window -= n
        if st.trailer_block is not None:
            block, st.trailer_block = st.trailer_block, None
            flags = END_STREAM | END_HEADERS
            if st.head_sent:
                self._write(frame(HEADERS, flags, st.sid, block))
            else:   # trailers-only
                self._write(frame(HEADERS, flags, st.sid, RESPONSE_HEAD + block))
            self.streams.pop(st.sid, None)

    def _half_close(self, st: _Stream) -> None:
        st.half_closed = True
        if not st.admitting:
            self._finish(st)

    def _finish(self, st: _Stream, status: int = 0, message: str = "") -> None:
        """End ``st``: the exchange is closed, trailers follow the queued answers."""
        if st.closed:
            return
        st.closed = True
        self._end(st)
        st.trailer_block = trailers(status, message)
        self._flush(st)

    def _fail(self, st: _Stream, message: str) -> None:
        st.outq.clear()
        self._finish(st, 2, message)

    def _end(self, st: _Stream) -> None:
        try:
            st.ex.close()
        except Exception:
            log.exception("closing an ext_proc exchange failed")

    def _write(self, data: bytes) -> None:
        if self.out is not None:
            self.out.append(data)
            return
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)


class H2GrpcServer:
    """The ext_proc server of :mod:`epp.h2grpc` on ``host:port`` (0: a free port).
    ``new_exchange`` makes one :class:`epp.stream.Exchange` per stream. After :meth:`start`,
    ``bound_ports`` holds the bound port first (the shape :mod:`epp.server` reports)."""

    def __init__(self, new_exchange: Callable[[], Exchange]) -> None:
        self.new_exchange = new_exchange
        self.conns: set[H2Connection] = set()
        self.server: asyncio.base_events.Server | None = None
        self.bound_ports: tuple[int, ...] = ()

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port. Raises OSError when it cannot."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: H2Connection(self.new_exchange, self.conns),
                                               host.strip("[]"), port, reuse_address=True)
        bound = self.server.sockets[0].getsockname()[1]
        self.bound_ports = (bound,)
        return bound

    async def stop(self, grace: float | None = None) -> None:
        """Stop listening, ``GOAWAY`` to every connection, wait up to ``grace`` seconds for their
        streams to end, then close them (their exchanges are closed)."""
        if self.server is not None:
            self.server.close()
        for c in list(self.conns):
            c.goaway()
        deadline = asyncio.get_running_loop().time() + (grace or 0.0)
        while any(c.streams for c in self.conns) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.conns):
            if c.transport is not None:
                c.transport.close()
        await asyncio.sleep(0)


__all__ = ["H2Connection", "H2GrpcServer", "frame", "trailers"]
