"""The router's CPU per tiny request without sockets: ``python -m bench.router_inproc``.

The router's real uvicorn protocol (:class:`router.server.LimitedHttpToolsProtocol`) and the real
app (:func:`router.app.create_app`, policy ``dplb`` unless ``--policy``) in this process, on a
fresh segment with one ready worker (slot 0, heartbeating); the client's transport and the
engine's end of each pooled connection are fakes that cost next to nothing (the engine answers a
request at the event loop's next turn, as a socket read would bring it; the router's own
:class:`router.transport.Transport` pools, writes and parses). Each request is fed to the
protocol as the bytes a client would send (:mod:`bench.rawclient`'s tiny chat request) and
answered with the instant worker's tiny chat completion. What is timed is everything the
router's own process runs per request except the two sockets and the kernel: uvicorn's parsing
and task, the proxy, parse, policy, kernel call, lease, the engine connection's request write and
answer parse, accounting, metrics and the response's framing.

The router's logging is configured as in its process (:func:`router.app.configure_logging`, its
stream pointed at ``/dev/null``), so the access line (``--access-log``, default ``text``) costs
what it costs there.

Prints µs per request (wall time of a tight loop, so run it on a quiet machine and compare runs
interleaved) and the client writes per request. ``--profile``: cProfile's Python function calls
per request (deterministic: the same code makes the same calls, whatever the machine's noise),
the own time grouped by package, and the top functions.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import time
import uuid
from collections import defaultdict
from typing import Any

from bench.instant_worker import RESP, RESP_BODY
from bench.rawclient import BODY, chat_request


class _EngineSide(asyncio.Transport):
    """The engine's end of one pooled connection: every request written to it is answered with
    the instant worker's whole tiny answer (:data:`bench.instant_worker.RESP`) at the event loop's
    next turn, as a read of a real socket would bring it."""

    def __init__(self, conn: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.conn = conn
        self.loop = loop
        self.closed = False

    def write(self, data: Any) -> None:
        self.loop.call_soon(self.conn.data_received, RESP)

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(parts))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self.conn.connection_lost, None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


def _fake_engine_pools() -> None:
    """Connections to engines made in-process (:class:`_EngineSide`) instead of sockets: the
    router's real :class:`router.transport.Transport` (pool, request write, response parse, the
    taskless answer) runs as in the router's process."""
    from router.connection import Connection, Pool

    async def connect(self: Pool, timeout: float) -> Connection:
        c = Connection()
        c.connection_made(_EngineSide(c, asyncio.get_running_loop()))
        c.home = self
        return c

    Pool.connect = connect  # type: ignore[method-assign]


class _Client(asyncio.Transport):
    """The client's side of the router's connection: counts writes, tells when an answer is out."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.done: asyncio.Future[None] | None = None

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 30000), "peername": ("127.0.0.1", 40000)}.get(name, default)

    def write(self, data: Any) -> None:
        self.writes += 1
        if RESP_BODY in bytes(data) and self.done is not None and not self.done.done():
            self.done.set_result(None)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


async def _run(a: argparse.Namespace, shm: str, seg: Any, writer: Any) -> None:
    import uvicorn
    from uvicorn.lifespan.on import LifespanOn
    from uvicorn.server import ServerState

    from router.app import create_app
    from router.config import load_config
    from router.server import LimitedHttpToolsProtocol

    loop = asyncio.get_running_loop()
    cfg = load_config(None, {"router.shm": shm, "health_check.enabled": False,
                             "routing_policy.policy": a.policy, "router.access_log": a.access_log,
                             "admission.enabled": a.admission == "on"})
    app = create_app(cfg, seg)
    ucfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="on", access_log=False, server_header=False,
                          date_header=False, log_level="warning", proxy_headers=False, timeout_keep_alive=30)
    ucfg.load()
    lifespan = LifespanOn(ucfg)
    await lifespan.startup()
    try:
        assert app.state.proxy is not None
        _fake_engine_pools()
        proto = LimitedHttpToolsProtocol(config=ucfg, server_state=ServerState(), app_state={}, _loop=loop)
        client = _Client()
        proto.connection_made(client)
        req = chat_request(b"127.0.0.1:30000")
        n = 0

        async def one() -> None:
            nonlocal n
            n += 1
            if n % 500 == 0:
                writer.heartbeat()
            client.done = loop.create_future()
            proto.data_received(req)
            await client.done

        for _ in range(2000):
            await one()
        w0 = client.writes
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.requests):
            await one()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        print(f"router in-process, policy={a.policy}: {dt / a.requests * 1e6:.1f} µs per tiny request, "
              f"{(client.writes - w0) / a.requests:.2f} client writes per request, "
              f"{dc / a.requests * 1e6:.1f} µs CPU per request")
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.requests):
                await one()
            prof.disable()
            if a.dump:
                prof.dump_stats(a.dump)
            st = pstats.Stats(prof)
            print(f"Python function calls per request: {st.total_calls / a.requests:.1f}")   # type: ignore[attr-defined]
            groups: dict[str, float] = defaultdict(float)
            for (fn, _, _), (_, _, tt, _, _) in st.stats.items():  # type: ignore[attr-defined]
                key = next((k for k in ("router", "uvicorn", "prometheus_client", "asyncio", "dplb_shm")
                            if f"/{k}/" in fn), "builtins" if fn == "~" else "other")
                groups[key] += tt
            total = sum(groups.values()) or 1.0
            print("own time under cProfile, by package: " + ", ".join(
                f"{k} {100 * v / total:.0f} %" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))
            st.sort_stats("tottime").print_stats(a.top)
    finally:
        await lifespan.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.router_inproc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000, help="timed requests (after 2,000 warm-up ones)")
    ap.add_argument("--policy", default="dplb")
    ap.add_argument("--profile", action="store_true", help="also run them under cProfile and print calls per request")
    ap.add_argument("--top", type=int, default=25, help="functions listed with --profile")
    ap.add_argument("--access-log", default="text", choices=("text", "json", "off"), help="router.access_log")
    ap.add_argument("--admission", default="on", choices=("on", "off"), help="admission.enabled (default on, as shipped)")
    ap.add_argument("--dump", help="with --profile: also write cProfile's stats to this file (pstats)")
    a = ap.parse_args(argv)
    import logging

    import uvloop

    from router.app import configure_logging

    configure_logging("warning")
    devnull = open(os.devnull, "w")   # noqa: SIM115 (the router's stream for the whole run)
    for h in logging.root.handlers:
        if isinstance(h, logging.StreamHandler):
            h.setStream(devnull)

    from dplb_shm import Segment, WorkerState

    assert BODY in chat_request(b"x")
    shm = f"dplb-bench-{uuid.uuid4().hex[:8]}"
    seg = Segment.create(shm, num_slots=8)
    try:
        writer = seg.writer(0)
        writer.claim(worker_id=0, pid=os.getpid(), endpoint="127.0.0.1:9", model="bench", max_num_seqs=256)
        writer.set_state(WorkerState.READY)
        writer.heartbeat()
        uvloop.run(_run(a, shm, seg, writer))
    finally:
        path = f"/dev/shm/{shm}"
        if os.path.exists(path):
            os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
