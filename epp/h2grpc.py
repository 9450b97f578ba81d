"""ext_proc's one gRPC method over HTTP/2 on the picker's own event loop, with the ``h2`` library.

Why not grpcio: Envoy opens one gRPC stream per HTTP request, and grpcio's servers (``grpc.aio``
and the thread-pool one alike) spend about 1.6-2 ms of CPU per stream on a busy 2-core machine
before a line of the picker runs (a servicer that answers every message with a constant: 2.0 ms
``grpc.aio``, 1.6 ms threads; 4 messages or 2 per stream cost the same): the per-call machinery
(call objects, a poller thread handing completions to the loop, tasks, futures) dwarfs the
picker's own ~100 µs. Here the HTTP/2 protocol (framing, HPACK, settings, flow control, ``PING``,
``RST_STREAM``, ``GOAWAY``: RFC 9113 and RFC 7541) is python-hyper's ``h2``, a sans-I/O state
machine fed from an :class:`asyncio.Protocol` on the loop where the picker runs; this module adds
only gRPC's length-prefixed messages (the gRPC over HTTP/2 spec, "PROTOCOL-HTTP2.md" in grpc/grpc)
and hands each ``ProcessingRequest`` to :class:`epp.stream.Exchange` synchronously.
``bench/results/gateway.md`` has the figures.

What it serves (it only ever talks to Envoy's gRPC client):

- every stream is ``envoy.service.ext_proc.v3.ExternalProcessor/Process``; the health service
  stays on grpcio (:mod:`epp.server`, its own port);
- gRPC messages uncompressed (Envoy does not compress ext_proc); one message may span DATA frames;
- a large receive window (2^31-1) advertised and replenished as data is consumed, so Envoy never
  waits on the picker; the peer's windows respected when sending (data queued until they open);
- a stream ends with trailers ``grpc-status: 0`` once Envoy half-closes it and every answer has
  left; an exception in the exchange ends it with ``grpc-status: 2`` (UNKNOWN), as grpcio does for
  a handler that raises; ``RST_STREAM`` ends the exchange as a cancelled call does in grpcio,
  ``GOAWAY``, a protocol error or a lost connection end them all.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast
from urllib.parse import quote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
import hpack.table
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.answers import grpc_frame

if TYPE_CHECKING:
    from epp.stream import Exchange

log = logging.getLogger("dplb.epp")

#: the receive window this side advertises (connection and streams): the largest HTTP/2 allows
WINDOW = (1 << 31) - 1
#: the largest frame this side accepts (SETTINGS_MAX_FRAME_SIZE): fewer frames for long prompts
MAX_FRAME = 1 << 20
#: ``h2``'s configuration for this server: the header checks are off, Envoy's gRPC client is the
#: only peer and the request headers are never read (every stream is the one method)
CONFIG = h2.config.H2Configuration(client_side=False, header_encoding=None,
                                   validate_inbound_headers=False, normalize_inbound_headers=False,
                                   validate_outbound_headers=False, normalize_outbound_headers=False)
RESPONSE_HEAD = [(b":status", b"200"), (b"content-type", b"application/grpc")]
#: the gRPC request header that marks an observed response side's streams (epp.envoy.SIDE_KEY)
SIDE = b"x-dplb-side"


def _frame_name(obj: object) -> str:
    """What ``h2.connection`` gets for ``repr(obj)``: the class name only (see below)."""
    return type(obj).__name__


# h2 (4.x) formats every received frame for its trace log before calling the logger, which is a
# no-op unless one is configured: ``logger.trace("Received frame: %s", repr(frame))`` in
# ``H2Connection._receive_frame``, 2-4 % of the picker's CPU per tiny request (hyperframe's
# ``__repr__`` renders the flags and the payload; bench/results/gateway.md, round 4). That call is
# ``h2.connection``'s only use of the builtin ``repr``: a module-level name shadows it there with
# the frame's class name. No other module's ``repr`` changes.
h2.connection.repr = _frame_name  # type: ignore[attr-defined]


#: the trailers of a stream that ended well (``grpc-status: 0``), alone and as a trailers-only answer
OK_TRAILERS = [(b"grpc-status", b"0")]


def _plain_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """``headers`` as an HPACK block that leaves the peer's dynamic table as it is (RFC 7541:
    static-table references and literals "never indexed", 6.2.3), encoded by ``hpack`` itself."""
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])


#: the picker's fixed header lists and their blocks (:class:`FixedBlocks`), encoded once
FIXED_BLOCKS = {tuple(h): _plain_block(h) for h in (RESPONSE_HEAD, OK_TRAILERS, RESPONSE_HEAD + OK_TRAILERS)}


class FixedBlocks:
    """``h2``'s HPACK encoder with the picker's fixed header lists (the answer's head, the trailers
    of a stream that ended well: two per stream) taken from :data:`FIXED_BLOCKS` instead of encoded
    again: about 40 % of ``send_headers``' cost per tiny request (``python -m bench.epp_feed
    --profile``; bench/results/gateway.md round 6). Those blocks do not touch the dynamic table, so
    the encoder's own blocks (every other header list) stay valid for the peer; while a table size
    change is pending (it must lead the next block, RFC 7541 4.2) the encoder encodes everything."""

    __slots__ = ("inner",)

    def __init__(self, inner: hpack.Encoder) -> None:
        self.inner = inner

    @property
    def header_table_size(self) -> int:
        """The encoder's table size (``h2`` sets it from the peer's ``SETTINGS_HEADER_TABLE_SIZE``)."""
        return self.inner.header_table_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self.inner.header_table_size = value

    def encode(self, headers: list[tuple[bytes, bytes]], huffman: bool = True) -> bytes:
        """The HPACK block of ``headers`` (a list of ``(name, value)`` byte pairs, as ``h2`` passes them)."""
        if not self.inner.table_size_changes:
            block = FIXED_BLOCKS.get(tuple(headers))
            if block is not None:
                return block
        return self.inner.encode(headers, huffman)


class CountingTable(hpack.table.HeaderTable):
    """``hpack``'s dynamic table that counts its changes (an entry added, the size changed) in
    :attr:`generation`: a header block decoded while the count stayed the same left the table as it
    was, and decodes to the same list for as long as it stays so (:class:`CachedDecoder`)."""

    def __init__(self) -> None:
        super().__init__()
        self.generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, newmax: int) -> None:
        self.generation += 1
        hpack.table.HeaderTable.maxsize.fset(self, newmax)  # type: ignore[attr-defined]


#: the most header blocks :class:`CachedDecoder` keeps (then it starts again)
DECODED_MAX = 64


class CachedDecoder:
    """``h2``'s HPACK decoder with the header blocks that leave the dynamic table as it is kept
    decoded: Envoy's gRPC client sends the same block at the head of every ext_proc stream
    (indexed fields and ``:path`` as a Huffman-coded literal without indexing, RFC 7541 6.1 and
    6.2.2), whose decoding in pure Python was about 9 % of the picker's CPU per tiny request
    (``python -m bench.epp_feed --profile``; bench/results/gateway.md round 7). A block's list is
    reused only while the table (:class:`CountingTable`) and the decoder's limits have not changed
    since it was decoded, which is when decoding it again gives the same list; every other block
    is decoded by ``hpack`` itself, errors included."""

    __slots__ = ("decoded", "inner", "table")

    def __init__(self, inner: hpack.Decoder) -> None:
        self.inner = inner
        self.table = inner.header_table = CountingTable()
        #: ``(block, raw)`` -> (the table's generation then, the header list)
        self.decoded: dict[tuple[bytes, bool], tuple[int, tuple[hpack.HeaderTuple, ...]]] = {}

    @property
    def header_table_size(self) -> int:
        """The dynamic table's size (``hpack``'s property)."""
        return self.inner.header_table_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self.inner.header_table_size = value

    @property
    def max_header_list_size(self) -> int:
        """The largest decoded header list accepted (``h2`` sets it from its settings)."""
        return self.inner.max_header_list_size

    @max_header_list_size.setter
    def max_header_list_size(self, value: int) -> None:
        self.table.generation += 1   # a kept list was checked against the old limit
        self.inner.max_header_list_size = value

    @property
    def max_allowed_table_size(self) -> int:
        """The largest table size the peer may set (``h2`` sets it from its acknowledged settings)."""
        return self.inner.max_allowed_table_size

    @max_allowed_table_size.setter
    def max_allowed_table_size(self, value: int) -> None:
        self.table.generation += 1
        self.inner.max_allowed_table_size = value

    def decode(self, data: bytes, raw: bool = False) -> list[hpack.HeaderTuple]:
        """The header list of the HPACK block ``data`` (as ``hpack.Decoder.decode``; raises its errors)."""
        key = (bytes(data), raw)
        gen = self.table.generation
        got = self.decoded.get(key)
        if got is not None and got[0] == gen:
            return list(got[1])
        headers = list(self.inner.decode(data, raw))
        if self.table.generation == gen:   # the block left the table as it was
            if len(self.decoded) >= DECODED_MAX:
                self.decoded.clear()
            self.decoded[key] = (gen, tuple(headers))
        return headers


def trailers(status: int, message: str = "") -> list[tuple[bytes, bytes]]:
    """A stream's gRPC trailers: ``grpc-status``, and ``grpc-message`` percent-encoded (at most 500
    characters) when ``message`` is given."""
    if status == 0 and not message:
        return OK_TRAILERS
    out = [(b"grpc-status", str(status).encode())]
    if message:
        out.append((b"grpc-message", quote(message[:500], safe=" ").encode()))
    return out


class _Stream:
    __slots__ = ("admitting", "answered", "closed", "ex", "half_closed", "head_sent", "outq", "pending", "rbuf",
                 "sid", "trailer_block")

    def __init__(self, sid: int, ex: Exchange) -> None:
        self.sid = sid
        self.ex = ex
        self.rbuf = bytearray()
        self.head_sent = False
        self.half_closed = False       # Envoy sent END_STREAM
        self.closed = False
        self.answered = False          # the exchange gave its last answer; no trailers sent yet
        self.admitting = False         # admission holds the request: later messages wait in pending
        self.pending: list[pb.ProcessingRequest] = []
        self.outq = bytearray()        # DATA payload waiting for the peer's window
        self.trailer_block: list[tuple[bytes, bytes]] | None = None   # sent once outq is empty


class ExtProcConnection(asyncio.Protocol):
    """One HTTP/2 connection from Envoy (module docstring), driven through ``h2``;
    ``new_exchange`` makes the :class:`epp.stream.Exchange` of each stream."""

    def __init__(self, new_exchange: Callable[[str | None], Exchange], conns: set[ExtProcConnection]) -> None:
        #: makes a stream's exchange from its gRPC request header ``x-dplb-side`` (None without:
        #: :func:`epp.observe.new_exchange`)
        self.new_exchange = new_exchange
        self.conns = conns
        self.transport: asyncio.Transport | None = None
        self.h2 = h2.connection.H2Connection(config=CONFIG)
        self.h2.encoder = FixedBlocks(self.h2.encoder)  # type: ignore[assignment]
        self.h2.decoder = CachedDecoder(self.h2.decoder)  # type: ignore[assignment]
        self.streams: dict[int, _Stream] = {}
        #: bytes received per stream in this input batch, acknowledged once at its end (:meth:`_data`)
        self.unacked: dict[int, int] = {}

    # -- connection ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # uvloop's is not an asyncio.Transport subclass
        self.conns.add(self)
        conn = self.h2
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 2 ** 31 - 1})
        # settings given as initial values are in force at once (h2 applies later changes on their
        # ACK): the frame-size limit h2 read from its defaults follows them here
        conn.max_inbound_frame_size = MAX_FRAME
        conn.incoming_buffer.max_frame_size = MAX_FRAME
        conn.initiate_connection()
        conn.increment_flow_control_window(WINDOW - 65_535)
        self._uncork()

    def connection_lost(self, exc: Exception | None) -> None:
        self.conns.discard(self)
        for st in list(self.streams.values()):
            if not st.closed:
                st.closed = True
                self._end(st)
        self.streams.clear()

    def goaway(self) -> None:
        """Tell Envoy to open no new stream here (``GOAWAY``, no error)."""
        if self.transport is not None and not self.transport.is_closing():
            self.h2.close_connection(last_stream_id=max(self.streams, default=0))
            self._uncork()

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            log.warning("ext_proc connection closed on an HTTP/2 protocol error: %s", e)
            self._uncork()
            assert self.transport is not None
            self.transport.close()
            return
        for ev in events:
            self._event(ev)
        if self.unacked:   # one acknowledgement per stream and batch: h2 replenishes both windows
            for sid, n in self.unacked.items():
                self.h2.acknowledge_received_data(n, sid)
            self.unacked.clear()
        self._uncork()

    def _uncork(self) -> None:
        """Write what ``h2`` has queued, in one write (each loopback send wakes Envoy)."""
        out = self.h2.data_to_send()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out)

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.DataReceived):
            self._data(ev)
        elif isinstance(ev, h2.events.RequestReceived):
            side = next((v.decode() for k, v in ev.headers if k == SIDE), None)
            self.streams[ev.stream_id] = _Stream(ev.stream_id, self.new_exchange(side))
        elif isinstance(ev, h2.events.StreamEnded):
            if (st := self.streams.get(ev.stream_id)) is not None:
                self._half_close(st)
        elif isinstance(ev, h2.events.WindowUpdated):
            targets = list(self.streams.values()) if ev.stream_id == 0 else (
                [st] if (st := self.streams.get(ev.stream_id)) is not None else [])
            for st in targets:
                self._flush(st)
        elif isinstance(ev, h2.events.RemoteSettingsChanged):
            for st in list(self.streams.values()):
                self._flush(st)
        elif isinstance(ev, h2.events.StreamReset):
            st = self.streams.pop(ev.stream_id, None)
            if st is not None and not st.closed:
                st.closed = True
                self._end(st)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            assert self.transport is not None
            self.transport.close()
        # settings ACKs, PING answers: h2 queues them itself; priority and the rest: nothing to do

    def _data(self, ev: h2.events.DataReceived) -> None:
        sid = ev.stream_id
        # the bytes count as consumed at once (parsed below), acknowledged at the batch's end
        self.unacked[sid] = self.unacked.get(sid, 0) + ev.flow_controlled_length
        st = self.streams.get(sid)
        if st is None or st.closed:
            return
        rbuf = st.rbuf
        rbuf += ev.data
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
        if ex.done and not st.admitting:
            self._answered(st)   # the answer was the last: the exchange ends with it

    def _admitted(self, st: _Stream, task: asyncio.Task[list[pb.ProcessingResponse]]) -> None:
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
        if st.ex.done:
            self._answered(st)
            return
        while st.pending and not st.admitting and not st.closed:
            self._message(st, st.pending.pop(0))
        if st.half_closed and not st.admitting:
            self._finish(st)

    def _send(self, st: _Stream, out: list[pb.ProcessingResponse]) -> None:
        if not out or st.closed:
            return
        st.outq += b"".join(map(grpc_frame, out))
        self._flush(st)

    def _flush(self, st: _Stream) -> None:
        """Send what ``st`` has queued as far as the peer's windows allow; then its trailers if due."""
        conn = self.h2
        try:
            if st.outq and not st.head_sent:
                st.head_sent = True
                conn.send_headers(st.sid, RESPONSE_HEAD)
            q = st.outq
            while q:
                n = min(len(q), conn.local_flow_control_window(st.sid), conn.max_outbound_frame_size)
                if n <= 0:
                    return
                conn.send_data(st.sid, bytes(q[:n]))
                del q[:n]
            if st.trailer_block is not None:
                block, st.trailer_block = st.trailer_block, None
                conn.send_headers(st.sid, block if st.head_sent else RESPONSE_HEAD + block,
                                  end_stream=True)   # else: trailers-only
                self.streams.pop(st.sid, None)
        except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
            # Envoy reset or closed the stream meanwhile: nothing more can be sent on it
            st.outq.clear()
            st.trailer_block = None
            self.streams.pop(st.sid, None)

    def _half_close(self, st: _Stream) -> None:
        st.half_closed = True
        if st.answered:   # Envoy ended its side instead of resetting the stream: the trailers now
            st.answered = False
            st.trailer_block = OK_TRAILERS
            self._flush(st)
        elif not st.admitting:
            self._finish(st)

    def _answered(self, st: _Stream) -> None:
        """The exchange gave its last answer: it is closed now, and the stream stays open until
        Envoy ends it. Envoy (1.40) resets every ext_proc stream itself once its request is over,
        also one the picker ended with trailers (traced, bench/results/gateway.md round 6): trailers
        sent with the last answer were read by nobody and cost an HPACK block and a HEADERS frame
        per request on both sides. They go only if Envoy half-closes instead (:meth:`_half_close`)."""
        if st.closed:
            return
        st.closed = st.answered = True
        self._end(st)

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


class H2GrpcServer:
    """The ext_proc server of :mod:`epp.h2grpc` on ``host:port`` (0: a free port).
    ``new_exchange`` makes one :class:`epp.stream.Exchange` per stream, from the stream's
    ``x-dplb-side`` gRPC request header (:func:`epp.observe.new_exchange`). After :meth:`start`,
    ``bound_ports`` holds the bound port first (the shape :mod:`epp.server` reports)."""

    def __init__(self, new_exchange: Callable[[str | None], Exchange]) -> None:
        self.new_exchange = new_exchange
        self.conns: set[ExtProcConnection] = set()
        self.server: asyncio.base_events.Server | None = None
        self.bound_ports: tuple[int, ...] = ()

    async def start(self, host: str, port: int) -> int:
        """Listen; returns the bound port. Raises OSError when it cannot."""
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: ExtProcConnection(self.new_exchange, self.conns),
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


__all__ = ["FIXED_BLOCKS", "OK_TRAILERS", "CachedDecoder", "CountingTable", "ExtProcConnection", "FixedBlocks", "H2GrpcServer", "trailers"]
