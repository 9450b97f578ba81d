"""Admin API: add, remove and drain workers at run time.

    POST   /dplb/workers                 {"endpoint": "host:port" | "/abs/agent.sock", "weight": 1.0, "model": null}
                                         (a remote node's agent, its control API on TCP: mirrored;
                                         requests then go to the engine address it publishes)
                                         201 {"worker_id": N, "created": true}: mirrored in slot N (a
                                           201 always names a slot);
                                         200 {"worker_id": N, "created": false}: already mirrored in
                                           slot N (nothing changed: a retried POST is harmless; to
                                           change its weight, DELETE then POST);
                                         200 {"worker_id": N, "restored": true}: a removed local
                                           worker's socket named again: routed to again;
                                         400 a malformed body, or a host name that does not
                                           resolve here (``getaddrinfo``, at most 5 s; nothing changed);
                                         409 the address is a local worker's that is not removed, or a
                                           concurrent DELETE undid the add before it got a slot;
                                         503 + Retry-After no free slot (nothing changed); 202 {"worker_id": null,
                                           "pending": true} when the mirroring process did not apply
                                           it within ``MIRROR_WAIT_S`` (another router process)
    DELETE /dplb/workers/{id}            200 {"removed": true}: remote mirror: its slot is EMPTY when
                                         the answer leaves (the mirror is no longer wanted); local
                                         agent: no longer routed to; 404 (OpenAI error shape) an
                                         unknown id, an EMPTY slot or one already removed; 202
                                         {"released": false} as for POST
    POST   /dplb/workers/{id}/drain      no new requests; in-flight ones finish
    POST   /dplb/workers/{id}/undrain    back in rotation
    POST   /dplb/workers/{id}/restart    the worker's agent restarts its engine (202; also lifts a
                                         ``gave_up`` after too many crashes; 503 + Retry-After while
                                         the launcher restarts a dead agent)
    GET    /dplb/workers                 same rows as /dplb/status

SGLang router's names for the same calls (aliases, same protection): ``POST /add_worker?url=``,
``POST /remove_worker?url=``, ``GET /list_workers`` (``{"urls": [...]}``) and ``POST /flush_cache``
(fanned out to every engine: ``/flush_cache``, else vLLM's ``/reset_prefix_cache``; sgl-router's
``FlushCacheResult`` shape).

Protection: by default only loopback clients may call these (403 otherwise;
``router.admin_loopback_only``), and when ``router.admin_token`` is set every call needs
``Authorization: Bearer <token>`` or ``X-DPLB-Admin-Token: <token>`` (401 otherwise). The router
refuses to start on a non-loopback address without a token (``router.__main__``). The client
address is the socket's, never a header's: a request carrying forwarding headers (``Forwarded``,
``X-Forwarded-For``, ``X-Real-IP``, ``Via``, ...) came through a proxy, where every client looks
like loopback, so it is not let in as loopback: it needs the token (403 when none is set).

Several router processes share the admin state through ``<state_dir>/admin.json``. Every change
is a read-modify-write under an exclusive ``flock`` on ``<state_dir>/admin.lock`` that bumps the
file's ``version`` (:meth:`AdminStore.edit`: concurrent calls through different processes never
lose each other's changes); every process's health tick re-reads the file when its inode or
mtime changes. Mirror slots have one owner (:mod:`router.mirror`): an add or remove answered by
that process is applied before it answers; one answered by another process waits until the
owner's record shows its version applied. It is run-time state: the last router process to exit
removes it, and a restarted router starts from its config.
"""
from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, cast

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from dplb_protocol.wire import WORKER_HEADER
from dplb_shm import StateReason, WorkerSnapshot
from router.config import BackendServer, Config
from router.errors import (
    BadRequest,
    Conflict,
    Forbidden,
    NoEligibleWorker,
    NoFreeSlot,
    NotFound,
    NotSupported,
    TransportError,
    Unauthorized,
    UpstreamError,
)
from router.state import RouterState
from router.transport import Transport
from router.workers import DEAD, EMPTY, WorkerHandle

if TYPE_CHECKING:
    from dplb_shm import Segment

LOOPBACK = {"127.0.0.1", "::1", "localhost"}
#: headers that reverse proxies add; their presence means the socket address is the proxy's
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
                      "via", "x-client-ip", "true-client-ip", "cf-connecting-ip")
#: seconds one engine has to answer the ``/flush_cache`` fan-out
FLUSH_TIMEOUT_S = 30.0
#: seconds ``POST /dplb/workers`` waits for a host name to resolve before it answers 400
RESOLVE_TIMEOUT_S = 5.0
#: seconds an agent restarted by the launcher takes to answer after its backoff (a Python start)
AGENT_START_S = 3


def _agent_restart_wait(seg: Segment, wid: int, snap: WorkerSnapshot | None) -> int | None:
    """Seconds until worker ``wid``'s new agent should answer when the launcher is restarting a dead
    one (its slot DEAD with reason ``agent_exited``, read now; ``snap`` when the read fails), else None."""
    from dplb_shm import now_ns

    s: WorkerSnapshot | None
    try:
        s = seg.read_slot(wid)
    except Exception:  # noqa: BLE001 - a closed or foreign segment: the last synced snapshot
        s = snap
    if s is None or int(s.state) != DEAD or s.state_reason != StateReason.AGENT_EXITED:
        return None
    left = (s.next_restart_ns - now_ns()) / 1e9 if s.next_restart_ns else 0.0
    return max(1, int(left + 0.999) + AGENT_START_S)


#: seconds an admin add/remove answered by a process that does not own the mirror slots waits for
#: the owner to apply it (it does at its next health tick)
MIRROR_WAIT_S = 10.0


def forwarded(request: Request) -> bool:
    """True when the request carries a header a proxy adds (it came through one)."""
    h = request.headers
    return any(k in h for k in FORWARDING_HEADERS)


def check_admin(request: Request, cfg: Config) -> None:
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


async def check_resolves(endpoint: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> None:
    """Refuse a ``host:port`` whose host does not resolve (``getaddrinfo`` in a worker thread,
    at most ``timeout_s``): mirroring it could only give a slot that turns DEAD. Socket paths and
    IP literals pass as they are.

    Raises:
        BadRequest: the name does not resolve (the resolver's words), or not within ``timeout_s``.
    """
    if endpoint.startswith("/"):
        return
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        await asyncio.wait_for(asyncio.to_thread(socket.getaddrinfo, host, int(port), type=socket.SOCK_STREAM),
                               timeout_s)
    except TimeoutError:
        raise BadRequest(f"host {host!r} of {endpoint} did not resolve within {timeout_s:g} s; give a name this "
                         "router's node resolves, or an IP address", param="endpoint") from None
    except (socket.gaierror, UnicodeError) as e:
        words = e.strerror if isinstance(e, socket.gaierror) and e.strerror else str(e)
        raise BadRequest(f"host {host!r} of {endpoint} does not resolve ({words}); give a name this router's node "
                         "resolves, or an IP address", param="endpoint") from None


#: seconds each question that tells a DPLB agent from a plain engine (``endpoint_kind``) may take
KIND_TIMEOUT_S = 5.0


async def endpoint_kind(transport: Transport, endpoint: str, timeout_s: float = KIND_TIMEOUT_S) -> tuple[str, str | None]:
    """What answers at the TCP ``endpoint`` (``host:port``), as ``(kind, model)``:

    - ``("agent", None)``: a DPLB agent's control API (``GET /dplb/state`` answers a JSON object
      with a ``state``): mirrored from its state;
    - ``("engine", model)``: a plain OpenAI-compatible engine without an agent (vLLM, SGLang, any
      OpenAI server: ``GET /v1/models`` answers a model list; ``model`` the first one's ``id``,
      None when it lists none): probed and scraped by the router (:meth:`MirrorManager.scrape_one`);
    - ``("unreachable", None)``: nothing answers now: mirrored as an agent, as before (DEAD until
      one answers there).

    Raises:
        BadRequest: something answers HTTP there, but as neither (the message says what each of
            the two paths answered).
    """
    try:
        st, body = await transport.get(endpoint, "/dplb/state", timeout_s)
    except TransportError:
        return "unreachable", None
    d = _loads(body) if st == 200 else None
    if isinstance(d, dict) and "state" in d:
        return "agent", None
    try:
        st2, body2 = await transport.get(endpoint, "/v1/models", timeout_s)
    except TransportError as e:
        raise BadRequest(f"{endpoint} is not a DPLB agent (GET /dplb/state answered {st}) and did not answer "
                         f"GET /v1/models ({e.kind}): give a DPLB agent's control address or an OpenAI-compatible "
                         "engine's address (vLLM, SGLang)", param="endpoint") from None
    d2 = _loads(body2) if st2 == 200 else None
    data = d2.get("data") if isinstance(d2, dict) else None
    if isinstance(data, list):
        ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        return "engine", (ids[0] if ids else None)
    raise BadRequest(f"{endpoint} is neither a DPLB agent's control address (GET /dplb/state answered {st}) nor "
                     f"an OpenAI-compatible engine (GET /v1/models answered {st2}, without a model list)",
                     param="endpoint")


def _loads(body: bytes) -> object:
    """``body`` as JSON, None when it is not JSON."""
    try:
        return cast(object, orjson.loads(body))
    except orjson.JSONDecodeError:
        return None


def _json(obj: object, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json",
                    headers={WORKER_HEADER: "none"})


def admin_router(state: RouterState) -> APIRouter:
    """FastAPI routes of the admin API bound to the :class:`router.state.RouterState` ``state``."""
    r = APIRouter()
    _worker_routes(r, state)
    _sglang_routes(r, state)
    _lifecycle_routes(r, state)
    return r


def _worker_routes(r: APIRouter, state: RouterState) -> None:
    """``GET``/``POST /dplb/workers`` and ``DELETE /dplb/workers/{id}``."""

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
        return await _add(state, d)

    @r.delete("/dplb/workers/{wid}")
    async def remove_worker(wid: int, request: Request) -> Response:
        check_admin(request, state.cfg)
        return await _remove(state, wid)


def _sglang_routes(r: APIRouter, state: RouterState) -> None:
    """SGLang router's names for the same calls (sgl-router src/server.rs: admin routes)."""

    @r.post("/add_worker")
    async def sglang_add_worker(request: Request, url: str = "") -> Response:
        """SGLang router's ``POST /add_worker?url=http://host:port``: ``POST /dplb/workers
        {"endpoint": url}`` (a remote node's agent, a plain vLLM/SGLang/OpenAI engine, or a
        removed local worker's socket), answered with DPLB's JSON plus SGLang's ``message``; 200
        where DPLB's own call says 201."""
        check_admin(request, state.cfg)
        if not url:
            raise BadRequest("give the worker as ?url=http://host:port (a DPLB agent's control address, or an "
                             "OpenAI-compatible engine's address)", param="url")
        resp = await _add(state, {"endpoint": url})
        if resp.status_code in (200, 201):
            d = orjson.loads(bytes(resp.body))
            d["message"] = f"Successfully added worker: {url}"
            return _json(d, 200)
        return resp

    @r.post("/remove_worker")
    async def sglang_remove_worker(request: Request, url: str = "") -> Response:
        """SGLang router's ``POST /remove_worker?url=``: ``DELETE /dplb/workers/{id}`` of the
        worker at ``url`` (as ``/list_workers`` names it: ``http://host:port`` of a remote agent,
        the engine's or agent's socket path of a local one); 404 when no worker has that address."""
        check_admin(request, state.cfg)
        try:
            ep = BackendServer.model_validate({"endpoint": url}).endpoint
        except ValidationError:
            raise BadRequest(f"?url= must be http://host:port or a socket path, got {url!r}", param="url") from None
        rows = state.scheduler.status_rows()
        wid = next((w["id"] for w in rows if ep in (w["endpoint"], w["control"])), None)
        if wid is None:
            raise NotFound(f"no worker at {url} (GET /list_workers lists them)", param="url")
        resp = await _remove(state, int(cast("int", wid)))   # a status row's "id" is a worker id
        if resp.status_code in (200, 202):
            d = orjson.loads(bytes(resp.body))
            d["message"] = f"Successfully removed worker: {url}"
            return _json(d, resp.status_code)
        return resp

    @r.get("/list_workers")
    async def sglang_list_workers(request: Request) -> Response:
        """SGLang router's ``GET /list_workers``: ``{"urls": [...]}`` (remote workers as
        ``http://host:port`` of their agents, local ones as their engines' sockets), plus
        ``workers``: ``[{"id", "url", "model", "state"}]``."""
        check_admin(request, state.cfg)
        rows = state.scheduler.status_rows()
        return _json({"urls": [_url_of(w) for w in rows],
                      "workers": [{"id": w["id"], "url": _url_of(w), "model": w["model"], "state": w["state"]}
                                  for w in rows]})

    @r.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """SGLang router's ``POST /flush_cache``, fanned out to every listed worker's engine:
        ``POST /flush_cache`` (SGLang's name), and on a 404 ``POST /reset_prefix_cache`` (vLLM's).
        Answers sgl-router's ``FlushCacheResult`` shape: ``{"successful": [url], "failed": [[url,
        why]], "total_workers", "http_workers", "message"}`` plus ``workers`` (per worker ``id``,
        ``url``, ``ok``, ``status``/``error``, ``path``); 200 when every engine flushed, 502 else."""
        check_admin(request, state.cfg)

        handles = [h for _, h in sorted(state.registry.handles.items())]
        results = list(await asyncio.gather(*(_flush_one(state.transport, h) for h in handles)))
        ok = [x["url"] for x in results if x["ok"]]
        failed = [[x["url"], x.get("error", "")] for x in results if not x["ok"]]
        msg = (f"Successfully flushed cache on all {len(ok)} worker(s)" if not failed else
               f"Flushed cache on {len(ok)} of {len(results)} worker(s); {len(failed)} failed")
        return _json({"successful": ok, "failed": failed, "total_workers": len(results),
                      "http_workers": len(results), "message": msg, "workers": results},
                     200 if not failed else 502)


def _lifecycle_routes(r: APIRouter, state: RouterState) -> None:
    """``POST /dplb/workers/{id}/restart``, ``/drain`` and ``/undrain``."""

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
        _known(state, wid)
        with state.admin.edit() as store:
            store.drained.add(wid)
        state.apply_admin()
        return _json({"worker_id": wid, "draining": True})

    @r.post("/dplb/workers/{wid}/undrain")
    async def undrain_worker(wid: int, request: Request) -> Response:
        check_admin(request, state.cfg)
        _known(state, wid)
        with state.admin.edit() as store:
            store.drained.discard(wid)
        state.apply_admin()
        return _json({"worker_id": wid, "draining": False})


async def _add(state: RouterState, d: object) -> Response:
    """``POST /dplb/workers`` with the parsed body ``d`` (the module docstring's answers)."""
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
    ep = spec.endpoint
    await check_resolves(ep)     # before any change: a name that does not resolve is a 400
    # an agent's control API or a plain engine? (a 400 for neither, before any change)
    kind, served = ("agent", None) if ep.startswith("/") else await endpoint_kind(state.transport, ep)
    mirrors = state.mirrors
    configured = {b.endpoint for b in state.cfg.backend_servers}
    # one synchronous section (no await) from the read of the state to its change: in this
    # process nothing else runs in between, across processes the store's lock serializes
    with state.admin.edit() as store:
        wanted = ep in store.mirrors or (ep in configured and ep not in store.unmirrored)
        owner = mirrors.owner_pid()
        local = None if wanted else next(
            (s for s in state.seg.snapshot()
             if int(s.state) != EMPTY and ep in (s.endpoint, s.control) and not mirrors.is_mirror_slot(s, owner)),
            None)
        if local is not None:
            # a local worker that was removed earlier comes back by naming its agent's (or engine's) socket again
            if local.worker_id not in store.removed:
                raise Conflict(f"{ep} is worker {local.worker_id}'s address (a local agent, not removed)",
                               param="endpoint")
            store.removed.discard(local.worker_id)
        elif not wanted:
            store.unmirrored.discard(ep)
            if ep not in configured:
                store.mirrors[ep] = ({"weight": spec.weight, "model": spec.model or served, "engine": True}
                                     if kind == "engine" else {"weight": spec.weight, "model": spec.model})
    version = state.admin.version    # bumped by the edit's save, when it changed something
    state.apply_admin()
    if local is not None:
        state.monitor.sync()
        return _json({"worker_id": local.worker_id, "endpoint": ep, "restored": True})
    if mirrors.leader():
        mirrors.reconcile()
        errors = mirrors.errors
    else:
        rec = await mirrors.wait_applied(version, MIRROR_WAIT_S)
        if rec is None:
            return _json({"worker_id": None, "endpoint": ep, "mirrored": True, "pending": True}, 202)
        errors = rec.get("errors", {})
    slot = mirrors.slot_of(ep)
    if slot is None:
        if ep in errors:
            why = errors[ep]
            if not wanted:               # a 503 changes nothing: not mirrored later when a slot frees
                with state.admin.edit() as store:
                    store.mirrors.pop(ep, None)
                    if ep in configured:
                        store.unmirrored.add(ep)
                state.apply_admin()
                if mirrors.leader():
                    mirrors.reconcile()
            raise NoFreeSlot(f"cannot mirror {ep}: {why}")
        raise Conflict(f"{ep} was removed by a concurrent call before it got a slot", param="endpoint")
    await mirrors.refresh_one(ep)    # its state in its slot before we answer (leader only: no-op else)
    state.monitor.sync()
    return _json({"worker_id": slot, "endpoint": ep, "mirrored": True, "created": not wanted,
                  "engine": mirrors.is_engine(ep)}, 200 if wanted else 201)


def _known(state: RouterState, wid: int) -> WorkerHandle | None:
    """Worker ``wid``'s handle (None: a local worker removed by an admin); NotFound when unknown."""
    h = state.registry.handles.get(wid)
    if h is None and wid not in state.admin.removed:
        raise NotFound(f"no worker with id {wid}", param="id")
    return h


async def _remove(state: RouterState, wid: int) -> Response:
    """``DELETE /dplb/workers/{wid}`` (the module docstring's answers)."""
    if not 0 <= wid < state.seg.num_slots:
        raise NotFound(f"no worker with id {wid}", param="id")
    mirrors = state.mirrors
    configured = {b.endpoint for b in state.cfg.backend_servers}
    with state.admin.edit() as store:
        snap = state.seg.read_slot(wid)
        if int(snap.state) == EMPTY:
            raise NotFound(f"no worker with id {wid}", param="id")
        mirror = mirrors.is_mirror_slot(snap, mirrors.owner_pid())
        if mirror:
            ep = snap.control
            if ep not in store.mirrors and (ep not in configured or ep in store.unmirrored):
                raise NotFound(f"worker {wid} (remote, {ep}) was already removed", param="id")
            store.mirrors.pop(ep, None)
            if ep in configured:
                store.unmirrored.add(ep)
        else:
            if wid in store.removed:
                raise NotFound(f"worker {wid} was already removed", param="id")
            store.removed.add(wid)
        store.drained.discard(wid)
    version = state.admin.version
    state.apply_admin()
    if mirror:
        if mirrors.leader():
            mirrors.reconcile()          # its slot is EMPTY from here on
        elif await mirrors.wait_applied(version, MIRROR_WAIT_S) is None:
            return _json({"worker_id": wid, "removed": True, "released": False}, 202)
    state.monitor.sync()
    return _json({"worker_id": wid, "removed": True})


def _url_of(row: dict[str, object]) -> str:
    """A worker's address as ``/list_workers`` lists it and ``/remove_worker?url=`` takes it:
    a remote worker's agent ``http://host:port``, a local one's engine socket path."""
    if row.get("remote"):
        return f"http://{row['control']}"
    return str(row["endpoint"])


async def _flush_one(transport: Transport, h: WorkerHandle) -> dict[str, object]:
    """``POST /flush_cache``'s row of worker ``h``: its engine's ``/flush_cache``, else (404)
    ``/reset_prefix_cache``."""
    out: dict[str, object] = {"id": h.worker_id, "url": h.endpoint}
    for path in ("/flush_cache", "/reset_prefix_cache"):
        try:
            status, body = await transport.get(h.endpoint, path, FLUSH_TIMEOUT_S, method="POST")
        except TransportError as e:
            return {**out, "ok": False, "error": f"{e.kind}: {e}", "path": path}
        if status != 404:
            ok = status < 300
            return {**out, "ok": ok, "status": status, "path": path,
                    **({} if ok else {"error": f"the engine answered {status}: "
                                               f"{body[:200].decode('utf-8', 'replace')}"})}
    return {**out, "ok": False, "status": 404, "path": "/reset_prefix_cache",
            "error": "the engine has neither POST /flush_cache nor POST /reset_prefix_cache"}
