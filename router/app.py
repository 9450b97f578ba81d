"""The router application: shared state, control endpoints (FastAPI) and the ASGI entry point.

    app = create_app(cfg)          # ASGI callable served by uvicorn (uvloop + httptools)

Requests are dispatched in :class:`DPLBApp`: ``POST /v1/*`` and ``POST /generate`` go straight to
the raw-ASGI :class:`router.proxy.Proxy` (the hot path); everything else — ``GET /health``,
``GET /v1/models``, ``GET /dplb/status``, ``POST /dplb/route``, ``GET /metrics`` and the admin API
(:mod:`router.admin`) — is served by FastAPI. Errors anywhere are OpenAI-shaped JSON.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from collections.abc import MutableMapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.accounting import LearnSettings
from router.admin import AdminStore, admin_router
from router.config import Config, config_from_json, is_loopback
from router.errors import (
    BadRequest,
    HeadersTooLarge,
    NoEligibleWorker,
    NotFound,
    RouterError,
    TransportError,
    Unauthorized,
    UpstreamError,
    error_body,
)
from router.health import HealthMonitor
from router.ledger import AccountedSegment, Ledger, shares_dir, sweep_dead
from router.metrics import Metrics
from router.mirror import MirrorManager
from router.policies import build_policy
from router.protocol import parse_request
from router.proxy import Proxy, ProxySettings, send_error
from router.scheduling import Scheduler
from router.server import check_headers
from router.transport import Transport
from router.workers import Registry

#: every router log line: time, level, logger, message
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
log = logging.getLogger("dplb.router")
CONFIG_ENV = "DPLB_ROUTER_CONFIG_JSON"
POST_ONLY = frozenset({"/v1/chat/completions", "/v1/completions", "/generate"})
ENGINE_METRICS_TIMEOUT_S = 5.0
PROM_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def attach_segment(name: str, wait_s: float = 10.0) -> Any:
    """Attach to segment ``name``, waiting up to ``wait_s`` for it to be created.

    Raises ``dplb_shm.SegmentError`` (not found after the wait, or layout mismatch)."""
    from dplb_shm import Segment, SegmentNotFoundError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return Segment.attach(name)
        except SegmentNotFoundError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)


def remove_state_dir(path: str) -> None:
    """Remove the router's state files (admin.json, locks) and the directory if it is then empty.
    Admin changes (drain, remove, add) are run-time state: a restarted router starts from config."""
    for name in ("admin.json", "admin.lock", "mirror.lock", "mirror-slots.json", "scrape.lock",
                 "scrape-slots.json", "routers.lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, name))
    with contextlib.suppress(OSError):
        os.rmdir(shares_dir(path))   # empty once every process settled its ledger
    with contextlib.suppress(OSError):
        os.rmdir(path)


def ttft_params(cfg: Config) -> Any:
    """The estimated-TTFT kernel's parameters (``dplb_shm.TtftParams``) from the config."""
    from dplb_shm import TtftParams

    rp = cfg.routing_policy
    return TtftParams(prefill_rate=rp.prefill_tokens_per_s, waiting_tokens=float(rp.waiting_tokens),
                      step_tokens=float(rp.step_tokens),
                      step_base_s=rp.step_base_ms / 1e3, decode_seq_s=rp.decode_seq_ms / 1e3,
                      decode_ctx_s=rp.decode_ctx_ns / 1e9, kv_barrier_s=rp.kv_barrier_s, w_decode=rp.w_decode,
                      w_interf=rp.w_interf, w_miss=rp.w_miss,
                      kv_cache_threshold=rp.kv_cache_threshold, rate_band=rp.rate_band,
                      heartbeat_timeout_ms=float(cfg.health_check.heartbeat_timeout_ms))


def scoring_params(cfg: Config) -> Any:
    """The weighted kernel's parameters (``dplb_shm.ScoringParams``) from the config."""
    from dplb_shm import ScoringParams

    rp = cfg.routing_policy
    return ScoringParams(w_pending=rp.w_pending, w_kv=rp.w_kv, w_latency=rp.w_latency,
                         w_length=rp.w_length if rp.enable_length_compatibility else 0.0,
                         max_queue=rp.max_queue, kv_cache_threshold=rp.kv_cache_threshold,
                         heartbeat_timeout_ms=float(cfg.health_check.heartbeat_timeout_ms),
                         latency_scale_ms=rp.latency_scale_ms)


def learn_settings(cfg: Config) -> LearnSettings:
    """How observed TTFTs teach each worker's prefill rate (:class:`router.accounting.LearnSettings`)."""
    rp = cfg.routing_policy
    return LearnSettings(alpha=rp.rate_alpha, clip=rp.rate_clip, min_tokens=rp.rate_min_tokens,
                         step_tokens=float(rp.step_tokens), step_base_s=rp.step_base_ms / 1e3,
                         decode_seq_s=rp.decode_seq_ms / 1e3, decode_ctx_s=rp.decode_ctx_ns / 1e9)


class RouterState:
    """Everything one router process holds. ``seg``: an attached ``dplb_shm.Segment`` (attached
    from ``cfg.shm_name`` in :meth:`start` when None; closed in :meth:`stop` only if we attached)."""

    def __init__(self, cfg: Config, seg: Any = None) -> None:
        self.cfg = cfg
        self.seg = seg
        self._own_seg = seg is None
        self._router_lock: int | None = None
        #: this process's share of the router lines (:mod:`router.ledger`); None for a segment
        #: handed in (tests, the simulator): nobody else can sweep it then
        self.ledger: Ledger | None = None
        self.metrics = Metrics()
        self.started = int(time.time())
        #: model → ``max_model_len`` as one of its engines' ``GET /v1/models`` gave it (vLLM's field)
        self.model_lens: dict[str, int] = {}
        self.proxy: Proxy | None = None

    async def start(self) -> None:
        """Attach, build the pipeline, start the health monitor."""
        cfg = self.cfg
        if self.seg is None:
            try:
                self.seg = await asyncio.get_running_loop().run_in_executor(None, attach_segment, cfg.shm_name)
            except Exception as e:
                log.error("cannot attach segment %s: %s (create it first: dplb-shm create --name %s)",
                          cfg.shm_name, e, cfg.shm_name)
                raise
            self._hold_router_lock()
        rp = cfg.routing_policy
        self.params = scoring_params(cfg)
        self.ttft_params = ttft_params(cfg)
        self.policy = build_policy(rp.policy, rp, kernel=self.seg, params=self.params, ttft_params=self.ttft_params)
        self.transport = Transport(cfg.router.connect_timeout_s, cfg.router.first_byte_timeout_s,
                                   cfg.router.idle_timeout_s)
        self.registry = Registry(self.seg, cfg, on_leave=self._on_leave, on_circuit=self._on_circuit,
                                 on_reset=self._on_reset, is_mirror=self._is_mirror)
        hc = cfg.health_check
        self.monitor = HealthMonitor(self.registry, self.transport, self.metrics, hc.interval_ms, hc.timeout_ms,
                                     hc.max_failures, probes=hc.enabled)
        accounts = AccountedSegment(self.seg, self.ledger) if self.ledger is not None else None
        self.scheduler = Scheduler(self.registry, self.policy, self.seg, self.metrics, learn=learn_settings(cfg),
                                   default_rate=rp.prefill_tokens_per_s, health=self.monitor, accounts=accounts)
        self.admin = AdminStore(cfg.state_dir)
        self.admin.reload_if_changed()
        self.mirrors = MirrorManager(self.seg, self.transport, cfg.state_dir,
                                     timeout_s=max(0.2, hc.interval_ms / 1000.0), max_failures=hc.max_failures)
        self.apply_admin()
        self.monitor.extra = [self._admin_tick, self.mirrors.tick, self._sweep, self._sweep_routers]
        await self.mirrors.tick()
        self.monitor.start()
        self.metrics.attach(self)
        self.proxy = Proxy(self.scheduler, self.transport, self.metrics,
                           ProxySettings.from_config(cfg, bool(getattr(self.policy, "needs_text", True))))

    def _hold_router_lock(self) -> None:
        """Hold a shared ``flock`` on ``<state_dir>/routers.lock`` for this process's life and open
        this process's :class:`~router.ledger.Ledger`. The first router process of a deployment (no
        other one holds the lock) first gives back every share a killed router left (its ledger),
        then zeroes what is still counted on the router lines (in-flight, outstanding prefill,
        decoding requests) and every open circuit: no router can hold a lease then (issue 8,
        scenario 9). Later processes (``--workers k``) only take the shared lock; the shares of
        those that die are given back by the others' health ticks (:meth:`_sweep_routers`)."""
        os.makedirs(self.cfg.state_dir, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.cfg.state_dir, "routers.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # another router process is alive: its counts are real
        else:
            sweep_dead(self.seg, self.cfg.state_dir, everyone=True)
            for snap in self.seg.snapshot():
                wid = snap.worker_id
                if snap.router_inflight:
                    self.seg.router_inflight_add(wid, -int(snap.router_inflight))
                line = self.seg.router_line(wid)
                if line["prefill_tokens"]:
                    self.seg.prefill_add(wid, -int(line["prefill_tokens"]))
                if line["decode_reqs"] or line["decode_ctx_tokens"]:
                    self.seg.decode_add(wid, -int(line["decode_reqs"]), -int(line["decode_ctx_tokens"]))
                if snap.circuit:  # a dead router's open circuit would exclude the worker forever
                    self.seg.circuit_set(wid, 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._router_lock = fd
        self.ledger = Ledger(self.cfg.state_dir, self.seg.num_slots)

    async def _sweep_routers(self) -> None:
        """Health-tick extra: give back the share of every router process of this deployment that
        died (:func:`router.ledger.sweep_dead`), within one tick of its death."""
        if self.ledger is not None:
            sweep_dead(self.seg, self.cfg.state_dir)

    async def stop(self) -> None:
        """Stop background work, close pools, release mirror slots, detach."""
        await self.monitor.stop()
        self.mirrors.close()
        await self.transport.close()
        if self.ledger is not None:
            self.ledger.close(self.seg)   # a lease the stop cut: its share goes back too
        if self._router_lock is not None:
            fd, self._router_lock = self._router_lock, None
            try:  # the last router process of the deployment removes the shared state directory
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass  # another router process still runs
            else:
                remove_state_dir(self.cfg.state_dir)
            finally:
                os.close(fd)
        if self._own_seg and self.seg is not None:
            self.seg.close()

    def apply_admin(self) -> None:
        """Push the admin store into the registry and the mirror manager."""
        a = self.admin
        self.registry.drained = set(a.drained)
        self.registry.removed = set(a.removed)
        for wid, h in self.registry.handles.items():
            h.drained = wid in a.drained
        wanted = {b.endpoint: {"weight": b.weight, "model": b.model} for b in self.cfg.backend_servers
                  if b.endpoint not in a.unmirrored}
        wanted.update(a.mirrors)
        self.mirrors.wanted = wanted
        self.mirrors.version = a.version

    async def _sweep(self) -> None:
        """Health-tick extra: non-streamed requests past their estimated TTFT leave prefill; the
        coalesced request counters reach prometheus_client (:meth:`Metrics.flush`)."""
        self.scheduler.sweep()
        self.metrics.flush()

    async def _admin_tick(self) -> None:
        if self.admin.reload_if_changed():
            self.apply_admin()
        for h in self.registry.handles.values():
            h.mirror = h.control in self.mirrors.wanted

    def _on_leave(self, wid: int, endpoint: str) -> None:
        self.policy.forget(wid)
        self.metrics.forget_worker(wid)
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self.transport.forget(endpoint))

    def _is_mirror(self, control: str) -> bool:
        """Is ``control`` a remote agent this router mirrors (config or admin)?"""
        m = getattr(self, "mirrors", None)
        return m is not None and control in m.wanted

    def _on_reset(self, wid: int) -> None:
        """Worker ``wid``'s engine died or was restarted: its prefix cache is gone."""
        self.policy.forget(wid)

    def _on_circuit(self, wid: int, state: int) -> None:
        try:
            self.seg.circuit_set(wid, state)
        except Exception:  # noqa: BLE001 - slot may be gone
            log.debug("circuit_set(%d) failed", wid)
        if state == 1:
            log.warning("circuit of worker %d opened", wid)


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    h = {"x-dplb-worker-id": "none"}
    if headers:
        h.update(headers)
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=h)


def _error(e: RouterError) -> Response:
    h = {"x-dplb-worker-id": "none", **e.headers}
    return Response(e.body(), status_code=e.status, media_type="application/json", headers=h)


def build_fastapi(state: RouterState) -> FastAPI:
    """The FastAPI app of the control endpoints, bound to ``state`` (started in its lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="DPLB router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RouterError)
    async def _router_error(_: Request, e: RouterError) -> Response:
        return _error(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        t = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return Response(error_body(str(e.detail), t, e.status_code), status_code=e.status_code,
                        media_type="application/json", headers={"x-dplb-worker-id": "none"})

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
                        status_code=500, media_type="application/json", headers={"x-dplb-worker-id": "none"})

    def check_key(request: Request) -> None:
        key = state.cfg.router.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            raise Unauthorized("invalid or missing API key (Authorization: Bearer <key>)")

    def check_observer(request: Request) -> None:
        """The read-only pages that show the deployment (``/dplb/status``: socket paths, pids;
        ``/metrics``; the engines' pages and the Prometheus targets): open while the router
        listens on loopback only; beyond loopback they need ``router.api_key`` or
        ``router.admin_token`` (``Authorization: Bearer <either>`` or ``X-DPLB-Admin-Token``) —
        such a router always has an admin token (``router.__main__`` refuses to start without)."""
        if is_loopback(state.cfg.router.host):
            return
        r = state.cfg.router
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

    async def model_card(m: str) -> dict[str, Any]:
        card: dict[str, Any] = {"id": m, "object": "model", "created": state.started, "owned_by": "dplb",
                                "root": m, "parent": None}
        n = await model_len(m)
        if n is not None:
            card["max_model_len"] = n
        return card

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """OpenAI's model list, with vLLM's ``root``, ``parent`` and ``max_model_len`` (asked of
        one engine per model, once) where the engines give it."""
        check_key(request)
        data = list(await asyncio.gather(*(model_card(m) for m in state.scheduler.models())))
        return _json({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        check_key(request)
        if model_id not in state.scheduler.models():
            raise NotFound(f"the model '{model_id}' does not exist (served: {state.scheduler.served()})", param="model")
        return _json(await model_card(model_id))

    @app.get("/get_loads")
    async def get_loads(request: Request) -> Response:
        """SGLang router's ``GET /get_loads`` (sgl-router ``WorkerLoadsResult``): ``{"loads":
        [{"worker", "worker_id", "load", "running", "waiting", "kv_cache_usage"}], "total_workers",
        "successful", "failed"}``; ``load`` is the requests every router has in flight on the worker
        (the router line), ``running``/``waiting`` the engine's own counts from the slot.
        Guarded like ``/dplb/status``."""
        check_observer(request)
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
        check_key(request)

        async def one(h: Any) -> dict[str, Any]:
            body = orjson.dumps({"model": h.model or "default", "prompt": "ping", "max_tokens": 1})
            out: dict[str, Any] = {"id": h.worker_id, "endpoint": h.endpoint, "model": h.model}
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

    @app.get("/dplb/status")
    async def status(request: Request) -> Response:
        check_observer(request)
        return _json({"policy": state.policy.name, "segment": state.seg.name, "generation": state.seg.generation,
                      "pid": os.getpid(), "workers": state.scheduler.status_rows(),
                      "models": state.scheduler.model_rows()})

    @app.post("/dplb/route")
    async def route(request: Request) -> Response:
        check_key(request)
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
        check_observer(request)
        body, ctype = state.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/dplb/workers/{wid}/metrics")
    async def worker_metrics(wid: int, request: Request) -> Response:
        """The engine's own Prometheus page of worker ``wid`` (read from the engine at the slot's
        endpoint, one hop), so a Prometheus server that reaches the router scrapes every engine."""
        check_observer(request)
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
        return Response(body, media_type=PROM_TEXT, headers={"x-dplb-worker-id": str(wid)})

    @app.get("/dplb/prometheus/targets")
    async def prometheus_targets(request: Request) -> Response:
        """Prometheus HTTP service discovery (``http_sd_configs``): one target per listed worker,
        scraped at ``/dplb/workers/<id>/metrics`` on this router (the address the request came
        to), labelled ``worker`` and ``model``."""
        check_observer(request)
        host = request.headers.get("host") or f"{state.cfg.router.host}:{state.cfg.router.port}"
        groups = [{"targets": [host], "labels": {"__metrics_path__": f"/dplb/workers/{wid}/metrics",
                                                 "worker": str(wid), "model": h.model or ""}}
                  for wid, h in sorted(state.registry.handles.items())]
        return _json(groups)

    app.include_router(admin_router(state))
    return app


#: seconds an engine has to list its models (``max_model_len``) for ``/v1/models``
MODEL_INFO_TIMEOUT_S = 2.0
#: seconds one engine has for ``/health_generate``'s one-token generation
HEALTH_GENERATE_TIMEOUT_S = 20.0


def proxied(path: str) -> bool:
    """Whether a ``POST`` to ``path`` goes to the :class:`Proxy` (``/v1/*``, ``/generate``)."""
    return path.startswith("/v1/") or path == "/generate"


class DPLBApp:
    """ASGI entry: request-head limits first (431, :mod:`router.server`), then hot proxy paths to
    :class:`Proxy`, everything else to FastAPI."""

    def __init__(self, state: RouterState, fastapi_app: FastAPI) -> None:
        self.state = state
        self.fastapi = fastapi_app
        self.max_header_bytes = state.cfg.router.max_header_bytes
        self.max_headers = state.cfg.router.max_headers

    def start_request(self, scope: MutableMapping[str, Any], body: bytes) -> Any:
        """Start a ``POST`` whose whole ``body`` came in with its head, from the router's protocol
        callback (:class:`router.server.LimitedHttpToolsProtocol`): a proxied path within the
        head limits goes to :meth:`Proxy.start`, which writes it to its worker before the event
        loop turns. Returns the ASGI callable to run as the request's task instead of this app,
        or None: serve the request through :meth:`__call__` (another path, the router starting,
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

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
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
                e = NoEligibleWorker("router is starting", reason="starting")
                await send({"type": "http.response.start", "status": e.status,
                            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                        (b"x-dplb-worker-id", b"none")]})
                await send({"type": "http.response.body", "body": e.body()})
                return
        elif scope["type"] == "http" and scope["path"] in POST_ONLY:
            body = error_body(f"method {scope['method']} not allowed on {scope['path']}; use POST",
                              "invalid_request_error", 405)
            await send({"type": "http.response.start", "status": 405,
                        "headers": [(b"content-type", b"application/json"), (b"allow", b"POST"),
                                    (b"content-length", str(len(body)).encode()), (b"x-dplb-worker-id", b"none")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] != "http":
            await self.fastapi(scope, receive, send)
            return

        async def send_named(msg: MutableMapping[str, Any]) -> None:
            # control answers are the router's own: X-DPLB-Worker-ID: none (every response carries it)
            if msg["type"] == "http.response.start":
                hs = list(msg.get("headers", []))
                if not any(k.lower() == b"x-dplb-worker-id" for k, _ in hs):
                    hs.append((b"x-dplb-worker-id", b"none"))
                msg = {**msg, "headers": hs}
            await send(msg)

        await self.fastapi(scope, receive, send_named)


def create_app(cfg: Config | None = None, seg: Any = None) -> DPLBApp:
    """Build the ASGI app for ``cfg`` (defaults when None); ``seg`` injects an attached segment."""
    state = RouterState(cfg or Config(), seg)
    return DPLBApp(state, build_fastapi(state))


def create_app_from_env() -> DPLBApp:
    """uvicorn factory for ``--workers`` > 1: the config comes from ``$DPLB_ROUTER_CONFIG_JSON``."""
    text = os.environ.get(CONFIG_ENV)
    cfg = config_from_json(text) if text else Config()
    # a spawned router process inherits no logging configuration: the parent's basicConfig set
    # only its own root logger, so the access lines and warnings of the processes went nowhere
    configure_logging(cfg.router.log_level)
    return create_app(cfg)


def configure_logging(level: str) -> None:
    """The router's log format on the root logger (``level``: ``router.log_level``); idempotent."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
