"""The router's HTTP/1.1 client (router/transport.py) against small servers on a Unix socket:
keep-alive reuse, chunked streams, aborts that reach the server, the two timeouts, and how
failures are classified (refused / dropped after sending; a reset or broken pipe before any byte,
"never read", is what kill -9 of a worker gives: fault scenario 1)."""
from __future__ import annotations

import asyncio
import os
from typing import ClassVar

import pytest

from router.errors import TransportError
from router.transport import Transport
from tests.helpers import FakeClient

pytestmark = pytest.mark.timeout(60)

JSON = b'{"ok":true}'


class Server(asyncio.Protocol):
    """Answers per the request path: /json (fixed body), /stream (3 chunked SSE events, 20 ms
    apart), /hang (nothing), /drop (close at once, after reading the request)."""

    conns: ClassVar[list[Server]] = []

    def connection_made(self, transport):  # type: ignore[override]
        self.t = transport
        self.buf = b""
        self.paths: list[bytes] = []
        self.closed = asyncio.get_running_loop().create_future()
        Server.conns.append(self)

    def connection_lost(self, exc):  # type: ignore[override]
        if not self.closed.done():
            self.closed.set_result(True)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            n = 0
            for line in head.split(b"\r\n")[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    n = int(v)
            self.buf = rest[n:]
            path = head.split(b" ")[1]
            self.paths.append(path)
            self.answer(path)

    def answer(self, path: bytes) -> None:
        if path == b"/json":
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: keep-alive\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(JSON), JSON))
        elif path == b"/stream":
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            loop = asyncio.get_running_loop()
            for i in range(3):
                ev = b"data: %d\n\n" % i
                loop.call_later(0.02 * (i + 1), self.t.write, b"%x\r\n%s\r\n" % (len(ev), ev))
            loop.call_later(0.1, self.t.write, b"0\r\n\r\n")
        elif path == b"/continue":   # an interim 100, then the answer in a later write
            self.t.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            asyncio.get_running_loop().call_later(0.02, self.answer, b"/json")
        elif path == b"/hints":      # an interim 103 with headers and the answer in the same write
            self.t.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>; rel=preload\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(JSON), JSON))
        elif path == b"/drop":
            self.t.close()
        elif path == b"/big":   # 64 chunks of 64 KiB written at once (4 MiB: more than a socket buffers)
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            for i in range(64):
                self.t.write(b"10000\r\n" + bytes([65 + i % 26]) * 0x10000 + b"\r\n")
            self.t.write(b"0\r\n\r\n")
        elif path == b"/ticks":  # 40 events 2 ms apart, each its own write (one chunk per read)
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            loop = asyncio.get_running_loop()
            for i in range(40):
                ev = b"data: %d\n\n" % i
                loop.call_later(0.002 * i, self.t.write, b"%x\r\n%s\r\n" % (len(ev), ev))
            loop.call_later(0.002 * 40, self.t.write, b"0\r\n\r\n")
        elif path in (b"/eof", b"/eof-204"):   # no length, no chunking: the body ends with the connection
            if path == b"/eof-204":
                self.t.write(b"HTTP/1.1 204 No Content\r\n\r\n")
                asyncio.get_running_loop().call_later(0.02, self.t.close)
                return
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 0\n\n")
            loop = asyncio.get_running_loop()
            loop.call_later(0.02, self.t.write, b"data: 1\n\n")
            loop.call_later(0.04, self.t.close)
        elif path == b"/last":   # one event, then the last event and the terminator in one write
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"9\r\ndata: 0\n\n\r\n")
            asyncio.get_running_loop().call_later(0.02, self.t.write, b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
        elif path == b"/break":  # one event, then the worker dies mid-stream
            self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"9\r\ndata: 0\n\n\r\n")
            asyncio.get_running_loop().call_later(0.05, self.t.close)


@pytest.fixture
async def server(tmp_path):
    Server.conns = []
    path = str(tmp_path / "s.sock")
    srv = await asyncio.get_running_loop().create_unix_server(Server, path)
    try:
        yield path
    finally:
        srv.close()
        for c in Server.conns:
            c.t.close()


async def test_keep_alive_reuses_one_connection(server):
    t = Transport()
    for _ in range(20):
        up = await t.send(server, "POST", "/json", [(b"content-type", b"application/json")], b"{}")
        assert up.status == 200 and not up.is_stream
        assert await up.read(await up.first_chunk()) == JSON
    assert len(Server.conns) == 1
    await asyncio.gather(*(t.get(server, "/json", 2.0) for _ in range(8)))
    assert len(Server.conns) == 8          # concurrent requests: one connection each, then pooled
    await t.close()


async def test_write_pooled_writes_at_once_on_an_idle_connection_and_send_takes_it_from_there(server):
    t = Transport()
    assert t.write_pooled(server, "POST", "/json", [], b"{}") is None    # nothing pooled yet: send connects
    up = await t.send(server, "POST", "/json", [], b"{}")
    assert await up.read(await up.first_chunk()) == JSON
    c = t.write_pooled(server, "POST", "/json", [(b"x-a", b"1")], b'{"n":2}')
    assert c is not None
    await asyncio.sleep(0.05)    # the write left before any await: the server has it without send()
    assert Server.conns[0].paths == [b"/json", b"/json"]
    up = await t.send(server, "POST", "/json", [], b"ignored: already written", written=c)
    assert up.status == 200 and await up.read(await up.first_chunk()) == JSON
    assert len(Server.conns) == 1 and len(Server.conns[0].paths) == 2   # same connection, not sent again
    await t.close()


async def test_a_whole_answer_is_handed_over_from_the_connection_callback_before_the_task_wakes(server):
    t = Transport()
    seen: list[tuple[object, bytes | None, int]] = []

    def on_whole(up) -> bool:  # type: ignore[no-untyped-def]
        seen.append((asyncio.current_task(), up.whole, up.status))
        return len(seen) == 1            # answered the first time, not the second

    up = await t.send(server, "POST", "/json", [], b"{}", on_whole=on_whole)
    assert seen == [(None, JSON, 200)]   # no task: called from the protocol's data_received
    assert up.answered and up.whole == JSON and up.status == 200 and not up.is_stream
    up = await t.send(server, "POST", "/json", [], b"{}", on_whole=on_whole)
    assert not up.answered and up.whole == JSON
    assert await up.read(up.whole) == JSON                       # the caller's own path still works

    def broken(up) -> bool:  # type: ignore[no-untyped-def]
        raise RuntimeError("bug")

    up = await t.send(server, "POST", "/json", [], b"{}", on_whole=broken)
    assert not up.answered and up.whole == JSON                  # logged; the caller answers
    up = await t.send(server, "POST", "/stream", [], b"{}", on_whole=on_whole)
    assert up.is_stream and up.whole is None and len(seen) == 2  # a stream is never handed over whole
    up.release(abort=True)
    assert len(Server.conns) == 1        # each whole answer left its connection in the pool for the next
    await t.close()


async def test_interim_answers_are_skipped_and_the_final_one_is_the_response(server):
    t = Transport()
    wholes: list[bytes | None] = []
    for path in ("/continue", "/hints"):
        for on_whole in (None, lambda u: wholes.append(u.whole) or False):
            up = await t.send(server, "POST", path, [], b"{}", on_whole=on_whole)
            assert up.status == 200 and (b"content-type", b"application/json") in up.headers
            assert all(k != b"link" for k, _ in up.headers)       # the 103's headers are not the answer's
            body = up.whole if up.whole is not None else await up.read(await up.first_chunk())
            assert body == JSON
    assert wholes == [JSON, JSON]
    assert len(Server.conns) == 1            # each connection went back to the pool after its answer
    await t.close()


async def test_stream_chunks_arrive_dechunked_and_in_order(server):
    t = Transport()
    up = await t.send(server, "POST", "/stream", [], b"{}")
    assert up.is_stream and (b"content-type", b"text/event-stream") in up.headers
    assert all(k != b"transfer-encoding" for k, _ in up.headers)   # hop-by-hop: not relayed
    got = [await up.first_chunk()]
    async for c in up.chunks():
        got.append(c)
    up.release()
    assert b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n" and len(got) == 3
    await t.close()


async def test_a_body_that_ends_with_the_connection_is_complete_and_the_connection_not_reused(server):
    """RFC 9112 §6.3: without a Content-Length or chunked framing the body runs to the connection's
    end; that end completes it (httptools alone cannot tell: it has no end-of-input call)."""
    t = Transport()
    for use in ("chunks", "pipe"):
        up = await t.send(server, "POST", "/eof", [], b"{}")
        assert up.is_stream
        got = [await up.first_chunk()]
        if use == "chunks":
            async for c in up.chunks():
                got.append(c)
        else:
            async def drain() -> None:
                return None

            await up.pipe(lambda d, got=got: got.append(d) is None, drain)
        assert up.complete() and b"".join(got) == b"data: 0\n\ndata: 1\n\n"
        up.release()
    # a 204 has no body whatever its headers say: its connection closing later is no answer's end
    up = await t.send(server, "GET", "/eof-204", [], None)
    assert up.status == 204 and await up.read(await up.first_chunk()) == b""
    assert len(Server.conns) == 3        # the two close-delimited answers' connections were not reused
    await t.close()


async def test_abort_closes_the_connection_the_server_sees_it(server):
    t = Transport()
    up = await t.send(server, "POST", "/stream", [], b"{}")
    await up.first_chunk()
    up.release(abort=True)                 # the client left mid-stream: the engine must stop
    await asyncio.wait_for(Server.conns[0].closed, 5)
    await t.close()


async def test_timeouts_first_byte_then_idle(server):
    t = Transport(first_byte_timeout_s=0.2, idle_timeout_s=0.01)
    with pytest.raises(TransportError) as ei:
        await t.send(server, "POST", "/hang", [], b"{}")
    assert ei.value.kind == "timeout"
    await asyncio.wait_for(Server.conns[0].closed, 5)   # a timed-out request's connection is closed
    up = await t.send(server, "POST", "/stream", [], b"{}")
    await up.first_chunk()
    with pytest.raises(TransportError) as ei:      # 20 ms between events > 10 ms idle timeout
        await up.first_chunk()
    assert ei.value.kind == "timeout"
    up.release()
    await t.close()


async def test_failures_are_classified(server, tmp_path):
    t = Transport()
    with pytest.raises(TransportError) as ei:
        await t.send(str(tmp_path / "nobody.sock"), "POST", "/json", [], b"{}")
    assert ei.value.kind == "connect" and ei.value.refused and ei.value.unsent
    with pytest.raises(TransportError) as ei:
        await t.send(server, "POST", "/drop", [], b"{}")     # closed after reading: maybe began the work
    assert ei.value.kind == "connect" and not ei.value.refused and not ei.value.unsent
    await t.close()
    assert not os.path.exists(str(tmp_path / "nobody.sock"))


async def test_pipe_hands_the_chunks_to_the_sink_from_the_connection_callback_and_keeps_the_connection(server):
    t = Transport()
    up = await t.send(server, "POST", "/stream", [], b"{}")
    got = [await up.first_chunk()]
    tasks = []

    def sink(data: bytes) -> bool:
        got.append(data)
        tasks.append(asyncio.current_task())   # None: called from data_received, not by a woken task
        return True

    async def drain() -> None:
        raise AssertionError("the sink never asked to wait")

    await up.pipe(sink, drain)
    assert up.complete()
    up.release()
    assert b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert tasks == [None, None]
    up = await t.send(server, "POST", "/json", [], b"{}")   # the connection went back to the pool
    assert await up.read(await up.first_chunk()) == JSON and len(Server.conns) == 1
    await t.close()


async def test_the_endpoint_remembers_when_a_relayed_stream_last_sent_a_chunk(server):
    """Liveness evidence for the health monitor: the chunks of a stream being piped, not a plain
    answer (its head is reported by the lease) and not a probe's answer."""
    import time

    t = Transport()
    assert t.last_rx(server) == 0.0
    await t.get(server, "/json", 2.0)
    assert t.last_rx(server) == 0.0
    up = await t.send(server, "POST", "/stream", [], b"{}")
    await up.first_chunk()
    t0 = time.monotonic()

    async def drain() -> None:
        return None

    await up.pipe(lambda d: True, drain)
    up.release()
    assert t0 <= t.last_rx(server) <= time.monotonic()
    await t.close()


async def test_pipe_stops_reading_while_the_sink_is_full_and_loses_nothing(server):
    t = Transport()
    up = await t.send(server, "POST", "/big", [], b"{}")
    got = [await up.first_chunk()]
    full = asyncio.Event()
    calls_while_full = []

    def sink(data: bytes) -> bool:
        if full.is_set():
            calls_while_full.append(len(data))
        got.append(data)
        if len(got) == 2:
            full.set()
            return False     # the client's buffer is over its mark
        return True

    async def drain() -> None:
        await asyncio.sleep(0.2)                       # the engine keeps writing meanwhile
        assert not up._conn.transport.is_reading()     # ...but nothing is read from it
        assert calls_while_full == []
        full.clear()

    await asyncio.wait_for(up.pipe(sink, drain), 10)
    up.release()
    body = b"".join(got)
    assert len(body) == 64 * 0x10000
    assert body == b"".join(bytes([65 + i % 26]) * 0x10000 for i in range(64))
    await t.close()


async def test_a_connection_released_while_its_reading_was_paused_reads_the_next_answer(server):
    # the client takes the last chunk with its buffer over the mark, then leaves during drain()
    # (the openai client closes at [DONE]): the proxy releases the stream as complete. The pooled
    # connection's reading was paused for that client; the next request on it must still get its
    # answer (it hung until the first-byte timeout: issue 27's bench regression)
    t = Transport()
    up = await t.send(server, "POST", "/last", [], b"{}")
    first = await up.first_chunk()
    assert first == b"data: 0\n\n"

    def sink(data: bytes) -> bool:
        assert data == b"data: [DONE]\n\n" and up.complete()
        return False                  # the client's buffer is over its mark at the body's end

    async def drain() -> None:
        assert not up._conn.transport.is_reading()
        raise ConnectionResetError("the client left")

    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(up.pipe(sink, drain), 10)
    conn = up._conn
    up.release()                      # complete: the whole body was delivered
    assert len(Server.conns) == 1
    up2 = await asyncio.wait_for(t.send(server, "POST", "/json", [], b"{}"), 5)
    assert up2._conn is conn          # the same connection was reused...
    assert (up2.status, await asyncio.wait_for(up2.read(), 5)) == (200, JSON)   # ...and read
    up2.release()
    await t.close()


async def test_pipe_raises_on_a_stalled_or_broken_stream(server):
    t = Transport(idle_timeout_s=0.01)
    up = await t.send(server, "POST", "/stream", [], b"{}")
    await up.first_chunk()
    with pytest.raises(TransportError) as ei:       # 20 ms between events > 10 ms idle timeout
        await up.pipe(lambda d: True, asyncio.sleep)
    assert ei.value.kind == "timeout"
    up.release()
    t = Transport()
    up = await t.send(server, "POST", "/break", [], b"{}")
    assert await up.first_chunk() == b"data: 0\n\n"
    with pytest.raises(TransportError) as ei:
        await up.pipe(lambda d: True, asyncio.sleep)
    assert ei.value.kind == "stream_broken" and not up.complete()
    up.release()
    await t.close()


async def test_the_native_relay_takes_over_at_a_chunk_boundary_and_pauses_for_a_full_client(server):
    from router._relay import ChunkRelay

    t = Transport()
    up = await t.send(server, "POST", "/ticks", [], b"{}")
    first = await up.first_chunk()
    client = FakeClient()
    sunk: list[bytes] = []
    relays: list[ChunkRelay] = []

    def sink(data: bytes) -> bool:
        sunk.append(data)
        return True

    def handoff() -> ChunkRelay:
        r = ChunkRelay(client.write, client, client)
        relays.append(r)
        return r

    drains = 0

    async def drain() -> None:
        nonlocal drains
        drains += 1
        await asyncio.sleep(0.05)
        assert not up._conn.transport.is_reading()     # nothing read from the engine meanwhile
        client.write_paused = False

    orig = client.write

    def write(b: bytes) -> None:   # the client's buffer fills at the first write
        orig(b)
        if len(client.out) == 1:
            client.write_paused = True

    client.write = write  # type: ignore[method-assign]
    await asyncio.wait_for(up.pipe(sink, drain, handoff), 10)
    assert up.complete() and len(relays) == 1 and relays[0].done and drains >= 1
    up.release()
    body = first + b"".join(sunk) + client.body()
    assert body == b"".join(b"data: %d\n\n" % i for i in range(40))
    assert relays[0].events == client.body().count(b"\n\n") >= 1
    assert relays[0].relayed == len(client.body()) > 0
    up = await t.send(server, "POST", "/json", [], b"{}")   # the relayed connection was reused
    assert await up.read(await up.first_chunk()) == JSON and len(Server.conns) == 1
    await t.close()


async def test_the_native_relay_reports_a_worker_that_died_mid_stream(server):
    from router._relay import ChunkRelay

    t = Transport()
    up = await t.send(server, "POST", "/break", [], b"{}")
    assert await up.first_chunk() == b"data: 0\n\n"
    client = FakeClient()
    relays: list[ChunkRelay] = []

    def handoff() -> ChunkRelay:
        relays.append(ChunkRelay(client.write, client, client))
        return relays[-1]

    with pytest.raises(TransportError) as ei:
        await up.pipe(lambda d: True, asyncio.sleep, handoff)
    assert ei.value.kind == "stream_broken" and not up.complete() and len(relays) == 1
    up.release()
    await t.close()


async def _relay_reads_bypass_the_connection(path: str) -> None:
    """A /ticks stream through the native relay: while the relay has the body the transport's
    reads go to it through the connection's RelayProtocol (not the connection's data_received),
    which keeps the endpoint's liveness time current; the protocol stays on the transport (no
    set_protocol per body: the event loop would stop and restart reading); at the body's end the
    reads go to the connection again, which reads the next answer on it."""
    import time

    from router._relay import ChunkRelay, RelayProtocol

    t = Transport()
    up = await t.send(path, "POST", "/ticks", [], b"{}")
    first = await up.first_chunk()
    conn = up._conn
    client = FakeClient()
    seen: list[object] = []

    def handoff() -> ChunkRelay:
        return ChunkRelay(client.write, client, client)

    orig = client.write

    def write(b: bytes) -> None:   # what protocol the transport has while the relay writes
        p = conn.transport.get_protocol()
        seen.append((p, isinstance(p, RelayProtocol) and p.relaying))
        orig(b)

    client.write = write  # type: ignore[method-assign]
    await asyncio.wait_for(up.pipe(lambda d: True, asyncio.sleep, handoff), 10)
    t_end = time.monotonic()
    assert up.complete() and len(seen) >= 2
    assert all(p is conn.proto and relaying for p, relaying in seen)
    assert conn.transport.get_protocol() is conn.proto and not conn.proto.relaying
    assert t_end - 0.05 <= t.last_rx(path) <= t_end    # the relay's reads moved the liveness time
    body = first + client.body()
    assert body.count(b"data: ") <= 40 and body.endswith(b"data: 39\n\n")
    up.release()
    up = await t.send(path, "POST", "/json", [], b"{}")    # the same connection, its parser again
    assert await up.read(await up.first_chunk()) == JSON and len(Server.conns) == 1
    up.release()
    await t.close()


async def test_the_native_relay_reads_the_engine_without_the_connections_callback(server):
    await _relay_reads_bypass_the_connection(server)


def test_the_native_relay_reads_the_engine_without_the_connections_callback_on_uvloop(tmp_path):
    # the router's own loop (router/__main__.py runs uvloop): its transports' set_protocol
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        Server.conns = []
        path = str(tmp_path / "u.sock")
        srv = await asyncio.get_running_loop().create_unix_server(Server, path)
        try:
            await _relay_reads_bypass_the_connection(path)
        finally:
            srv.close()
            for c in Server.conns:
                c.t.close()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
