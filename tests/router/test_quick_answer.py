"""A request written to a pooled connection from the protocol's callback is served without a task
when the engine's whole answer is the plain outcome (router/quick.py ``QuickAnswer``), and by its
task, from that moment on, for anything else: a status retried on another worker, a stream, a
client that leaves (499), the first-byte deadline (504), an engine that closes the connection
(retried), the stop's drain limit (503 ``drain_cut``). The real router app and protocol, driven
by hand, in front of a scripted engine on loopback TCP served by the same event loop."""
from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest

from dplb_shm import WorkerState
from router.server import LaterTask
from tests.helpers import RecordingTransport, in_process_router

pytestmark = pytest.mark.timeout(60)

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":4}'
ANSWER = b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(BODY), BODY))


def whole(status: int, body: bytes = ANSWER) -> bytes:
    reason = {200: b"OK", 429: b"Too Many Requests"}.get(status, b"X")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (status, reason, len(body), body))


STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
          b"%x\r\n%s\r\n0\r\n\r\n" % (len(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'),
                                      b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\ndata: [DONE]\n\n'))


class ScriptedEngine:
    """An HTTP/1.1 engine on loopback: answers each request with the next step of ``script``, then
    with a whole 200. A step: bytes (``whole(...)``, ``STREAM``: written at once), a list of bytes
    (written apart, 50 ms between them), ``("cut", bytes)`` (written, then the connection closed),
    "hang" (nothing until the router closes the connection), "close" (the connection closed).
    ``requests``: how many it read; ``closed``: connections it saw end."""

    def __init__(self) -> None:
        self.script: list[object] = []
        self.requests = 0
        self.closed = 0
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                         if line.lower().startswith(b"content-length:"))
                await r.readexactly(n)
                self.requests += 1
                step = self.script.pop(0) if self.script else whole(200)
                if step == "close":
                    break
                if step == "hang":
                    await r.read()      # until the router closes the connection
                    break
                if isinstance(step, tuple):
                    w.write(step[1])
                    await w.drain()
                    break
                for i, part in enumerate(step if isinstance(step, list) else [step]):
                    if i:
                        await asyncio.sleep(0.05)
                    w.write(part)
                    await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            w.close()


@pytest.fixture
def rig(loop):
    yield from warmed_router(loop, ScriptedEngine())


def warmed_router(loop, engine):  # type: ignore[no-untyped-def]
    """Yields (make a client protocol, engine, app): the router with two ready workers (slots 0
    and 1) at the same scripted ``engine``, its pool warmed (one request answered through the task
    path); then stops the engine and waits until the router's pool closed its connections."""
    port = loop.run_until_complete(engine.start())
    with in_process_router(loop, f"127.0.0.1:{port}") as (app, seg, make):
        w = seg.writer(1)
        w.claim(worker_id=1, pid=0, endpoint=f"127.0.0.1:{port}", model="m", max_num_seqs=64)
        w.set_state(WorkerState.READY)
        w.heartbeat()
        app.state.registry.refresh_if_changed()
        c = RecordingTransport()
        proto = make(c)
        proto.data_received(REQUEST)             # connects: the task path
        settle(loop, lambda: c.writes)
        assert b"".join(c.writes).endswith(ANSWER)
        proto.connection_lost(None)
        yield make, engine, app
    assert engine.server is not None
    engine.server.close()
    settle(loop, lambda: engine.closed >= engine.connections)   # the router's pool closed with it


def settle(loop: asyncio.AbstractEventLoop, done, limit_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    """Run ``loop`` until ``done()`` is true (a condition, not a time bound)."""
    async def wait() -> None:
        while not done():
            await asyncio.sleep(0.005)
    loop.run_until_complete(asyncio.wait_for(wait(), limit_s))


def count(app, status: str) -> float:  # type: ignore[no-untyped-def]
    app.state.metrics.flush()   # (per-request counts are coalesced until a flush)
    reg = app.state.metrics.registry
    return sum(reg.get_sample_value("dplb_router_requests_total", {"worker": w, "status": status, "model": "m"}) or 0
               for w in ("0", "1", "none"))


def inflight(app) -> int:  # type: ignore[no-untyped-def]
    return sum(app.state.seg.router_line(i)["router_inflight"] for i in (0, 1))


def send(make, loop):  # type: ignore[no-untyped-def]
    """A client sends one whole request; returns (client transport, protocol, what the request
    became: the LaterTask or asyncio.Task in the protocol's task set)."""
    c = RecordingTransport()
    proto = make(c)
    proto.data_received(REQUEST)
    return c, proto, list(proto.tasks)


def test_a_plain_whole_answer_is_served_without_a_task(rig, loop):
    make, _engine, app = rig
    created = []
    real = loop.create_task

    def spy(coro, **kw):  # type: ignore[no-untyped-def]
        created.append(getattr(coro, "__qualname__", ""))
        return real(coro, **kw)

    loop.create_task = spy   # type: ignore[method-assign]
    try:
        ok0 = count(app, "200")
        c, proto, started = send(make, loop)
        assert len(started) == 1 and isinstance(started[0], LaterTask) and inflight(app) == 1
        settle(loop, lambda: c.writes)
        out = b"".join(c.writes)
        assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(ANSWER) and b"x-dplb-worker-id: " in out
        assert len(c.writes) == 1                          # head and body in one write
        assert count(app, "200") == ok0 + 1 and inflight(app) == 0 and not proto.tasks
        assert not [q for q in created if "run_asgi" in q]  # no request task was created
    finally:
        del loop.create_task
    proto.connection_lost(None)


def test_a_status_retried_elsewhere_goes_to_the_task_and_the_other_worker_answers(rig, loop):
    make, engine, app = rig
    engine.script = [whole(429, b'{"error":"busy"}')]
    n0, ok0 = engine.requests, count(app, "200")
    c, proto, started = send(make, loop)
    assert isinstance(started[0], LaterTask)
    settle(loop, lambda: c.writes)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(ANSWER)
    assert engine.requests == n0 + 2 and count(app, "200") == ok0 + 1 and count(app, "429") == 0
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    proto.connection_lost(None)


def test_a_stream_is_relayed_by_the_task(rig, loop):
    make, engine, app = rig
    engine.script = [STREAM]
    c, proto, _ = send(make, loop)
    settle(loop, lambda: b"".join(c.writes).endswith(b"0\r\n\r\n"))
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200 OK") and b"data: [DONE]" in out
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    proto.connection_lost(None)


def test_a_client_that_leaves_before_the_answer_is_counted_499_and_the_engine_told(rig, loop):
    make, engine, app = rig
    engine.script = ["hang"]
    n0, closed0, gone0 = engine.requests, engine.closed, count(app, "499")
    c, proto, _ = send(make, loop)
    settle(loop, lambda: engine.requests == n0 + 1)
    proto.connection_lost(None)                     # the client leaves
    settle(loop, lambda: engine.closed == closed0 + 1)  # the engine's connection is closed: it aborts
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    assert count(app, "499") == gone0 + 1 and c.writes == []


def test_the_first_byte_deadline_runs_from_the_write_and_answers_504(rig, loop):
    make, engine, app = rig
    proxy = app.state.proxy
    proxy.transport.first_byte_timeout_s = 0.3
    proxy.settings = dataclasses.replace(proxy.settings, first_byte_timeout_s=0.3)
    engine.script = ["hang"]
    t0 = loop.time()
    c, proto, _ = send(make, loop)
    settle(loop, lambda: c.writes)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 504") and b"first-byte timeout" in out
    assert loop.time() - t0 >= 0.3
    assert orjson.loads(out.partition(b"\r\n\r\n")[2])["error"]["code"] == 504
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    proto.connection_lost(None)


def test_an_engine_that_closes_before_answering_is_retried_on_the_other_worker(rig, loop):
    make, engine, app = rig
    engine.script = ["close"]
    n0 = engine.requests
    c, proto, _ = send(make, loop)
    settle(loop, lambda: c.writes)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(ANSWER) and engine.requests == n0 + 2
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    proto.connection_lost(None)


def test_the_stops_drain_limit_cuts_a_waiting_request_with_503(rig, loop):
    make, engine, app = rig
    engine.script = ["hang"]
    n0, gone0 = engine.requests, count(app, "499")
    c, proto, started = send(make, loop)
    settle(loop, lambda: engine.requests == n0 + 1)
    for t in proto.tasks:                           # what uvicorn's stop does at its drain limit
        t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
    settle(loop, lambda: c.writes)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 503") and b"retry-after" in out.lower()
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    assert count(app, "503") >= 1 and count(app, "499") == gone0
    assert isinstance(started[0], LaterTask)
    proto.connection_lost(None)
