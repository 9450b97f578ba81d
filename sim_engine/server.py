"""``dplb-sim-engine``: the HTTP server around the simulated engine (Starlette + uvicorn).

::

    dplb-sim-engine (--uds PATH | [--host 127.0.0.1] --port P) [--model NAME] [--time-scale F]
                    [--seed S] [--block-size 16] [--num-gpu-blocks N] [--max-num-seqs 256]
                    [--max-num-batched-tokens 8192] [--max-model-len 131072] [--slowdown F] ...

A Unix socket is created with mode 0600. Errors are OpenAI-shaped JSON
(``{"error": {"message", "type", "param", "code"}}``): 400 for a bad body, 404 for an unknown
model or path; an unexpected exception is still answered in that shape (500) and logged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from sim_engine.api import SimServer, build_router, json_response
from sim_engine.config import EngineConfig, add_engine_args, config_from_args
from sim_engine.engine import EngineCore
from sim_engine.errors import SimEngineError
from sim_engine.kv_events import KVEventsConfig, ZmqEventPublisher
from sim_engine.peers import build_peer_router
from sim_engine.runner import EngineRunner

log = logging.getLogger("sim_engine")


def error_response(
    status: int, message: str, type_: str, param: str | None = None, code: str | int | None = None
) -> Response:
    """OpenAI-shaped error response."""
    return json_response(
        {
            "error": {
                "message": message,
                "type": type_,
                "param": param,
                "code": status if code is None else code,
            }
        },
        status=status,
    )


def create_app(config: EngineConfig, get_load_format: str = "sglang",
               kv_events: KVEventsConfig | None = None) -> Starlette:
    """Build the ASGI app (Starlette) for ``config``; the step loop runs for the app's lifespan.
    ``kv_events``: vLLM's ``--kv-events-config`` (active: the KV-cache events are published on
    ZMQ for the app's lifespan, :mod:`sim_engine.kv_events`).

    ``app.state.sim`` is the :class:`SimServer` (core, runner) — tests use it in-process."""
    core = EngineCore(config)
    sim = SimServer(core, EngineRunner(core, config.time_scale))
    sim.get_load_format = get_load_format

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        runner = sim.runner
        if kv_events is not None and kv_events.active:
            runner.kv_publisher = ZmqEventPublisher(kv_events)
            core.kv.events = []
            log.info("KV-cache events on %s (replay %s)", runner.kv_publisher.last_endpoint,
                     runner.kv_publisher.replay_last_endpoint)
        runner.start()
        if getattr(app.state, "uvicorn_server", None) is not None:
            _install_shutdown(app)
        try:
            yield
        finally:
            await runner.stop()
            if runner.kv_publisher is not None:
                runner.kv_publisher.close()
                runner.kv_publisher = None

    async def sim_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, SimEngineError)
        return json_response(exc.to_dict(), status=exc.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = exc.status_code
        t = "NotFoundError" if code == 404 else "BadRequestError" if code < 500 else "InternalServerError"
        return error_response(code, str(exc.detail), t)

    async def unexpected(request: Request, exc: Exception) -> Response:  # pragma: no cover - a bug
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "InternalServerError")

    app = Starlette(
        routes=build_router(sim).routes + build_peer_router(sim).routes,
        exception_handlers={SimEngineError: sim_error, HTTPException: http_error, Exception: unexpected},
        lifespan=lifespan,
    )
    app.state.sim = sim
    return app


def _install_shutdown(app: Starlette) -> None:
    """SIGTERM/SIGINT: abort every in-flight request (streams end with finish_reason ``abort`` and
    ``data: [DONE]``) and ask uvicorn to exit, so shutdown never waits on a long generation."""
    loop = asyncio.get_running_loop()

    def stop() -> None:
        n = app.state.sim.runner.abort_all()
        if n:
            log.warning("shutting down: aborted %d in-flight request(s)", n)
        app.state.uvicorn_server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of ``dplb-sim-engine``."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="dplb-sim-engine",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    lsn = p.add_argument_group("listening")
    lsn.add_argument("--uds", help="Serve on this Unix socket path (mode 0600) instead of TCP.")
    lsn.add_argument("--host", default="127.0.0.1", help="TCP host (loopback by default).")
    lsn.add_argument("--port", type=int, default=8000, help="TCP port.")
    lsn.add_argument(
        "--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"]
    )
    lsn.add_argument("--access-log", action="store_true", help="Log every HTTP request (uvicorn's).")
    lsn.add_argument(
        "--get-load-format",
        default="sglang",
        choices=["sglang", "vllm"],
        help="Shape of GET /get_load: SGLang's list (its router's power_of_two sums num_tokens) or "
        'vllm-router\'s {"load": N}; the two routers disagree, so pick the one in front.',
    )
    ev = p.add_argument_group("KV-cache events")
    ev.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='vLLM\'s flag: publish KV-cache events, e.g. \'{"enable_kv_cache_events": true, "publisher": '
        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (vLLM\'s wire format)',
    )
    add_engine_args(p)
    return p


def _unix_socket(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        s.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    s.listen(1024)
    s.setblocking(False)
    return s


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dplb-sim-engine`` / ``python -m sim_engine``. Returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        kv_events = KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None
    except ValueError as e:
        print(f"dplb-sim-engine: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = create_app(config, args.get_load_format, kv_events)
    ucfg = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=2,
        lifespan="on",
    )
    server = uvicorn.Server(ucfg)
    app.state.uvicorn_server = server
    if args.uds:
        sock = _unix_socket(args.uds)
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(args.uds)
    else:
        server.run()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
