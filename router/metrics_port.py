"""``GET /metrics`` on a port of its own (``metrics.port``, ``dplb-router --metrics-port``).

SGLang's router (``--prometheus-port``) and vLLM's production stack serve their metrics apart from
the traffic port, so a scraper's firewall rule or ``ServiceMonitor`` needs no access to the API.
DPLB serves the same page there: each router process runs a second, small uvicorn server on its
own event loop whose only route is ``GET /metrics``, answered by the router's own app (same
exposition, same loopback/API-key rule, :meth:`router.metrics.Metrics.render`: the coalesced
counters are flushed first, the segment is read fresh). Any other path is a 404; the main port
keeps serving ``/metrics`` too.

With ``--workers K`` every router process binds the port with ``SO_REUSEPORT`` (the kernel spreads
the scrapes over them, as uvicorn's parent socket spreads the API's connections); whichever answers
reads prometheus_client's multiprocess files (every process's counts) plus the segment, so any
answer is the whole deployment's page. :func:`reserve` is the parent's check that nothing else
listens on the port (a bind without ``SO_REUSEPORT`` fails while any listener holds it, another
router's included) and keeps it bound, not listening, so an unrelated program cannot take it while
the processes start.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

from router.asgi import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    import uvicorn

    from router.config import Config

log = logging.getLogger("dplb.router")


def _socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (IPv6 for a literal with ':')."""
    h = host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((h, port))
    except OSError:
        s.close()
        raise
    return s


def reserve(host: str, port: int) -> socket.socket:
    """Check that ``host:port`` is free and hold it bound (not listening) for this process's life.
    Raises ``OSError`` (``EADDRINUSE``, ...) when another program, or another DPLB router, holds it."""
    probe = socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a scrape's TIME_WAIT is no holder
        probe.bind((host.strip("[]"), port))   # no SO_REUSEPORT: fails while any socket listens on the port
    finally:
        probe.close()
    return _socket(host, port)


class MetricsPort:
    """The metrics listener of one router process. ``app``: the router's ASGI app (the FastAPI
    app of :func:`router.control.build_fastapi`); ``host``/``port``: where to listen."""

    def __init__(self, app: ASGIApp, host: str, port: int) -> None:
        self.app, self.host, self.port = app, host, port
        self.server: uvicorn.Server | None = None

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET":
            await self.app(scope, receive, send)
            return
        body = b'{"error": {"message": "this port serves GET /metrics only", "type": "not_found_error", "code": 404}}'
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def start(self) -> None:
        """Bind (``SO_REUSEPORT``) and serve on the running loop. Raises ``OSError`` when the port is
        taken by something that is not a router process of this deployment."""
        import uvicorn

        sock = _socket(self.host, self.port)
        cfg = uvicorn.Config(self._asgi, interface="asgi3", lifespan="off", access_log=False, server_header=False,
                             date_header=False, log_level="warning", timeout_graceful_shutdown=1)
        cfg.load()
        self.server = uvicorn.Server(cfg)
        self.server.lifespan = cfg.lifespan_class(cfg)   # "off": what Server.serve would set before startup
        try:
            await self.server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            raise
        log.info("metrics on http://%s:%d/metrics", self.host, self.port)

    async def stop(self) -> None:
        """Stop listening; close the scrapes' connections (a scrape in progress gets 1 s)."""
        if self.server is None:
            return
        server, self.server = self.server, None
        for s in server.servers:
            s.close()
        for conn in list(server.server_state.connections):
            conn.shutdown()
        for s in server.servers:
            try:
                await asyncio.wait_for(s.wait_closed(), 1.0)
            except TimeoutError:
                pass


async def start_metrics_port(cfg: Config, app: ASGIApp) -> MetricsPort | None:
    """Start the metrics listener ``cfg.metrics.port`` asks for (a :class:`router.config.Config`),
    on ``cfg.router.host``; None when no port of its own is configured."""
    if cfg.metrics.port is None:
        return None
    mp = MetricsPort(app, cfg.router.host, cfg.metrics.port)
    await mp.start()
    return mp


__all__ = ["MetricsPort", "reserve", "start_metrics_port"]
