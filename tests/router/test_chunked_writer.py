"""The router's uvicorn protocol lends a streamed response's chunks a way around ASGI ``send``
(router/server.py ``chunked_writer``): real uvicorn protocol on a Unix socket, raw HTTP clients.
The framing must be what uvicorn writes (keep-alive survives), a response with a Content-Length
(no chunked framing) gets no writer, and a writer whose client left says so instead of writing.
The same protocol tells a request that its client left (``watch_disconnect``) with one callback."""
from __future__ import annotations

import asyncio

import pytest
import uvicorn
from uvicorn.server import ServerState

from router.server import (
    ClientGone,
    LimitedHttpToolsProtocol,
    chunked_writer,
    watch_disconnect,
)

pytestmark = pytest.mark.timeout(60)


class App:
    """``/stream`` (``/sized``: with a Content-Length): head and b"first" through ``send``, b"a"
    and b"bb" through the writer when there is one, then the end through ``send``. ``/wait``: head and b"first", then waits for the
    client to leave and tries the writer."""

    def __init__(self) -> None:
        self.writers: list[bool] = []
        self.after_leave: list[object] = []
        self.gone: list[str] = []

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
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
    cfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="off", log_level="warning")
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
        w.write(b"POST /stream HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        raw = await read_until(r, b"0\r\n\r\n")
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head
        assert dechunk(body) == (b"firstabb", b"")
    assert app.writers == [True, True]
    w.close()


async def test_a_response_with_a_content_length_gets_no_writer_and_still_the_whole_body(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(b"POST /sized HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    raw = await read_until(r, b"firstabb")
    assert b"content-length: 8\r\n" in raw and b"transfer-encoding" not in raw
    assert app.writers == [False]
    w.close()


async def test_a_writer_whose_client_left_writes_nothing_and_its_drain_raises_client_gone(served):
    app, path = served
    r, w = await asyncio.open_unix_connection(path)
    w.write(b"POST /wait HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
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
    w.write(b"POST /unwatch HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    await read_until(r, b"ok")
    w.write(b"POST /watch HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    await asyncio.sleep(0.1)
    assert app.gone == []             # the answered request's callback was withdrawn; this one waits
    w.close()
    for _ in range(200):
        if app.gone:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    assert app.gone == ["/watch"]     # once, for the request still running when the client left
