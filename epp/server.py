"""The endpoint picker's servers: ext_proc (gRPC over :mod:`epp.h2grpc`, or grpcio's
:class:`epp.stream.ExtProcServicer`, each driving one :class:`epp.stream.Exchange` per stream of a
:class:`epp.picker.Picker`), gRPC health, ``/metrics`` (HTTP, aiohttp), and :func:`serve`, which
runs them with the picker.

**Health** (gRPC ``grpc.health.v1.Health``, its own port): ``liveness`` is SERVING while the
process runs; ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` (and ``""``) are
SERVING while at least one worker is eligible, NOT_SERVING otherwise (updated every health tick).
"""
from __future__ import annotations

import asyncio
import functools
import gc
import logging
from typing import TYPE_CHECKING, TypeAlias

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from epp.h2grpc import H2GrpcServer
from epp.observe import new_exchange
from epp.picker import Picker
from epp.stream import ExtProcServicer

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("dplb.epp")

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: the ext_proc servers :func:`start_grpc` can run
ExtServer: TypeAlias = "H2GrpcServer | grpc.aio.Server"


async def start_grpc(picker: Picker, host: str, port: int, health_port: int,
                     body_mode: int = 2, resp_mode: int = 1,
                     server: str = "h2") -> tuple[ExtServer, grpc.aio.Server, health_aio.HealthServicer]:
    """Start the ext_proc server on ``host:port`` and the health server on ``host:health_port``
    (0: a free port each; the bound ports are on the returned ext_proc server's ``bound_ports``
    attribute). ``server``: ``h2`` (:mod:`epp.h2grpc`, the default: about half of grpcio's CPU
    per request) or ``grpcio`` (``grpc.aio``). Returns ``(ext_proc server, health server, health
    servicer)``; the picker's readiness drives the health statuses (module docstring). Raises
    RuntimeError when a port cannot be bound, ValueError for an unknown ``server``."""
    ext: ExtServer
    if server == "h2":
        ext = H2GrpcServer(functools.partial(new_exchange, picker, body_mode, resp_mode))
        try:
            ext_port = await ext.start(host, port)
        except OSError:
            ext_port = 0
    elif server == "grpcio":
        ext = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(
            ExtProcServicer(functools.partial(new_exchange, picker, body_mode, resp_mode)), ext)
        ext_port = ext.add_insecure_port(f"{_bracket(host)}:{port}")
    else:
        raise ValueError(f"unknown ext_proc server {server!r} (h2, grpcio)")
    hs = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, hs)
    h_port = hs.add_insecure_port(f"{_bracket(host)}:{health_port}")
    if not ext_port or not h_port:
        raise RuntimeError(f"cannot listen on {host}:{port} (ext_proc) / {host}:{health_port} (health)")
    ext.bound_ports = (ext_port, h_port)
    await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)

    async def ready(ok: bool) -> None:
        st = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("readiness", SERVICE, ""):
            await health.set(name, st)

    picker.on_ready_change = ready
    await ready(picker.ready)
    if isinstance(ext, grpc.aio.Server):
        await ext.start()
    await hs.start()
    return ext, hs, health


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def start_metrics(picker: Picker, host: str, port: int) -> web.AppRunner:
    """``GET /metrics`` (the router's series, :class:`router.metrics.Metrics`) on ``host:port``
    over HTTP (aiohttp). Returns the runner (``await runner.cleanup()`` stops it)."""
    from aiohttp import web

    async def metrics(_: web.Request) -> web.Response:
        body, ctype = picker.state.metrics.render()
        return web.Response(body=body, headers={"content-type": ctype})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def serve(picker: Picker, host: str, port: int, health_port: int, metrics_port: int | None,
                body_mode: int = 2, stop: asyncio.Event | None = None, resp_mode: int = 1,
                server: str = "h2") -> None:
    """Run the picker and its servers until ``stop`` is set (forever when None); everything is
    stopped and the picker's slots given back on the way out. ``server``: :func:`start_grpc`'s."""
    await picker.start()
    runner = None
    servers: tuple[ExtServer, ...] = ()
    try:
        ext, hs, _ = await start_grpc(picker, host, port, health_port, body_mode, resp_mode, server)
        servers = (ext, hs)
        if metrics_port is not None:
            runner = await start_metrics(picker, host, metrics_port)
        # what start-up built (modules, the picker, the servers) lives as long as the process: out
        # of the collector's sight, so that its full passes walk only what requests allocate
        # (gc.freeze, CPython's gc docs; as the router does, router/control.py). A full pass over
        # the start-up objects stalled the picker's loop 160-180 ms at load 10 behind Envoy
        # (bench/results/gateway.md round 7), every ext_proc stream waiting meanwhile.
        gc.collect()
        gc.freeze()
        log.warning("dplb-epp: ext_proc on %s:%d, health on %s:%d, metrics %s, policy %s, segment %s", host,
                    ext.bound_ports[0], host, ext.bound_ports[1],
                    f"on {host}:{metrics_port}" if metrics_port is not None else "off",
                    picker.state.policy.name, picker.state.seg.name)
        await (stop or asyncio.Event()).wait()
    finally:
        for s in servers:
            await s.stop(grace=1.0)
        if runner is not None:
            await runner.cleanup()
        await picker.stop()


__all__ = ["SERVICE", "serve", "start_grpc", "start_metrics"]
