"""Admin API: add, remove and drain workers at run time.

    POST   /dplb/workers                 {"endpoint": "host:port" | "/abs/agent.sock", "weight": 1.0, "model": null}
                                         (a remote node's agent, its control API on TCP: mirrored;
                                         requests then go to the engine address it publishes)
    DELETE /dplb/workers/{id}            remote mirror: slot released; local agent: no longer routed to
    POST   /dplb/workers/{id}/drain      no new requests; in-flight ones finish
    POST   /dplb/workers/{id}/undrain    back in rotation
    POST   /dplb/workers/{id}/restart    the worker's agent restarts its engine (202; also lifts a
                                         ``gave_up`` after too many crashes; 503 + Retry-After while
                                         the launcher restarts a dead agent)
    GET    /dplb/workers                 same rows as /dplb/status

Protection: by default only loopback clients may call these (403 otherwise;
``router.admin_loopback_only``), and when ``router.admin_token`` is set every call needs
``Authorization: Bearer <token>`` or ``X-DPLB-Admin-Token: <token>`` (401 otherwise). The router
refuses to start on a non-loopback address without a token (``router.__main__``). The client
address is the socket's, never a header's: a request carrying forwarding headers (``Forwarded``,
``X-Forwarded-For``, ``X-Real-IP``, ``Via``, ...) came through a proxy, where every client looks
like loopback, so it is not let in as loopback: it needs the token (403 when none is set).

Several router processes share the admin state through ``<state_dir>/admin.json`` (written
atomically, re-read by every process's health tick when its mtime changes). It is run-time state:
the last router process to exit removes it, and a restarted router starts from its config.
"""
from __future__ import annotations

import os
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from router.config import BackendServer
from router.errors import (
    BadRequest,
    Forbidden,
    NoEligibleWorker,
    NotFound,
    NotSupported,
    TransportError,
    Unauthorized,
    UpstreamError,
)

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
#: headers that reverse proxies add; their presence means the socket address is the proxy's
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
                      "via", "x-client-ip", "true-client-ip", "cf-connecting-ip")
#: seconds an agent restarted by the launcher takes to answer after its backoff (a Python start)
AGENT_START_S = 3


def _agent_restart_wait(seg: Any, wid: int, snap: Any) -> int | None:
    """Seconds until worker ``wid``'s new agent should answer when the launcher is restarting a dead
    one (its slot DEAD with reason ``agent_exited``, read now; ``snap`` when the read fails), else None."""
    from dplb_shm import StateReason, WorkerState, now_ns

    try:
        s = seg.read_slot(wid)
    except Exception:  # noqa: BLE001 - a closed or foreign segment: the last synced snapshot
        s = snap
    if s is None or int(s.state) != WorkerState.DEAD or int(s.state_reason) != StateReason.AGENT_EXITED:
        return None
    left = (int(s.next_restart_ns) - now_ns()) / 1e9 if int(s.next_restart_ns) else 0.0
    return max(1, int(left + 0.999) + AGENT_START_S)


class AdminStore:
    """The shared admin state: drained ids, removed ids, wanted mirrors (endpoint → spec)."""

    def __init__(self, state_dir: str) -> None:
        self.path = os.path.join(state_dir, "admin.json")
        self.state_dir = state_dir
        self.drained: set[int] = set()
        self.removed: set[int] = set()
        self.mirrors: dict[str, dict[str, Any]] = {}
        self._mtime = 0.0

    def save(self) -> None:
        """Write the state atomically (tmp file + rename)."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(orjson.dumps({"drained": sorted(self.drained), "removed": sorted(self.removed),
                                  "mirrors": self.mirrors}))
        os.replace(tmp, self.path)
        self._mtime = os.stat(self.path).st_mtime

    def reload_if_changed(self) -> bool:
        """Re-read the file when another process changed it; True when something was loaded."""
        try:
            m = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return False
        if m == self._mtime:
            return False
        try:
            with open(self.path, "rb") as f:
                d = orjson.loads(f.read())
        except (OSError, orjson.JSONDecodeError):
            return False
        self._mtime = m
        self.drained = set(d.get("drained", []))
        self.removed = set(d.get("removed", []))
        self.mirrors = dict(d.get("mirrors", {}))
        return True


def forwarded(request: Request) -> bool:
    """True when the request carries a header a proxy adds (it came through one)."""
    h = request.headers
    return any(k in h for k in FORWARDING_HEADERS)


def check_admin(request: Request, cfg: Any) -> None:
    """Raise Forbidden (non-loopback client while loopback-only; a proxied request without a
    configured token) or Unauthorized (missing or wrong token)."""
    client = request.client.host if request.client else ""
    if cfg.router.admin_loopback_only and client not in LOOPBACK:
        raise Forbidden("admin endpoints accept loopback clients only (router.admin_loopback_only)")
    tok = cfg.router.admin_token
    if not tok and forwarded(request):
        raise Forbidden("admin call through a proxy (forwarding headers present): set router.admin_token; "
                        "behind a proxy every client looks like loopback")
    if tok:
        given = request.headers.get("x-dplb-admin-token")
        auth = request.headers.get("authorization", "")
        if given != tok and auth != f"Bearer {tok}":
            raise Unauthorized("admin token required (Authorization: Bearer <token> or X-DPLB-Admin-Token)")


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json",
                    headers={"x-dplb-worker-id": "none"})


def admin_router(state: Any) -> APIRouter:
    """FastAPI routes of the admin API bound to the :class:`router.app.RouterState` ``state``."""
    r = APIRouter()

    @r.get("/dplb/workers")
    async def list_workers(request: Request) -> Response:
        check_admin(request, state.cfg)
        return _json({"workers": state.scheduler.status_rows()})

    @r.post("/dplb/workers")
    async def add_worker(request: Request) -> Response:
        check_admin(request, state.cfg)
        try:
            d = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            raise BadRequest("body must be JSON: {\"endpoint\": \"host:port\", \"weight\": 1.0}") from None
        if not isinstance(d, dict):
            raise BadRequest("body must be a JSON object")
        try:
            spec = BackendServer.model_validate(d)
        except ValidationError as e:
            # one line per field, without pydantic's title line and documentation links
            errs = e.errors()
            field = ".".join(str(x) for x in errs[0]["loc"]) if errs else "endpoint"
            msg = errs[0]["msg"] if errs else str(e)
            raise BadRequest(f"invalid worker: {field}: {msg}", param=field or "endpoint") from None
        if not spec.endpoint:
            raise BadRequest("'endpoint' is required (host:port or an absolute socket path)", param="endpoint")
        store: AdminStore = state.admin
        # a local worker that was removed earlier comes back by naming its agent's (or engine's) socket again
        for s in state.seg.snapshot():
            if int(s.state) != 0 and spec.endpoint in (s.endpoint, s.control) and s.worker_id in store.removed \
                    and spec.endpoint not in store.mirrors:
                store.removed.discard(s.worker_id)
                store.save()
                state.apply_admin()
                return _json({"worker_id": s.worker_id, "endpoint": spec.endpoint, "restored": True})
        store.mirrors[spec.endpoint] = {"weight": spec.weight, "model": spec.model}
        store.save()
        state.apply_admin()
        await state.mirrors.tick()
        state.monitor.sync()
        slot = state.mirrors.slot_of(spec.endpoint)
        return _json({"worker_id": slot, "endpoint": spec.endpoint, "mirrored": True}, 201)

    def _known(wid: int) -> Any:
        h = state.registry.handles.get(wid)
        if h is None and wid not in state.admin.removed:
            raise NotFound(f"no worker with id {wid}", param="id")
        return h

    @r.delete("/dplb/workers/{wid}")
    async def remove_worker(wid: int, request: Request) -> Response:
        check_admin(request, state.cfg)
        h = _known(wid)
        store: AdminStore = state.admin
        ep = h.control if h is not None else None   # a mirror is keyed by its agent's address
        if ep is not None and ep in store.mirrors:
            del store.mirrors[ep]
        else:
            store.removed.add(wid)
        store.drained.discard(wid)
        store.save()
        state.apply_admin()
        await state.mirrors.tick()
        state.monitor.sync()
        return _json({"worker_id": wid, "removed": True})

    @r.post("/dplb/workers/{wid}/restart")
    async def restart_worker(wid: int, request: Request) -> Response:
        """Ask worker ``wid``'s agent to restart its engine (``POST /dplb/restart`` on the agent).

        Sent to the worker's control address (its agent; the data endpoint is the engine's).
        202 with the agent's answer; 404 unknown worker; 501 when the endpoint has no restart API
        (not a DPLB agent); 503 + ``Retry-After`` when the agent died and the launcher is restarting
        it (its slot DEAD, reason ``agent_exited``: the new agent starts a fresh engine anyway);
        502 when the agent does not answer otherwise (the agent process itself is gone)."""
        check_admin(request, state.cfg)
        h = state.registry.handles.get(wid)
        if h is None:
            raise NotFound(f"no worker with id {wid}", param="id")
        try:
            status, body = await state.transport.get(h.control, "/dplb/restart", 10.0, method="POST")
        except TransportError as e:
            wait = _agent_restart_wait(state.registry.seg, wid, h.snap)
            if wait is not None:
                raise NoEligibleWorker(f"worker {wid}'s agent died and the launcher restarts it (in about {wait} s, "
                                       "with a fresh engine); retry then if still needed", reason="agent_restarting",
                                       retry_after=wait) from None
            raise UpstreamError(f"worker {wid}'s agent at {h.control} did not answer ({e.kind}); "
                                "the agent process itself may be gone", worker_id=wid) from None
        if status in (404, 405):
            raise NotSupported(f"worker {wid} at {h.control} has no restart API (not a DPLB agent)")
        try:
            d = orjson.loads(body)
        except orjson.JSONDecodeError:
            d = {}
        if status != 202:
            raise UpstreamError(f"worker {wid}'s agent refused the restart ({status}): "
                                f"{(d.get('error') or {}).get('message', body[:200])}", worker_id=wid)
        return _json({"worker_id": wid, "restarting": True, "state": d.get("state"),
                      "restarts": d.get("restarts")}, 202)

    @r.post("/dplb/workers/{wid}/drain")
    async def drain_worker(wid: int, request: Request) -> Response:
        check_admin(request, state.cfg)
        _known(wid)
        state.admin.drained.add(wid)
        state.admin.save()
        state.apply_admin()
        return _json({"worker_id": wid, "draining": True})

    @r.post("/dplb/workers/{wid}/undrain")
    async def undrain_worker(wid: int, request: Request) -> Response:
        check_admin(request, state.cfg)
        _known(wid)
        state.admin.drained.discard(wid)
        state.admin.save()
        state.apply_admin()
        return _json({"worker_id": wid, "draining": False})

    return r
