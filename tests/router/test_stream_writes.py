"""A streamed answer costs the router one client write per engine read: the response head leaves
with the stream's first chunk (router/server.py ``start_chunked``), and the body's end leaves with
its last bytes, from the native relay, from the Python sink or with the first chunk
(``ChunkRelay(end=True)``, ``ChunkedWriter.write(end=True)``), or with an SSE error event
(``ChunkedWriter.finish``). Before, the head and the terminating chunk were two more writes, each
waking the client (``bench/results/router_profile.md`` section 10).

Driven by hand: the real router app and its real transport, the real uvicorn protocol on a
recording client transport, and an engine stand-in on a Unix socket in the same event loop that
writes its answer in scripted pieces, a few milliseconds apart (one router read each)."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import pytest

from tests.helpers import RecordingTransport, in_process_router

pytestmark = pytest.mark.timeout(60)

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":4,"stream":true}'
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(BODY)) + BODY
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
DONE = b"data: [DONE]\n\n"
END = b"0\r\n\r\n"


def content(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"delta":{"content":"t%d"}}]}\n\n' % i


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def dechunk(raw: bytes) -> tuple[bytes, int]:
    """(payload, number of terminating chunks seen, 1 when the body ended exactly once)."""
    out, ends = b"", 0
    while raw:
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert raw.startswith(b"\r\n")
            raw = raw[2:]
            ends += 1
            continue
        out += raw[:n]
        assert raw[n:n + 2] == b"\r\n"
        raw = raw[n + 2:]
    return out, ends


class ScriptedEngine:
    """Answers each request with ``script``: byte strings written one by one, ``gap_s`` apart;
    None in the script closes the connection there."""

    def __init__(self, script: list[bytes | None], gap_s: float = 0.01) -> None:
        self.script = script
        self.gap_s = gap_s
        self.requests = 0

    async def serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            head = await r.readuntil(b"\r\n\r\n")
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await r.readexactly(n)
            self.requests += 1
            for piece in self.script:
                if piece is None:
                    break
                w.write(piece)
                await w.drain()
                await asyncio.sleep(self.gap_s)
        finally:
            w.close()


@pytest.fixture
def stream_router(loop):
    """run(script) -> the client's writes for one streamed request through the real app."""
    d = tempfile.mkdtemp(prefix="dplb-sw-", dir="/tmp")
    path = os.path.join(d, "e.sock")
    server = None
    try:
        with in_process_router(loop, path) as (_app, _seg, make):
            engines: list[ScriptedEngine] = []

            async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
                await engines[-1].serve(r, w)

            server = loop.run_until_complete(asyncio.start_unix_server(serve, path))

            def run(script: list[bytes | None]) -> list[bytes]:
                engines.append(ScriptedEngine(script))
                c = RecordingTransport()
                proto = make(c)
                proto.data_received(REQUEST)

                async def until_done() -> None:
                    for _ in range(500):
                        if proto.cycle is not None and proto.cycle.response_complete:
                            return
                        await asyncio.sleep(0.01)
                    raise AssertionError(f"the response did not complete; written: {c.writes!r}")

                loop.run_until_complete(until_done())
                loop.run_until_complete(asyncio.sleep(0.05))   # nothing more may follow
                assert engines[-1].requests == 1
                proto.connection_lost(None)
                return list(c.writes)

            yield run
    finally:
        if server is not None:
            server.close()
            loop.run_until_complete(server.wait_closed())
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("end_apart", [False, True], ids=["end-with-last-event", "end-in-its-own-read"])
def test_one_client_write_per_engine_read_head_with_the_first_chunk_end_with_the_last(stream_router, end_apart):
    events = [ROLE, content(1), content(2), content(3), content(4), DONE]
    body = [chunk(e) for e in events]
    script: list[bytes | None] = [HEAD, *body[:-1], body[-1] + END] if not end_apart else [HEAD, *body, END]
    writes = stream_router(script)
    # the head waits for the first body bytes (it always did) and leaves with them
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked\r\n" in writes[0]
    first = writes[0].partition(b"\r\n\r\n")[2]
    assert dechunk(first) == (ROLE, 0)
    # one write per engine read after the head: no separate terminating chunk
    assert len(writes) == len(script) - 1
    assert writes[-1].endswith(END)
    payload, ends = dechunk(b"".join(writes).partition(b"\r\n\r\n")[2])
    assert payload == b"".join(events) and ends == 1


def test_a_stream_whole_in_its_first_read_is_one_client_write(stream_router):
    events = [ROLE, content(1), DONE]
    writes = stream_router([HEAD + b"".join(chunk(e) for e in events) + END])
    assert len(writes) == 1
    payload, ends = dechunk(writes[0].partition(b"\r\n\r\n")[2])
    assert payload == b"".join(events) and ends == 1


def test_a_stream_that_breaks_ends_with_its_error_event_and_the_end_in_one_write(stream_router):
    writes = stream_router([HEAD, chunk(ROLE), chunk(content(1)), chunk(content(2)), None])
    assert len(writes) == 4
    last, ends = dechunk(writes[-1])
    assert ends == 1 and last.startswith(b"data: ") and b'"upstream_error"' in last
    payload, ends = dechunk(b"".join(writes).partition(b"\r\n\r\n")[2])
    assert payload.startswith(ROLE + content(1) + content(2)) and ends == 1


def test_a_stream_that_ends_with_its_connection_is_complete_not_broken(stream_router):
    """No Content-Length and no chunked framing (an HTTP/1.0-style server): the engine closing the
    connection ends the body (RFC 9112 §6.3); the client gets it re-framed and ended, no error."""
    writes = stream_router([b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + ROLE,
                            content(1), content(2) + DONE, None])
    payload, ends = dechunk(b"".join(writes).partition(b"\r\n\r\n")[2])
    assert payload == ROLE + content(1) + content(2) + DONE and ends == 1
    assert b"upstream_error" not in b"".join(writes)
