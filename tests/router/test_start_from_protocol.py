"""A request whose whole body comes with its head is started from the router's protocol callback
(router/server.py ``LimitedHttpToolsProtocol._start_deferred``, router/app.py
``DPLBApp.start_request``, router/proxy.py ``Proxy.start``): parsed, chosen and written to its
worker before the event loop turns, its task then serves the rest. Everything else (a body still
arriving, an error to answer, a pipelined request, a GET) is served from the task as before.

Driven by hand: the real uvicorn protocol on a recording transport, first with an app that
records what it is asked, then with the real router app on a real segment and an engine stand-in
that records when it is written to."""
from __future__ import annotations

import asyncio

import orjson
import pytest
import uvicorn
from uvicorn.server import ServerState

from dplb_shm import Segment
from router.director import OpenAdmission
from router.server import LimitedHttpToolsProtocol, write_response
from tests.helpers import RecordingTransport, in_process_router

pytestmark = pytest.mark.timeout(60)

BODY = b'{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":4}'
ANSWER = b'{"choices":[{"message":{"content":"hi"}}],"usage":{"completion_tokens":1}}'


def post(body: bytes, path: bytes = b"/v1/chat/completions", extra: bytes = b"") -> tuple[bytes, bytes]:
    """(head, body) of a POST with a JSON body."""
    head = (b"POST " + path + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" + extra +
            b"content-length: %d\r\n\r\n" % len(body))
    return head, body


def protocol(app, loop: asyncio.AbstractEventLoop, client: RecordingTransport) -> LimitedHttpToolsProtocol:  # type: ignore[no-untyped-def]
    cfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="off", log_level="critical", access_log=False,
                         proxy_headers=False)   # as the router runs it (no middleware around the app)
    cfg.load()
    proto = LimitedHttpToolsProtocol(config=cfg, server_state=ServerState(), app_state={}, _loop=loop)
    proto.connection_made(client)
    return proto


class RecordingApp:
    """``start_request`` records its calls and, per ``mode``, returns a callable that answers with
    the body it was given ("start"), None ("decline") or raises ("raise"). ``__call__`` (the task
    path) reads the body through ``receive`` and answers it."""

    def __init__(self, mode: str = "start") -> None:
        self.mode = mode
        self.started: list[bytes] = []
        self.called: list[bytes] = []

    def start_request(self, scope, body: bytes):  # type: ignore[no-untyped-def]
        self.started.append(body)
        if self.mode == "raise":
            raise RuntimeError("a fault in start_request")
        if self.mode == "decline":
            return None

        async def rest(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
            assert write_response(scope, 200, [], b"started:" + body)

        return rest

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        self.called.append(body)
        assert write_response(scope, 200, [], b"task:" + body)


def turn(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_until_complete(asyncio.sleep(0.01))


def test_a_whole_request_is_started_inside_the_read_that_brought_it(loop):
    app, c = RecordingApp(), RecordingTransport()
    proto = protocol(app, loop, c)
    head, body = post(BODY)
    proto.data_received(head + body)
    assert app.started == [BODY]              # before the event loop ran anything
    turn(loop)
    assert app.called == [] and c.writes[-1].endswith(b"started:" + BODY)
    proto.connection_lost(None)


def test_a_body_in_a_later_read_is_served_from_the_task(loop):
    app, c = RecordingApp(), RecordingTransport()
    proto = protocol(app, loop, c)
    head, body = post(BODY)
    proto.data_received(head)
    turn(loop)
    proto.data_received(body)
    turn(loop)
    assert app.started == [] and app.called == [BODY]
    assert c.writes[-1].endswith(b"task:" + BODY)
    proto.connection_lost(None)


@pytest.mark.parametrize("mode", ["decline", "raise"])
def test_a_declined_or_failed_start_leaves_the_body_to_the_task(loop, mode):
    app, c = RecordingApp(mode), RecordingTransport()
    proto = protocol(app, loop, c)
    head, body = post(BODY)
    proto.data_received(head + body)
    turn(loop)
    assert app.started == [BODY] and app.called == [BODY]     # the task still reads the whole body
    assert c.writes[-1].endswith(b"task:" + BODY)
    proto.connection_lost(None)


def test_a_pipelined_request_waits_for_the_answer_before_it_and_goes_to_the_task(loop):
    """Started from the previous answer's write it would be decided before that request's task
    released its lease (see test_router_fakes' pipelining affinity test); it takes the task path."""
    app, c = RecordingApp(), RecordingTransport()
    proto = protocol(app, loop, c)
    h1, b1 = post(b'{"n":1}')
    h2, b2 = post(b'{"n":2}')
    proto.data_received(h1 + b1 + h2 + b2)
    assert app.started == [b'{"n":1}']
    turn(loop)
    turn(loop)
    assert app.called == [b'{"n":2}']
    out = b"".join(c.writes)
    assert out.index(b"started:" + b1) < out.index(b"task:" + b2)
    proto.connection_lost(None)


def test_only_the_first_request_of_a_turn_of_the_event_loop_is_started_from_its_read(loop):
    """Several requests ready in one turn (a busy router) go through their tasks, as a batch:
    starting each from its read costs about 12 % more CPU per request at saturation
    (bench/results/router_profile.md section 9). The next turn starts its first one again."""
    app = RecordingApp()
    clients = [RecordingTransport() for _ in range(3)]
    protos = [protocol(app, loop, c) for c in clients]
    for i, p in enumerate(protos):
        head, body = post(b'{"n":%d}' % i)
        p.data_received(head + body)
    assert app.started == [b'{"n":0}']
    turn(loop)
    assert sorted(app.called) == [b'{"n":1}', b'{"n":2}']
    head, body = post(b'{"n":3}')
    protos[0].data_received(head + body)
    assert app.started == [b'{"n":0}', b'{"n":3}']
    turn(loop)
    for p in protos:
        p.connection_lost(None)


def test_other_methods_are_not_deferred(loop):
    app, c = RecordingApp(), RecordingTransport()
    proto = protocol(app, loop, c)
    proto.data_received(b"PUT /v1/x HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    turn(loop)
    assert app.started == [] and app.called == [b"{}"]
    proto.connection_lost(None)


# -- the real router app ----------------------------------------------------------------------


class WholeAnswer:
    """A worker's whole 200 answer, as router.transport.Upstream carries one."""

    status = 200
    is_stream = False
    request_id = None
    whole = ANSWER

    def __init__(self) -> None:
        self.headers = [(b"content-type", b"application/json")]
        self.answered = False

    def release(self, abort: bool = False) -> None:
        return None


class Engine:
    """Stands in for router.transport.Transport: records each write (with the worker's router
    line in the segment at that moment) and answers every request whole."""

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.written: list[tuple[str, bytes, dict]] = []

    def write_pooled(self, endpoint, method, path, headers, body):  # type: ignore[no-untyped-def]
        self.written.append((path, body, self.seg.router_line(0)))

    async def send(self, endpoint, method, path, headers, body, timeout_s=None, written=None, on_whole=None, deadline=None):  # type: ignore[no-untyped-def]
        up = WholeAnswer()
        if on_whole is not None:   # as the real client does when the whole answer came with its head
            up.answered = bool(on_whole(up))
        return up

    async def get(self, *a, **k):  # type: ignore[no-untyped-def]
        return 200, b""

    async def forget(self, endpoint: str) -> None:
        return None

    async def close(self) -> None:
        return None


@pytest.fixture
def router(loop):
    """(protocol factory, engine stand-in, segment): the real app on a segment with one ready worker."""
    with in_process_router(loop, "127.0.0.1:9") as (app, seg, make):
        engine = Engine(seg)
        app.state.proxy.transport = engine
        yield make, engine, seg


def test_the_router_writes_a_whole_request_to_its_worker_and_leases_it_within_the_read(router, loop):
    make, engine, seg = router
    c = RecordingTransport()
    proto = make(c)
    head, body = post(BODY)
    proto.data_received(head + body)
    # no turn of the event loop yet: the request is at the engine, and its lease taken after the write
    assert [(p, b) for p, b, _ in engine.written] == [("/v1/chat/completions", BODY)]
    assert engine.written[0][2]["router_inflight"] == 0
    assert seg.router_line(0)["router_inflight"] == 1
    turn(loop)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200 OK") and out.endswith(ANSWER) and b"x-dplb-worker-id: 0" in out
    assert seg.router_line(0)["router_inflight"] == 0          # the task released it
    proto.connection_lost(None)


@pytest.mark.parametrize("body,status", [(b'{"model":"nope","prompt":"x"}', b"404"), (b"not json", b"400"),
                                         (b"", b"400")])
def test_a_request_the_router_refuses_is_answered_from_its_task_and_never_written(router, loop, body, status):
    make, engine, seg = router
    c = RecordingTransport()
    proto = make(c)
    head, b = post(body, b"/v1/completions")
    proto.data_received(head + b)
    turn(loop)
    assert engine.written == []
    assert b"".join(c.writes).startswith(b"HTTP/1.1 " + status) and seg.router_line(0)["dispatched"] == 0
    proto.connection_lost(None)


def test_a_request_split_across_reads_reaches_the_worker_from_its_task(router, loop):
    make, engine, _ = router
    c = RecordingTransport()
    proto = make(c)
    head, body = post(BODY)
    proto.data_received(head + body[:10])
    assert engine.written == []
    turn(loop)
    proto.data_received(body[10:])
    turn(loop)
    assert [(p, b) for p, b, _ in engine.written] == [("/v1/chat/completions", BODY)]
    assert b"".join(c.writes).endswith(ANSWER)
    proto.connection_lost(None)


@pytest.mark.parametrize("head", [
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.2\r\nhost: x\r\ncontent-length: 2\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\nhost: x\ncontent-length: 2\n\n",
])
def test_a_head_the_parser_refuses_is_answered_in_the_openai_error_shape_and_reaches_no_app(loop, head):
    """Issue 27, item 9: uvicorn answered framing errors with its plain text."""
    app, c = RecordingApp(), RecordingTransport()
    proto = protocol(app, loop, c)
    proto.data_received(head + b"{}")
    turn(loop)
    assert app.started == [] and app.called == []
    out = b"".join(c.writes)
    h, _, body = out.partition(b"\r\n\r\n")
    assert h.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in h and b"connection: close" in h
    err = orjson.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["message"].startswith("malformed HTTP/1.1 request: ") and len(err["message"]) > 30
    proto.connection_lost(None)


class _Holding(OpenAdmission):
    """An admission that holds every request until ``go`` is set (router.director.Admission; the
    rest of the step as :class:`OpenAdmission`'s)."""

    __slots__ = ("go",)

    def __init__(self) -> None:
        self.go = asyncio.Event()

    def ready(self, info) -> bool:  # type: ignore[no-untyped-def]
        return self.go.is_set()

    async def wait(self, info) -> None:  # type: ignore[no-untyped-def]
        await self.go.wait()


def test_a_request_admission_holds_back_waits_in_its_task_then_reaches_its_worker(loop):
    # the admission step is request control's (router.director): the protocol's callback does not
    # dispatch a request it holds back; the request's task waits, then dispatches it
    with in_process_router(loop, "127.0.0.1:9") as (app, seg, make):
        engine = Engine(seg)
        app.state.proxy.transport = engine
        adm = _Holding()
        app.state.proxy.director.admission = adm
        c = RecordingTransport()
        proto = make(c)
        head, body = post(BODY)
        proto.data_received(head + body)
        for _ in range(5):
            turn(loop)
        assert engine.written == [] and c.writes == [] and seg.router_line(0)["router_inflight"] == 0
        adm.go.set()
        for _ in range(5):
            turn(loop)
        assert [(p, b) for p, b, _ in engine.written] == [("/v1/chat/completions", BODY)]
        assert b"".join(c.writes).endswith(ANSWER) and seg.router_line(0)["router_inflight"] == 0
        proto.connection_lost(None)
