"""The router's control API (FastAPI): ``GET /health``, ``GET /v1/models``, ``GET /dplb/status``,
``POST /dplb/route``, ``GET /metrics``, the engines' pages, SGLang router's ``/get_loads`` and
``/health_generate``, and the admin API (:mod:`router.admin`), all bound to one
:class:`router.state.RouterState`. Errors are OpenAI-shaped JSON; every answer carries
``X-DPLB-Worker-ID: none``. The hot path (``POST /v1/*``) never comes here (:mod:`router.app`).
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
from typing import TYPE_CHECKING

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dplb_protocol.wire import WORKER_HEADER, parse_request
from router import access_log
from router.admin import admin_router
from router.config import Config, is_loopback
from router.errors import (
    BadRequest,
    NotFound,
    RouterError,
    TransportError,
    Unauthorized,
    UpstreamError,
    error_body,
)
from router.metrics_port import start_metrics_port
from router.state import RouterState

if TYPE_CHECKING:
    from router.workers import WorkerHandle

log = logging.getLogger("dplb.router")
ENGINE_METRICS_TIMEOUT_S = 5.0
PROM_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    h = {WORKER_HEADER: "none"}
    if headers:
        h.update(headers)
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=h)


def _error(e: RouterError) -> Response:
    h = {WORKER_HEADER: "none", **e.headers}
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=h)


#: seconds an engine has to list its models (``max_model_len``) for ``/v1/models``
MODEL_INFO_TIMEOUT_S = 2.0
#: seconds one engine has for ``/health_generate``'s one-token generation
HEALTH_GENERATE_TIMEOUT_S = 20.0


def check_key(request: Request, cfg: Config) -> None:
    """Raise Unauthorized unless the request carries the API key (when ``router.api_key`` is set)."""
    key = cfg.router.api_key
    if key and request.headers.get("authorization") != f"Bearer {key}":
        raise Unauthorized("invalid or missing API key (Authorization: Bearer <key>)")


def check_observer(request: Request, cfg: Config) -> None:
    """The read-only pages that show the deployment (``/dplb/status``: socket paths, pids;
    ``/metrics``; the engines' pages and the Prometheus targets): open while the router
    listens on loopback only; beyond loopback they need ``router.api_key`` or
    ``router.admin_token`` (``Authorization: Bearer <either>`` or ``X-DPLB-Admin-Token``) —
    such a router always has an admin token (``router.__main__`` refuses to start without)."""
    if is_loopback(cfg.router.host):
        return
    r = cfg.router
    auth = request.headers.get("authorization", "")
    if r.api_key and auth == f"Bearer {r.api_key}":
        return
    if r.admin_token and (auth == f"Bearer {r.admin_token}"
                          or request.headers.get("x-dplb-admin-token") == r.admin_token):
        return
    if not r.api_key and not r.admin_token:
        return
    raise Unauthorized("this router listens beyond loopback: /metrics, /dplb/status and the engines' pages "
                       "need the API key or the admin token (Authorization: Bearer <key>)")


def build_fastapi(state: RouterState) -> FastAPI:
    """The FastAPI app of the control endpoints, bound to ``state`` (started in its lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        mport = None
        try:
            mport = await start_metrics_port(state.cfg, app)   # metrics.port (router/metrics_port.py)
            # what start-up built (modules, the app, the state) lives as long as the process: out
            # of the collector's sight, so that its full passes walk only what requests allocate
            # (gc.freeze, CPython's gc docs; a full pass over the ~60k start-up objects took tens
            # of ms of the event loop, a stall every stream on this process felt)
            gc.collect()
            gc.freeze()
            yield
        finally:
            if mport is not None:
                await mport.stop()
            await state.stop()
            access_log.flush()   # the lines still waiting for their batch's write

    app = FastAPI(title="DPLB router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    _error_handlers(app)
    _model_routes(app, state)
    _sglang_routes(app, state)
    _dplb_routes(app, state)
    app.include_router(admin_router(state))
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error shape with ``X-DPLB-Worker-ID: none``: the router's own
    errors, FastAPI's 404/405, its validation errors (400, ``param`` named as documented) and
    anything unexpected (500, logged)."""

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, e: RouterError) -> Response:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        t = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return Response(error_body(str(e.detail), t, e.status_code), status_code=e.status_code,
                        media_type="application/json", headers={WORKER_HEADER: "none"})

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> Response:
        errs = e.errors()
        parts = [str(x) for x in errs[0].get("loc", ())] if errs else []
        if parts and parts[0] in ("path", "query", "body", "header"):
            parts = parts[1:]   # FastAPI's location kind is not part of the parameter's name
        loc = ".".join(parts) or None
        if loc == "wid":
            loc = "id"      # the path parameter's name in the API's documentation (/dplb/workers/{id})
        return _error(BadRequest(f"invalid request: {errs[0].get('msg') if errs else e}", param=loc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> Response:
        log.exception("unexpected error")
        return Response(error_body(f"internal router error: {type(e).__name__}", "internal_error", 500),
                        status_code=500, media_type="application/json", headers={WORKER_HEADER: "none"})


def _model_routes(app: FastAPI, state: RouterState) -> None:
    """``GET /health`` and OpenAI's model list (``GET /v1/models``, ``GET /v1/models/{id}``)."""

    @app.get("/health")
    async def health() -> Response:
        n = len(state.scheduler.ready_handles())
        if n:
            return _json({"status": "ok", "ready_workers": n})
        return _json({"status": "unavailable", "ready_workers": 0}, 503, {"retry-after": "1"})

    async def model_len(m: str) -> int | None:
        """vLLM's ``max_model_len`` of model ``m``: what one of its engines' ``GET /v1/models``
        says (cached once known); None while no engine of it answers with one."""
        if m in state.model_lens:
            return state.model_lens[m]
        for h in [h for _, h in sorted(state.registry.handles.items()) if h.model == m][:2]:
            try:
                status, body = await state.transport.get(h.endpoint, "/v1/models", MODEL_INFO_TIMEOUT_S)
                if status != 200:
                    continue
                rows = orjson.loads(body).get("data") or []
                row = next((x for x in rows if x.get("id") == m), rows[0] if len(rows) == 1 else None)
                n = row.get("max_model_len") if isinstance(row, dict) else None
            except (TransportError, orjson.JSONDecodeError, AttributeError):
                continue
            if isinstance(n, int) and n > 0:
                state.model_lens[m] = n
                return n
        return None

    async def model_card(m: str) -> dict[str, object]:
        card: dict[str, object] = {"id": m, "object": "model", "created": state.started, "owned_by": "dplb",
                                "root": m, "parent": None}
        n = await model_len(m)
        if n is not None:
            card["max_model_len"] = n
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """OpenAI's model list, with vLLM's ``root``, ``parent`` and ``max_model_len`` (asked of
        one engine per model, once) where the engines give it."""
        check_key(request, state.cfg)
        data = list(await asyncio.gather(*(model_card(m) for m in state.scheduler.models())))
        return _json({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        check_key(request, state.cfg)
        if model_id not in state.scheduler.models():
            raise NotFound(f"the model '{model_id}' does not exist (served: {state.scheduler.served()})", param="model")
        return _json(await model_card(model_id))


def _sglang_routes(app: FastAPI, state: RouterState) -> None:
    """SGLang router's ``GET /get_loads`` and ``GET /health_generate``."""

    @app.get("/get_loads")
    async def get_loads(request: Request) -> Response:
        """SGLang router's ``GET /get_loads`` (sgl-router ``WorkerLoadsResult``): ``{"loads":
        [{"worker", "worker_id", "load", "running", "waiting", "kv_cache_usage"}], "total_workers",
        "successful", "failed"}``; ``load`` is the requests every router has in flight on the worker
        (the router line), ``running``/``waiting`` the engine's own counts from the slot.
        Guarded like ``/dplb/status``."""
        check_observer(request, state.cfg)
        loads = [{"worker": w["endpoint"], "worker_id": w["id"], "load": w["router_inflight"] or 0,
                  "running": w["running"], "waiting": w["waiting"], "kv_cache_usage": w["kv_cache_usage"]}
                 for w in state.scheduler.status_rows()]
        return _json({"loads": loads, "total_workers": len(loads), "successful": len(loads), "failed": 0})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """SGLang's ``GET /health_generate``: a one-token generation on every worker this router
        routes to (straight to its engine, not counted as traffic); 200 ``{"status": "ok",
        "workers": [...]}`` when at least one generated, 503 otherwise, per worker ``ok`` and
        ``status`` or ``error``. Needs the API key when one is set (it makes the engines work)."""
        check_key(request, state.cfg)

        async def one(h: WorkerHandle) -> dict[str, object]:
            body = orjson.dumps({"model": h.model or "default", "prompt": "ping", "max_tokens": 1})
            out: dict[str, object] = {"id": h.worker_id, "endpoint": h.endpoint, "model": h.model}
            try:
                up = await state.transport.send(h.endpoint, "POST", "/v1/completions",
                                                [(b"content-type", b"application/json")], body,
                                                timeout_s=HEALTH_GENERATE_TIMEOUT_S)
                await up.read()
            except TransportError as e:
                return {**out, "ok": False, "error": f"{e.kind}: {e}"}
            return {**out, "ok": up.status == 200, "status": up.status}

        ready = state.scheduler.ready_handles()
        results = list(await asyncio.gather(*(one(h) for h in ready)))
        good = any(x["ok"] for x in results)
        return _json({"status": "ok" if good else "unavailable", "workers": results},
                     200 if good else 503, None if good else {"retry-after": "1"})


def _dplb_routes(app: FastAPI, state: RouterState) -> None:
    """``GET /dplb/status``, ``POST /dplb/route``, ``GET /metrics``, the engines' pages
    (``/dplb/workers/{id}/metrics``) and the Prometheus targets."""

    @app.get("/dplb/status")
    async def status(request: Request) -> Response:
        check_observer(request, state.cfg)
        return _json({"policy": state.policy.name, "segment": state.seg.name, "generation": state.seg.generation,
                      "pid": os.getpid(), "workers": state.scheduler.status_rows(),
                      "models": state.scheduler.model_rows(), "admission": state.admission.status()})

    @app.post("/dplb/route")
    async def route(request: Request) -> Response:
        check_key(request, state.cfg)
        body = await request.body()
        path = request.query_params.get("path", "/v1/chat/completions")
        try:
            info = parse_request(path, body, True)
        except BadRequest:
            if path == "/v1/chat/completions" and b'"prompt"' in body:
                info = parse_request("/v1/completions", body, True)
            else:
                raise
        state.monitor.sync_if_changed()
        h, d = state.scheduler.decide(info, explain=True)
        return _json({"worker_id": d.worker_id, "policy": state.policy.name, "reason": d.reason,
                      "endpoint": h.endpoint, "scores": d.scores})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        check_observer(request, state.cfg)
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/dplb/workers/{wid}/metrics")
    async def worker_metrics(wid: int, request: Request) -> Response:
        """The engine's own Prometheus page of worker ``wid`` (read from the engine at the slot's
        endpoint, one hop), so a Prometheus server that reaches the router scrapes every engine."""
        check_observer(request, state.cfg)
        h = state.registry.handles.get(wid)
        if h is None:
            raise NotFound(f"no worker with id {wid}", param="id")
        try:
            status, body = await state.transport.get(h.endpoint, "/metrics", ENGINE_METRICS_TIMEOUT_S)
        except TransportError as e:
            raise UpstreamError(f"worker {wid} at {h.endpoint} did not answer GET /metrics ({e.kind})",
                                worker_id=wid) from None
        if status != 200:
            raise UpstreamError(f"worker {wid}'s engine answered GET /metrics with {status}", worker_id=wid)
        return Response(body, media_type=PROM_TEXT, headers={WORKER_HEADER: str(wid)})

    @app.get("/dplb/prometheus/targets")
    async def prometheus_targets(request: Request) -> Response:
        """Prometheus HTTP service discovery (``http_sd_configs``): one target per listed worker,
        scraped at ``/dplb/workers/<id>/metrics`` on this router (the address the request came
        to), labelled ``worker`` and ``model``."""
        check_observer(request, state.cfg)
        host = request.headers.get("host") or f"{state.cfg.router.host}:{state.cfg.router.port}"
        groups = [{"targets": [host], "labels": {"__metrics_path__": f"/dplb/workers/{wid}/metrics",
                                                 "worker": str(wid), "model": h.model or ""}}
                  for wid, h in sorted(state.registry.handles.items())]
        return _json(groups)
