"""Attacks on the taskless serving of a plain answer (router/quick.py ``QuickAnswer``): HTTP/1.1
requests pipelined on one client connection, an engine's 5xx, a body split over reads or cut
short, a slow client, the stop's drain limit racing the engine's answer. Each request is answered
exactly once, its connection to the engine goes back to the pool at most once, and the in-flight
accounting returns to zero. The rig of tests/router/test_quick_answer.py: the real app and
protocol in front of a scripted engine on loopback."""
from __future__ import annotations

import asyncio
import os

import pytest

from dplb_shm import Segment, WorkerState
from router.server import LaterTask
from tests.helpers import RecordingTransport, unique_shm_name
from tests.router.test_quick_answer import (
    ANSWER,
    REQUEST,
    ScriptedEngine,
    count,
    inflight,
    settle,
    warmed_router,
    whole,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def rig(loop):
    yield from warmed_router(loop, ScriptedEngine())


def send(make, n: int = 1):  # type: ignore[no-untyped-def]
    c = RecordingTransport()
    proto = make(c)
    proto.data_received(REQUEST * n)
    return c, proto, list(proto.tasks)


def responses(c: RecordingTransport) -> int:
    return b"".join(c.writes).count(b"HTTP/1.1 ")


def pools_sane(app) -> bool:  # type: ignore[no-untyped-def]
    """No connection idles twice in a pool (two requests would then share it)."""
    for pool in app.state.proxy.transport._pools.values():
        idle = list(pool.idle)
        if len({id(c) for c in idle}) != len(idle):
            return False
    return True


def test_two_pipelined_requests_are_both_answered_in_order(rig, loop):
    make, engine, app = rig
    engine.script = [whole(200, ANSWER.replace(b'"hi"', b'"one"')), whole(200, ANSWER.replace(b'"hi"', b'"two"'))]
    ok0 = count(app, "200")
    c, proto, started = send(make, 2)
    assert isinstance(started[0], LaterTask)
    settle(loop, lambda: responses(c) == 2)
    out = b"".join(c.writes)
    assert out.index(b'"one"') < out.index(b'"two"')
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    assert count(app, "200") == ok0 + 2 and pools_sane(app)
    proto.connection_lost(None)


def test_an_engine_5xx_is_relayed_once_and_counted(rig, loop):
    make, engine, app = rig
    engine.script = [whole(500, b'{"error":"boom"}')]
    n0, e0 = engine.requests, count(app, "500")
    c, proto, started = send(make)
    assert isinstance(started[0], LaterTask)
    settle(loop, lambda: c.writes)
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 500") and out.endswith(b'{"error":"boom"}') and responses(c) == 1
    assert engine.requests == n0 + 1 and count(app, "500") == e0 + 1
    proto.connection_lost(None)


def test_a_body_split_over_reads_is_answered_whole(rig, loop):
    make, engine, app = rig
    resp = whole(200)
    engine.script = [[resp[:-20], resp[-20:]]]
    c, proto, _ = send(make)
    settle(loop, lambda: c.writes)
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(ANSWER) and responses(c) == 1 and pools_sane(app)
    proto.connection_lost(None)


def test_a_body_cut_short_is_retried_on_the_other_worker(rig, loop):
    make, engine, app = rig
    resp = whole(200)
    engine.script = [("cut", resp[:-20])]
    n0 = engine.requests
    c, proto, _ = send(make)
    settle(loop, lambda: c.writes)
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(ANSWER) and responses(c) == 1
    assert engine.requests == n0 + 2 and pools_sane(app)
    proto.connection_lost(None)


def test_a_slow_client_gets_the_answer_through_its_task(rig, loop):
    make, _engine, app = rig
    c, proto, started = send(make)
    assert isinstance(started[0], LaterTask)
    proto.pause_writing()                        # the client's transport is above its high-water mark
    settle(loop, lambda: any(not isinstance(t, LaterTask) for t in proto.tasks))   # handed to its task
    assert c.writes == []
    proto.resume_writing()
    settle(loop, lambda: c.writes and inflight(app) == 0 and not proto.tasks)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(ANSWER) and responses(c) == 1 and pools_sane(app)
    proto.connection_lost(None)


def test_the_drain_cut_racing_the_engines_answer_answers_once(rig, loop):
    """uvicorn's stop cancels the request at its drain limit; the engine's whole answer is read in
    the same turn of the loop, after the cut spawned the request's task and before that task's
    first step. One answer reaches the client, the engine's connection is pooled at most once."""
    make, engine, app = rig
    engine.script = ["hang"]
    n0 = engine.requests
    c, proto, started = send(make)
    qa = started[0]
    assert isinstance(qa, LaterTask)
    settle(loop, lambda: engine.requests == n0 + 1)
    conn = qa.att.written     # the engine's connection (the engine itself stays silent)
    errors: list[object] = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))
    qa.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")   # queues the cut
    loop.call_soon(conn.data_received, whole(200))   # the answer, read right after the cut
    settle(loop, lambda: c.writes)
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    for _ in range(5):
        loop.run_until_complete(asyncio.sleep(0.01))
    assert responses(c) == 1, b"".join(c.writes)
    assert pools_sane(app)
    assert not errors, errors
    proto.connection_lost(None)


class ClosingTransport(RecordingTransport):
    """A client transport that records being closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_graceful_stop_waits_for_a_quick_answer_and_closes_after_it(rig, loop):
    """uvicorn's stop asks each connection to shut down (HttpToolsProtocol.shutdown), then waits
    while its task set is not empty: the taskless request stays in that set until its answer is
    out, and the answer says ``connection: close`` and closes the connection."""
    make, engine, app = rig
    resp = whole(200)
    engine.script = [[resp[:0], resp]]          # the whole answer 50 ms after the request
    c = ClosingTransport()
    proto = make(c)
    proto.data_received(REQUEST)
    assert isinstance(next(iter(proto.tasks)), LaterTask)
    proto.shutdown()                            # the stop begins with the request in flight
    assert not c.closed and proto.tasks         # uvicorn waits for it
    settle(loop, lambda: c.writes)
    out = b"".join(c.writes)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(ANSWER) and b"connection: close" in out.lower()
    assert c.closed
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    proto.connection_lost(None)


def test_a_client_leaving_after_the_head_came_is_499_and_the_engine_told(rig, loop):
    """The head and part of the body came (the task took over); then the client leaves."""
    make, engine, app = rig
    resp = whole(200)
    engine.script = [[resp[:-20]]]             # the rest of the body never comes
    closed0, gone0 = engine.closed, count(app, "499")
    c, proto, started = send(make)
    assert isinstance(started[0], LaterTask)
    settle(loop, lambda: any(not isinstance(t, LaterTask) for t in proto.tasks))
    proto.connection_lost(None)
    settle(loop, lambda: engine.closed == closed0 + 1)
    settle(loop, lambda: inflight(app) == 0 and not proto.tasks)
    assert count(app, "499") == gone0 + 1 and c.writes == [] and pools_sane(app)


def test_a_drain_cut_quick_request_is_answered_503_while_the_app_stops():
    """uvicorn's stop at its drain limit cancels every listed task, then runs the app's lifespan
    shutdown at once (pools closed, the router's own segment detached): the taskless request's cut
    (spawned one callback later, cancelled one after that) still answers its 503 with the app's
    state intact, and nothing is logged as an error."""
    import uvicorn
    from uvicorn.lifespan.on import LifespanOn
    from uvicorn.server import ServerState

    from router.app import create_app
    from router.config import load_config
    from router.server import LimitedHttpToolsProtocol
    loop = asyncio.new_event_loop()
    engine = ScriptedEngine()
    port = loop.run_until_complete(engine.start())
    name = unique_shm_name()
    seg = Segment.create(name, num_slots=4)
    errors: list[object] = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))
    try:
        w = seg.writer(0)
        w.claim(worker_id=0, pid=os.getpid(), endpoint=f"127.0.0.1:{port}", model="m", max_num_seqs=64)
        w.set_state(WorkerState.READY)
        w.heartbeat()
        cfg = load_config(None, {"router.shm": name, "health_check.enabled": False,
                                 "health_check.heartbeat_timeout_ms": 600_000})
        app = create_app(cfg)   # attaches the segment itself: closes it at its stop
        ucfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="on", log_level="critical",
                              access_log=False, proxy_headers=False)
        ucfg.load()
        lifespan = LifespanOn(ucfg)
        loop.run_until_complete(lifespan.startup())
        state = ServerState()

        def make(c):  # type: ignore[no-untyped-def]
            p = LimitedHttpToolsProtocol(config=ucfg, server_state=state, app_state={}, _loop=loop)
            p.connection_made(c)
            return p
        c0 = RecordingTransport()
        p0 = make(c0)
        p0.data_received(REQUEST)
        settle(loop, lambda: c0.writes)
        p0.connection_lost(None)
        engine.script = ["hang"]
        c = RecordingTransport()
        proto = make(c)
        proto.data_received(REQUEST)
        assert isinstance(next(iter(proto.tasks)), LaterTask)
        settle(loop, lambda: engine.requests == 2)
        for t in list(state.tasks):
            t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        loop.run_until_complete(lifespan.shutdown())
        for _ in range(20):
            loop.run_until_complete(asyncio.sleep(0.01))
        assert b"".join(c.writes).startswith(b"HTTP/1.1 503")
        assert not errors and not state.tasks
    finally:
        assert engine.server is not None
        engine.server.close()
        seg.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
        loop.close()
