"""The router's assembly and ASGI entry point.

    app = create_app(cfg)          # ASGI callable served by uvicorn (uvloop + httptools)

:func:`create_app` puts together the router's state (:class:`HttpRouterState`: the
:class:`router.state.RouterState` with its HTTP edge, the :class:`router.proxy.Proxy`) and its
control API (:func:`router.control.build_fastapi`, started in FastAPI's lifespan). Requests are
dispatched in :class:`DPLBApp`: ``POST /v1/*`` and ``POST /generate`` go straight to the raw-ASGI
:class:`router.proxy.Proxy` (the hot path); everything else — ``GET /health``, ``GET /v1/models``,
``GET /dplb/status``, ``POST /dplb/route``, ``GET /metrics`` and the admin API
(:mod:`router.admin`) — is served by FastAPI (:mod:`router.control`). Errors anywhere are
OpenAI-shaped JSON.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from fastapi import FastAPI

from dplb_protocol.wire import WORKER_HEADER_B
from router import logtext
from router.answers import send_error
from router.asgi import ASGIApp, Message, Receive, Scope, Send
from router.config import Config, config_from_json
from router.control import build_fastapi
from router.errors import HeadersTooLarge, MethodNotAllowed, NoEligibleWorker
from router.logtext import LOG_FORMAT
from router.proxy import Proxy, ProxySettings
from router.server import LaterTask, check_headers
from router.state import RouterState

if TYPE_CHECKING:
    from dplb_shm import Segment
    from router.share_state import StateShare

#: every router log line: time, level, logger, message
log = logging.getLogger("dplb.router")
CONFIG_ENV = "DPLB_ROUTER_CONFIG_JSON"
POST_ONLY = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})


class HttpRouterState(RouterState):
    """The router's state with its HTTP edge: :meth:`start` builds the :class:`Proxy` on the
    state's :class:`~router.director.Director` (which writes the access lines here)."""

    access_log = True

    def __init__(self, cfg: Config, seg: Segment | None = None) -> None:
        super().__init__(cfg, seg)
        #: the hot path, None until :meth:`start`
        self.proxy: Proxy | None = None
        #: the load and placements shared with the routers on other nodes (``share.url``; None: off)
        self.share: StateShare | None = None

    async def start(self) -> None:
        """Start the state (:meth:`RouterState.start`), the sharing through Redis (``share.url``:
        caught up first), then build the proxy."""
        await super().start()
        cfg = self.cfg
        if cfg.share.url:
            from router.share_state import StateShare

            self.share = StateShare(self, cfg.share, self.events)
            await self.share.start()
        self.proxy = Proxy(self.scheduler, self.transport, self.metrics,
                           ProxySettings.from_config(cfg, self.policy.needs_text), self.director)

    async def stop(self) -> None:
        """Close the sharing (a goodbye: the others drop this router's load at once), then stop."""
        if self.share is not None:
            await self.share.close()
        await super().stop()


def proxied(path: str) -> bool:
    """Whether a ``POST`` to ``path`` goes to the :class:`Proxy` (``/v1/*``, ``/generate``)."""
    return path.startswith("/v1/") or path == "/generate"


class DPLBApp:
    """ASGI entry: request-head limits first (431, :mod:`router.server`), then hot proxy paths to
    :class:`Proxy`, everything else to FastAPI."""

    def __init__(self, state: HttpRouterState, fastapi_app: FastAPI) -> None:
        self.state = state
        self.fastapi = fastapi_app
        self.max_header_bytes = state.cfg.router.max_header_bytes
        self.max_headers = state.cfg.router.max_headers

    def start_request(self, scope: Scope, body: bytes) -> ASGIApp | LaterTask | None:
        """Start a ``POST`` whose whole ``body`` came in with its head, from the router's protocol
        callback (:class:`router.server.LimitedHttpToolsProtocol`): a proxied path within the
        head limits goes to :meth:`Proxy.start`, which writes it to its worker before the event
        loop turns. Returns the ASGI callable to run as the request's task instead of this app (or
        a :class:`router.server.LaterTask` that runs it only if needed), or None: serve the request through :meth:`__call__` (another path, the router starting,
        any error to answer)."""
        p = scope["path"]
        proxy = self.state.proxy
        if proxy is None or not proxied(p):
            return None
        try:
            check_headers(scope["headers"], self.max_header_bytes, self.max_headers)
        except HeadersTooLarge:
            return None
        return proxy.start(scope, body)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:  # ~1 µs for an ordinary request
                check_headers(scope["headers"], self.max_header_bytes, self.max_headers)
            except HeadersTooLarge as too_large:
                await send_error(send, too_large)
                return
        if scope["type"] == "http" and scope["method"] == "POST":
            p = scope["path"]
            if proxied(p):
                proxy = self.state.proxy
                if proxy is not None:
                    await proxy(scope, receive, send)
                    return
                await send_error(send, NoEligibleWorker("router is starting", reason="starting"))
                return
        elif scope["type"] == "http" and scope["path"] in POST_ONLY:
            refused = MethodNotAllowed(scope["method"], scope["path"])
            proxy = self.state.proxy
            if proxy is not None:
                await proxy.refuse(scope, send, refused)   # under a request id, with its access line
            else:
                await send_error(send, refused)
            return
        if scope["type"] != "http":
            await self.fastapi(scope, receive, send)
            return

        async def send_named(msg: Message) -> None:
            # control answers are the router's own: X-DPLB-Worker-ID: none (every response carries it)
            if msg["type"] == "http.response.start":
                hs = list(msg.get("headers", []))
                if not any(k.lower() == WORKER_HEADER_B for k, _ in hs):
                    hs.append((WORKER_HEADER_B, b"none"))
                msg = {**msg, "headers": hs}
            await send(msg)

        await self.fastapi(scope, receive, send_named)


def create_app(cfg: Config | None = None, seg: Segment | None = None) -> DPLBApp:
    """Build the ASGI app for ``cfg`` (defaults when None); ``seg`` injects an attached segment."""
    state = HttpRouterState(cfg or Config(), seg)
    return DPLBApp(state, build_fastapi(state))


def create_app_from_env() -> DPLBApp:
    """uvicorn factory for ``--workers`` > 1: the config comes from ``$DPLB_ROUTER_CONFIG_JSON``."""
    text = os.environ.get(CONFIG_ENV)
    cfg = config_from_json(text) if text else Config()
    # a spawned router process inherits no logging configuration: the parent's basicConfig set
    # only its own root logger, so the access lines and warnings of the processes went nowhere
    configure_logging(cfg.router.log_level)
    from router.processes import ignore_undocumented_signals

    ignore_undocumented_signals()   # each spawned process: SIGHUP/SIGUSR1/SIGUSR2 are not fatal
    return create_app(cfg)


def configure_logging(level: str) -> None:
    """The router's log format on the root logger (``level``: ``router.log_level``), each handler
    keeping every record on one line (:class:`router.logtext.OneLineFilter`); idempotent."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    logtext.install()
    # LOG_FORMAT shows no caller, thread or process: records skip looking them up (the Python
    # Logging HOWTO, "Optimization"; the frame walk was most of an access line's cost)
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
