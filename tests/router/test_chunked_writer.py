"""The router's uvicorn protocol lends a streamed response's chunks a way around ASGI ``send``
(router/server.py ``chunked_writer``): real uvicorn protocol on a Unix socket, raw HTTP clients.
The framing must be what uvicorn writes (keep-alive survives), a response with a Content-Length
(no chunked framing) gets no writer, and a writer whose client left says so instead of writing.
The same protocol tells a request that its client left (``watch_disconnect``) with one callback,
and writes a whole non-streamed response in one write (``write_response``) with uvicorn's
keep-alive and pipelining bookkeeping intact; a streamed response's head leaves with its first
chunk (``start_chunked``) and ``finish`` ends it as uvicorn's ``send`` would."""
from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.server import ServerState

from router.server import (
    ClientGone,
    LimitedHttpToolsProtocol,
    chunked_writer,
    start_chunked,
    watch_disconnect,
    write_response,
)
from tests.helpers import RecordingTransport

pytestmark = pytest.mark.timeout(60)


class App:
    """``/stream`` (``/sized``: with a Content-Length): head and b"first" through ``send``, b"a"
    and b"bb" through the writer when there is one, then the end through ``send``. ``/wait``: head and b"first", then waits for the
    client to leave and tries the writer."""

    def __init__(self) -> None:
        self.writers: list[bool] = []
        self.after_leave: list[object] = []
        self.gone: list[str] = []
        self.whole: list[bool] = []

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["path"].startswith("/whole"):
            body = b'{"n":%d}' % len(self.whole)
            if scope["path"] == "/whole-started":   # a response already started: the caller must use send
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
                self.whole.append(write_response(scope, 200, [], b"no"))
                await send({"type": "http.response.body", "body": b"ok"})
                return
            self.whole.append(write_response(scope, 201, [(b"content-type", b"application/json")], body))
            return
        if scope["path"] in ("/watch", "/unwatch"):
            left = asyncio.Event()
            unwatch = watch_disconnect(scope, lambda: (self.gone.append(scope["path"]), left.set()))
            assert unwatch is not None
            if scope["path"] == "/watch":
                await left.wait()
                return
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            unwatch()
            return
        hs = [(b"content-type", b"text/event-stream")]
        if scope["path"] == "/sized":
            hs.append((b"content-length", b"8"))
        await send({"type": "http.response.start", "status": 200, "headers": hs})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        w = chunked_writer(scope)
        self.writers.append(w is not None)
        if scope["path"] == "/wait":
            assert w is not None
            while (await receive())["type"] != "http.disconnect":
                pass
            self.after_leave.append(w.write(b"lost"))
            try:
                await w.drain()
            except ClientGone as e:
                self.after_leave.append(e)
            return
        for part in (b"a", b"bb"):
            if w is not None:
                assert w.write(part) is True
            else:
                await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture
async def served(tmp_path):
    app = App()
    cfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="off", log_level="warning", access_log=False)
    cfg.load()
    state = ServerState()
    path = str(tmp_path / "r.sock")
    srv = await asyncio.get_running_loop().create_unix_server(
        lambda: LimitedHttpToolsProtocol(config=cfg, server_state=state, app_state={}), path)
    try:
        yield app, path
    finally:
        srv.close()
        for c in list(state.connections):
            c.shutdown()


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """(body, what follows the terminating chunk) of a chunked HTTP/1.1 body."""
    out = b""
    while True:
        size, _, raw = raw.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            assert raw.startswith(b"\r\n")
            return out, raw[2:]
        out += raw[:n]
        assert raw[n:n + 2] == b"\r\n"
        raw = raw[n + 2:]


def post(target: str, extra: bytes = b"") -> bytes:
    """A bodiless POST request to ``target`` (``extra``: more header lines, CRLF-terminated)."""
    return b"POST " + target.encode() + b" HTTP/1.1\r\nhost: x\r\n" + extra + b"content-length: 0\r\n\r\n"


async def read_until(r: asyncio.StreamReader, end: bytes) -> bytes:
    buf = b""
    while not buf.endswith(end):
        chunk = await r.read(65536)
        assert chunk, buf
        buf += chunk
    return buf


async def test_chunks_written_past_send_are_framed_as_uvicorn_frames_them_and_keep_alive_holds(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    for _ in range(2):   # the second request on the same connection: the response ended cleanly
        w.write(post("/stream"))
        raw = await read_until(r, b"0\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head
        assert dechunk(body) == (b"firstabb", b"")
    assert app.writers == [True, True]
    w.close()


async def test_a_response_with_a_content_length_gets_no_writer_and_still_the_whole_body(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(post("/sized"))
    raw = await read_until(r, b"firstabb")
    assert b"content-length: 8\r\n" in raw and b"transfer-encoding" not in raw
    assert app.writers == [False]
    w.close()


async def test_a_writer_whose_client_left_writes_nothing_and_its_drain_raises_client_gone(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(post("/wait"))
    await read_until(r, b"first\r\n")
    w.close()
    for _ in range(200):
        if len(app.after_leave) == 2:
            break
        await asyncio.sleep(0.02)
    assert app.after_leave[0] is False and isinstance(app.after_leave[1], ClientGone)


async def test_the_protocol_calls_back_when_the_client_leaves_and_not_after_unwatch(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(post("/unwatch"))
    await read_until(r, b"ok")
    w.write(post("/watch"))
    await asyncio.sleep(0.1)
    assert app.gone == []             # the answered request's callback was withdrawn; this one waits
    w.close()
    for _ in range(200):
        if app.gone:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    assert app.gone == ["/watch"]     # once, for the request still running when the client left


async def test_a_whole_response_is_one_write_and_pipelined_requests_after_it_are_served(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    # three requests in one write: each next one starts only once the previous response ended
    w.write(post("/whole") * 3)
    raw = await read_until(r, b'{"n":2}')
    answers = raw.split(b"HTTP/1.1 ")[1:]
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"201 Created"] * 3
    for i, a in enumerate(answers):
        head, _, body = a.partition(b"\r\n\r\n")
        assert body == b'{"n":%d}' % i
        assert head.count(b"content-length: ") == 1 and b"content-length: %d" % len(body) in head
        assert b"content-type: application/json" in head and b"transfer-encoding" not in head
    assert app.whole == [True, True, True]
    w.close()


async def test_a_whole_response_to_a_connection_close_request_closes_the_connection(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(post("/whole", b"connection: close\r\n"))
    raw = await asyncio.wait_for(r.read(), 10)     # to EOF: the router closed its side
    assert raw.startswith(b"HTTP/1.1 201 ") and b"connection: close\r\n" in raw and raw.endswith(b'{"n":0}')
    assert app.whole == [True]
    w.close()


async def test_write_response_declines_a_started_response_and_a_scope_of_another_server(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(post("/whole-started"))
    raw = await read_until(r, b"ok")
    assert b"no" not in raw.partition(b"\r\n\r\n")[2]
    assert app.whole == [False]
    assert write_response({"type": "http", "headers": []}, 200, [], b"x") is False
    w.close()


def in_process(app, loop: asyncio.AbstractEventLoop, transport: RecordingTransport) -> LimitedHttpToolsProtocol:  # type: ignore[no-untyped-def]
    """The router's protocol serving ``app`` on ``transport``, driven by hand on ``loop``."""
    cfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="off", log_level="warning", access_log=False)
    cfg.load()
    proto = LimitedHttpToolsProtocol(config=cfg, server_state=ServerState(), app_state={}, _loop=loop)
    proto.connection_made(transport)
    return proto


def test_the_whole_response_leaves_the_protocol_in_one_transport_write():
    """uvicorn's own send writes the head and the body separately."""
    loop = asyncio.new_event_loop()
    t = RecordingTransport()

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        assert write_response(scope, 200, [(b"x-a", b"1")], b"hello")

    try:
        proto = in_process(app, loop, t)
        proto.data_received(post("/x"))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert t.writes == [b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 5\r\n\r\nhello"]
        proto.connection_lost(None)
    finally:
        loop.close()


def test_a_client_that_is_not_reading_gets_no_whole_response_write():
    """Above the transport's high-water mark the answer goes through ``send``, which waits for the
    client to drain before starting the next pipelined request: memory stays bounded."""
    loop = asyncio.new_event_loop()
    results: list[bool] = []
    t = RecordingTransport()

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        ok = write_response(scope, 200, [], b"hello")
        results.append(ok)
        if not ok:   # what the proxy does then
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
            await send({"type": "http.response.body", "body": b"hello"})

    try:
        proto = in_process(app, loop, t)
        proto.pause_writing()      # what the transport calls above its high-water mark
        proto.data_received(post("/x"))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert results == [False] and t.writes == []        # waiting for the client to read
        proto.resume_writing()
        loop.run_until_complete(asyncio.sleep(0.05))
        assert b"".join(t.writes).endswith(b"\r\n\r\nhello")
        proto.connection_lost(None)
    finally:
        loop.close()


def test_a_client_leaving_with_a_pipelined_request_queued_ends_the_running_one_quietly():
    """uvicorn marks only its newest cycle disconnected; the running request's must be too, or
    uvicorn answers it a 500 on the closed connection and logs an error for every such client."""
    import logging

    loop = asyncio.new_event_loop()
    t = RecordingTransport()
    records: list[logging.LogRecord] = []
    app = App()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(level=logging.ERROR)
    logging.getLogger("uvicorn.error").addHandler(keep)
    try:
        proto = in_process(app, loop, t)
        proto.data_received(post("/watch") + post("/whole"))
        loop.run_until_complete(asyncio.sleep(0.05))
        proto.connection_lost(ConnectionResetError(104, "reset by peer"))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert app.gone == ["/watch"]
        assert [r.getMessage() for r in records] == [] and t.writes == []   # no 500, nothing logged
        assert app.whole == []                                              # the queued one never ran
    finally:
        logging.getLogger("uvicorn.error").removeHandler(keep)
        loop.close()


def test_start_chunked_writes_head_and_first_chunk_at_once_and_finish_serves_the_next_request():
    """The head and the first chunk in one write; after ``finish`` the pipelined request runs."""
    loop = asyncio.new_event_loop()
    t = RecordingTransport()
    seen: list[str] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        seen.append(scope["path"])
        if scope["path"] == "/next":
            assert write_response(scope, 200, [], b"next")
            return
        w = start_chunked(scope, 200, [(b"content-type", b"text/event-stream")], b"first")
        assert w is not None and t.writes[-1].endswith(b"5\r\nfirst\r\n")
        assert w.write(b"ab") is True
        if scope["path"] == "/e":   # the body's end with its last bytes, then nothing more
            assert w.write(b"cd", True) is True and w.write(b"late") is True and w.write(b"x", True) is True
            await w.finish()
            return
        await w.finish(b"err")

    try:
        proto = in_process(app, loop, t)
        proto.data_received(post("/s") + post("/next"))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert seen == ["/s", "/next"]
        assert t.writes[0] == (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                               b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        assert t.writes[1:3] == [b"2\r\nab\r\n", b"3\r\nerr\r\n0\r\n\r\n"]
        assert t.writes[3].endswith(b"\r\n\r\nnext")
        proto.connection_lost(None)
        t.writes.clear()
        proto = in_process(app, loop, t)
        proto.data_received(post("/e") + post("/next"))
        loop.run_until_complete(asyncio.sleep(0.05))
        assert t.writes[1:3] == [b"2\r\nab\r\n", b"2\r\ncd\r\n0\r\n\r\n"]
        assert t.writes[3].endswith(b"\r\n\r\nnext") and len(t.writes) == 4
        proto.connection_lost(None)
    finally:
        loop.close()


@pytest.mark.parametrize("case", ["content-length", "head", "paused", "started"])
def test_start_chunked_declines_what_send_must_frame_and_writes_nothing(case):
    loop = asyncio.new_event_loop()
    t = RecordingTransport()
    got: list[object] = []

    async def app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        hs = [(b"content-length", b"2")] if case == "content-length" else []
        if case == "started":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        before = len(t.writes)
        got.append(start_chunked(scope, 200, hs, b"ok"))
        got.append(len(t.writes) - before)

    try:
        proto = in_process(app, loop, t)
        if case == "paused":
            proto.pause_writing()
        req = post("/x")
        if case == "head":
            req = req.replace(b"POST ", b"HEAD ", 1)
        proto.data_received(req)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert got == [None, 0]
        proto.connection_lost(None)
    finally:
        loop.close()
