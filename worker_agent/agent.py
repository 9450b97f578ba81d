"""The agent: claims its slot, keeps the engine, keeps the slot true. It is not on the request path.

One hop: the slot's ``endpoint`` is the **engine's own address** (a Unix socket for the simulated
engine and vLLM, loopback TCP for SGLang and attached servers, TCP on ``--engine-host`` for a remote
node's engine) and routers forward every request straight to it; the agent never sees a request.
Its ``control`` address (``--uds``, and TCP with ``--control-port``) serves a small control API:
``GET /health``, ``GET /dplb/state`` (the slot as JSON: what a remote node's routers mirror) and
``POST /dplb/restart``; anything else is 404 naming the engine's address. Its sockets listen from
the start; the API itself (fastapi, uvicorn: half of the agent's start-up imports) is loaded in a
thread and served once a fresh engine is spawned, or once a re-attached engine's slot is READY again
(:meth:`Agent._serve_control`): a restarted agent puts its worker back in routing first.

Lifecycle written to the slot::

    claim ─► STARTING ──engine healthy + warm-up answered──► READY ──SIGTERM──► DRAINING ──► EMPTY
               ▲ │                                             │                 (router in-flight
               │ └──────────── engine exits / fails ──────────►┴──► DEAD          0, or deadline)
               └──── backoff elapsed (restart n) ◄─────────────────── │
                                                                       └─ too many failures: DEAD
                                                                          (gave_up) until an admin
                                                                          restart

- DEAD: the engine exited unexpectedly or never became ready. The agent logs the exit code and
  the last lines of the engine's log, keeps running and heartbeating so routers see the state,
  and restarts the engine after an exponential backoff (``--restart-backoff``, doubled per failure
  up to ``--restart-backoff-max``). At most ``--restart-max`` failures are restarted within
  ``--restart-window`` seconds; one more leaves the slot DEAD with reason ``gave_up`` until
  ``POST /dplb/restart``. The slot carries ``restarts``, ``last_exit_code``, ``state_reason`` and
  ``next_restart_ns`` so every router, the launcher and ``dplb-shm-dump`` see the history.
  SIGTERM ends the agent from any state (EMPTY).
- The agent dies (kill -9, a crash): its engine does not — it keeps serving what it was given
  (requests never pass through the agent). The launcher marks the slot DEAD (``agent_exited``) and
  starts a new agent, which claims the slot (``state_reason`` ``agent_exited`` while STARTING, the
  worker's ``restarts`` and ``last_exit_code`` carried on, ``agent_restarts`` one more), **re-attaches to the running engine**
  named in ``<run-dir>/engine-<K>.pid`` (pid checked by its start time) and turns READY after the
  health check and warm-up; only an engine that is gone is started again
  (:meth:`worker_agent.adapters.base.EngineAdapter.start`).
- ``POST /dplb/restart`` (the router's admin API calls it): stop taking requests (STARTING,
  reason ``admin_restart``), let in-flight ones finish (up to ``--drain-timeout``), stop the
  engine and start it again; also lifts a ``gave_up``. 202 at once.
- DRAINING: routers stop sending (the scheduler routes READY slots only, whatever the policy); the
  agent waits until the requests in flight on its engine are done — it reads them from the slot's
  **router line** (``router_inflight``: every router process's dispatches not yet finished, an
  atomic the routers' leases keep), so it needs no place on the request path to count them — and
  the count has stayed 0, with the line's ``dispatched`` total unchanged, for one state interval
  (:meth:`Agent.wait_idle`), or until the drain limit (``--drain-timeout``, 30 s) has passed; then
  the engine is stopped, the slot released (EMPTY) and the agent exits 0.

Slot updates (one writer: this process, from its event loop thread only), every
``--state-interval-ms``: engine running/waiting/KV usage from its ``/metrics`` (a separate loop, so
a slow scrape never delays the heartbeat), the engine's own latency histograms (TTFT, inter-token,
end-to-end: the mean of what finished since the last scrape becomes one sample of the slot's
windows) and finished-request counter (``completed``), the routers' in-flight count taken at the
same scrape as the engine's counts (``inflight``), NVML memory of the agent's GPUs, heartbeat.
Per-request accounting (in flight, outstanding prefill, decoding requests, the routers' TTFT/TPOT)
is the routers' own, in the router line.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Unpack

import orjson

from dplb_protocol.wire import error_body
from dplb_shm import Segment, StateReason, WorkerSnapshot, WorkerState, now_ns
from dplb_shm.exits import exit_words
from dplb_shm.types import SlotFields

from .adapters import EngineAdapter, build_adapter
from .config import AgentConfig
from .control import (
    bind_tcp_socket,
    bind_unix_socket,
    control_server,
    load_control_modules,
)
from .errors import AgentError, EngineExitedError, UpstreamError
from .logtail import log_tail
from .metrics import EngineMetrics, slot_fields
from .nvml import GpuMemoryProbe
from .restart import RestartPolicy

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

log = logging.getLogger("worker_agent")

#: signals with no meaning to an agent: logged, never fatal
IGNORED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: the longest the control API waits for a re-attached engine's readiness before it starts anyway
#: (seconds; :meth:`Agent._serve_control`)
CONTROL_DEFER_MAX_S = 5.0


class Agent:
    """One worker agent.

    Args:
        cfg: validated config.
        adapter: engine adapter (default: ``build_adapter(cfg)``).
        segment: an attached segment (default: ``Segment.attach(cfg.shm)``); the agent closes it
            only when it attached it itself.
        nvml: GPU memory probe (default: ``GpuMemoryProbe(cfg.gpus)``).
    """

    def __init__(self, cfg: AgentConfig, *, adapter: EngineAdapter | None = None,
                 segment: Segment | None = None, nvml: GpuMemoryProbe | None = None) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id
        self.adapter = adapter or build_adapter(cfg)
        self._own_segment = segment is None
        self.segment = segment or Segment.attach(cfg.shm)
        self.writer = self.segment.writer(cfg.worker_id, latency_window_s=cfg.latency_window_s)
        self.nvml = nvml or GpuMemoryProbe(cfg.gpus)
        self.state = WorkerState.EMPTY
        self.exit_code: int | None = None
        self.restarts = 0          # the worker's engine restarts (carried over an agent restart)
        self.agent_restarts = 0    # the worker's agent restarts (``agent_restarts``), this one included
        self.restart_policy = RestartPolicy(cfg.restart_max, cfg.restart_window_s, cfg.restart_backoff_s,
                                            cfg.restart_backoff_max_s)
        self._restart_req = asyncio.Event()
        self._engine_metrics_seen = False
        self._totals: dict[str, tuple[float, float]] = {}
        self._stop = asyncio.Event()
        self._stopping = False
        self._skip_drain = False
        self._tasks: list[asyncio.Task] = []
        self._server: uvicorn.Server | None = None
        #: set once the first engine start no longer needs the CPU to itself (Agent._serve_control)
        self._control_go = asyncio.Event()

    # -- in flight (the routers' count, from the slot's router line) ---------------------------
    @property
    def inflight(self) -> int:
        """Requests in flight on the engine: dispatched by any router process on this node and
        not finished (the slot's ``router_inflight`` atomic)."""
        try:
            return max(0, int(self.segment.router_inflight_get(self.worker_id)))
        except Exception:  # noqa: BLE001 - the segment is closing
            return 0

    @property
    def dispatched(self) -> int:
        """Requests ever dispatched to this slot by the routers (the router line's ``dispatched``
        total): it moves at every dispatch, even one that began and ended between two reads."""
        try:
            return int(self.segment.router_line(self.worker_id)["dispatched"])
        except Exception:  # noqa: BLE001 - the segment is closing
            return 0

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight on the engine, up to ``timeout_s`` (the drain limit).
        Returns True when idle (or a second SIGINT said not to wait), False at the deadline.

        Idle: the routers' in-flight count for the slot (:attr:`inflight`) read 0 and stayed 0, with
        the slot's :attr:`dispatched` total unchanged, for one state interval (polled every 20 ms).
        A router that checked the slot READY just before it turned DRAINING takes its lease right
        after (same event-loop step); the quiet interval makes sure such a request is in the count
        and waited for, not cut by the engine's stop. The wait also starts with one state interval,
        so that every router has seen the state change before the count is trusted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        settle = self.cfg.state_interval_s
        await asyncio.sleep(min(timeout_s, settle))
        quiet_since: float | None = None   # when the count was last seen turning 0
        seen = -1                          # the dispatched total at that moment
        while not self._skip_drain:
            now = loop.time()
            if self.inflight > 0:
                quiet_since = None
            else:
                d = self.dispatched
                if quiet_since is None or d != seen:
                    quiet_since, seen = now, d
                elif now - quiet_since >= settle:
                    return True
            if now >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    # -- state -------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The engine's data address as the slot holds it (routers forward requests there)."""
        return self.adapter.address.endpoint

    def set_state(self, state: WorkerState) -> None:
        """Change the lifecycle state in this process and in the slot."""
        if state != self.state:
            log.info("worker %d: %s -> %s", self.worker_id, self.state.name, state.name)
        self.state = state
        self.writer.set_state(state)

    def slot_dict(self) -> dict[str, object]:
        """The slot as ``/dplb/state`` serves it (``WorkerSnapshot.to_dict()``)."""
        return self.segment.read_slot(self.worker_id).to_dict()

    def _publish_latency(self, m: EngineMetrics) -> None:
        """The engine's latency histograms since the last scrape → one sample per window (the mean
        of what finished in the interval, ms), and its finished-request counter → ``completed``.
        A counter that went down (the engine restarted) starts over."""
        prev = self._totals
        cur = {k: (s, n) for k, s, n in m.totals}
        self._totals = cur
        lat: dict[str, float] = {}
        for k, (s, n) in cur.items():
            if k not in prev:
                continue
            ps, pn = prev[k]
            if k == "finished":
                if s > ps:
                    self.writer.count(completed=int(s - ps))
            elif n > pn and s >= ps:
                lat[f"{k}_ms"] = 1000.0 * (s - ps) / (n - pn)
        if lat:
            self.writer.record_latency(**lat)

    def publish_engine(self, m: EngineMetrics, inflight: int | None = None) -> None:
        """Publish one scrape of the engine (the probe loop's body; the simulator calls it with its
        virtual engines' counts). With the engine's request counts goes the routers'
        in-flight count taken at the same scrape (``inflight``: the larger of the counts read just
        before and just after it; None: read now), so that ``running + waiting − inflight`` is
        what the engine holds that no router dispatched, whatever the publication's age
        (csrc/dplb_kernel.h, ``X_i``)."""
        if m.totals:
            self._publish_latency(m)
        fields = slot_fields(m, max(self.inflight, inflight or 0))
        if fields:
            self._engine_metrics_seen = True
            self.writer.publish(**fields)

    async def _probe_loop(self) -> None:
        """Engine ``/metrics`` → slot, every state interval (errors skip one tick)."""
        interval = self.cfg.state_interval_s
        while True:
            if self.state in (WorkerState.READY, WorkerState.DRAINING):
                try:
                    before = self.inflight
                    self.publish_engine(await self.adapter.probe(), inflight=before)
                except UpstreamError as e:
                    log.debug("engine probe failed: %s", e)
            await asyncio.sleep(interval)

    async def _heartbeat_loop(self) -> None:
        """NVML memory, heartbeat, and, while the engine has published no metrics, the routers'
        in-flight count as its running requests."""
        interval = self.cfg.state_interval_s
        while True:
            fields: SlotFields = {}
            if self.nvml.available:
                used, total = await asyncio.to_thread(self.nvml.read)
                fields.update({"gpu_mem_used_bytes": used, "gpu_mem_total_bytes": total})
            elif (sim := self.adapter.simulated_gpu_memory()) is not None:
                fields.update({"gpu_mem_used_bytes": sim[0], "gpu_mem_total_bytes": sim[1]})
            if not self._engine_metrics_seen:
                # no engine counts: the routers' count stands for them (published with it, so
                # nothing looks dispatched from outside); otherwise the probe loop publishes the
                # engine's counts together with the routers' count of the same moment
                fields.update(slot_fields(EngineMetrics(), self.inflight, stand_in=True))
            fields["engine_pid"] = self.adapter.engine_pid   # 0 once the engine has exited
            self.writer.publish(**fields)  # always: refreshes the heartbeat
            await asyncio.sleep(interval)

    async def _guard(self, loop_fn: Callable[[], Awaitable[None]]) -> None:
        """Run a periodic loop; an unexpected error is logged and the loop restarted a tick later."""
        while True:
            try:
                await loop_fn()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker %d: %s failed; restarting it", self.worker_id, loop_fn.__name__)
                await asyncio.sleep(self.cfg.state_interval_s)

    def _set(self, to: WorkerState, **fields: Unpack[SlotFields]) -> None:
        """Change the lifecycle state to ``to`` and the given slot fields in one slot write."""
        if to != self.state:
            log.info("worker %d: %s -> %s", self.worker_id, self.state.name, to.name)
        self.state = to
        fields["state"] = to
        self.writer.publish(**fields)

    async def _start_engine(self) -> StateReason:
        """Start the engine once and wait until it is ready (READY in the slot).

        Returns ``StateReason.NONE`` when it became ready, ``START_FAILED`` when it did not
        (logged with the engine log's last lines; ``exit_code`` set when it exited)."""
        self._totals = {}   # a new engine's counters start from zero
        try:
            return await self._start_engine_once()
        finally:
            self._control_go.set()

    async def _start_engine_once(self) -> StateReason:
        """:meth:`_start_engine`'s body. Opens the control API's gate (:meth:`_serve_control`) as
        soon as a fresh engine is spawned (it boots meanwhile); a re-attached engine's readiness
        goes first: it is seconds of routing back for a worker whose engine never stopped."""
        try:
            await self.adapter.start()
            self.writer.publish(engine_pid=self.adapter.engine_pid)
            if self.adapter.adopted:   # a previous agent's engine: requests it serves go on
                log.warning("worker %d: re-attached to the running engine %s (pid %d) at %s", self.worker_id,
                            self.adapter.name, self.adapter.engine_pid, self.endpoint)
                self.writer.publish(endpoint=self.endpoint)
            else:
                self._control_go.set()
            model = await self.adapter.wait_ready(self.cfg.engine_start_timeout_s)
        except EngineExitedError as e:
            if not self._stopping:
                self.exit_code = e.exit_code
                log.error("worker %d: %s (log: %s); last lines:\n%s", self.worker_id, e, self.adapter.log_path,
                          log_tail(self.adapter.log_path, 10, 8192))
            return StateReason.START_FAILED
        except AgentError as e:
            if not self._stopping:
                log.error("worker %d: engine did not start: %s (log: %s); last lines:\n%s", self.worker_id, e,
                          self.adapter.log_path, log_tail(self.adapter.log_path, 10, 8192))
            return StateReason.START_FAILED
        if self._stopping:
            return StateReason.NONE
        if model:
            log.info("worker %d: engine serves model %r", self.worker_id, model)
            # the slot holds at most 119 bytes of UTF-8
            self.writer.publish(model=model.encode()[:119].decode("utf-8", "ignore"))
        self._set(WorkerState.READY, state_reason=StateReason.NONE, next_restart_ns=0,
                  engine_pid=self.adapter.engine_pid)
        if self.restarts:
            log.warning("worker %d: engine READY again after restart %d", self.worker_id, self.restarts)
        return StateReason.NONE

    async def _run_until_exit(self) -> StateReason | None:
        """While the engine serves: wait for its exit (→ ``ENGINE_EXITED``, logged with exit code
        and log tail) or an admin restart (→ ``ADMIN_RESTART``); None when the agent is stopping."""
        exit_task = asyncio.ensure_future(self.adapter.wait_exit())
        req_task = asyncio.ensure_future(self._restart_req.wait())
        try:
            await asyncio.wait({exit_task, req_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (exit_task, req_task):
                if not t.done():
                    t.cancel()
        if self._stopping:
            return None
        if exit_task.done() and not exit_task.cancelled():
            rc = exit_task.result()
            self.exit_code = rc
            self.writer.publish(engine_pid=0)
            log.error("worker %d: engine %s exited unexpectedly with code %s (%s; log: %s); last lines:\n%s",
                      self.worker_id, self.adapter.name, "null" if rc is None else rc, exit_words(rc),
                      self.adapter.log_path,
                      log_tail(self.adapter.log_path, 10, 8192))
            return StateReason.ENGINE_EXITED
        return StateReason.ADMIN_RESTART

    async def _supervise_engine(self) -> None:
        """Start the engine, and restart it when it fails or an admin asks (module docstring)."""
        reason = await self._start_engine()
        while not self._stopping:
            if reason == StateReason.NONE:
                got = await self._run_until_exit()
                if got is None:
                    return
                reason = got
            if reason == StateReason.ADMIN_RESTART:
                await self._admin_stop_engine()
            else:
                await self._fail_and_wait(reason)
            if self._stopping:
                return
            self.restarts += 1
            log.warning("worker %d: restarting engine %s (restart %d, reason %s)", self.worker_id,
                        self.adapter.name, self.restarts, reason.name.lower())
            self._set(WorkerState.STARTING, restarts=self.restarts, next_restart_ns=0,
                      state_reason=StateReason.ADMIN_RESTART if self._restart_req.is_set() else reason)
            self._restart_req.clear()
            reason = await self._start_engine()

    async def _admin_stop_engine(self) -> None:
        """An admin restart of a running engine: stop taking requests, let in-flight ones finish
        (up to ``--drain-timeout``), stop the engine; the failure window is cleared."""
        log.warning("worker %d: restart requested; stopping engine %s (%d in flight)", self.worker_id,
                    self.adapter.name, self.inflight)
        self._set(WorkerState.STARTING, state_reason=StateReason.ADMIN_RESTART)
        if not await self.wait_idle(self.cfg.drain_timeout_s):
            log.warning("worker %d: %d request(s) still in flight at the drain deadline; restarting anyway",
                        self.worker_id, self.inflight)
        rc = await self.adapter.stop()
        self.restart_policy.reset()
        log.info("worker %d: engine stopped for restart (exit code %s)", self.worker_id, rc)

    async def _fail_and_wait(self, reason: StateReason) -> None:
        """The engine failed (``reason``): DEAD with the exit code, reap it, then wait the backoff
        — or, past the restart budget, stay DEAD (``gave_up``) until an admin restart."""
        # what the dead engine last reported is no longer true: nothing runs, its cache is gone
        self._set(WorkerState.DEAD, state_reason=reason, last_exit_code=int(self.exit_code or 0),
                  num_running=0, num_waiting=0, kv_cache_usage=-1.0)
        await self.adapter.stop(timeout_s=5.0)   # whatever is left of its process group; closes its pool
        if self._stopping:
            return
        delay = self.restart_policy.failure()
        if delay is None:
            p = self.restart_policy
            log.error("worker %d: engine failed %d times within %.0fs (--restart-max %d): giving up; the "
                      "worker stays DEAD until an admin restart (POST /dplb/workers/%d/restart on the router)",
                      self.worker_id, p.failures_in_window(), p.window_s, p.max_restarts, self.worker_id)
            self.writer.publish(state_reason=StateReason.GAVE_UP, next_restart_ns=0)
            await self._restart_req.wait()
            self.restart_policy.reset()
            return
        log.warning("worker %d: restarting engine in %.1fs (failure %d of %d allowed within %.0fs)",
                    self.worker_id, delay, self.restart_policy.failures_in_window(), self.restart_policy.max_restarts,
                    self.restart_policy.window_s)
        self.writer.publish(next_restart_ns=now_ns() + int(delay * 1e9))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._restart_req.wait(), delay)   # an admin restart skips the wait
        if self._restart_req.is_set():
            self.restart_policy.reset()

    def request_restart(self) -> bool:
        """Ask for an engine restart now (admin); False when the agent is stopping."""
        if self._stopping:
            return False
        self._restart_req.set()
        return True

    def _ignored_signal(self, sig: signal.Signals) -> None:
        """A signal of :data:`IGNORED_SIGNALS` arrived: one line, nothing else."""
        log.warning("worker %d: agent ignores %s (SIGTERM or SIGINT stop it)", self.worker_id, sig.name)

    def request_stop(self, sig: int | None = None) -> None:
        """Begin draining (signal handler target); a second SIGINT skips the drain."""
        if self._stop.is_set() and sig == signal.SIGINT:
            log.warning("second SIGINT: not waiting for in-flight requests")
            self._skip_drain = True
        self._stop.set()

    def _control_app(self) -> FastAPI:
        """The control API (module docstring): ``/health``, ``/dplb/state``, ``/dplb/restart``, 404
        for anything else."""
        from fastapi import FastAPI
        from starlette.responses import Response

        app = FastAPI(title="dplb-worker-agent", openapi_url=None, docs_url=None, redoc_url=None)

        def json(obj: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
            return Response(orjson.dumps(obj), status_code=status, headers=headers, media_type="application/json")

        def error(message: str, type_: str, status: int) -> Response:
            return Response(error_body(message, type_, status), status_code=status, media_type="application/json")

        @app.get("/health")
        async def health() -> Response:
            """200 only when READY; 503 with the state name otherwise."""
            ready = self.state == WorkerState.READY
            return json({"status": self.state.name.lower(), "worker_id": self.worker_id},
                        200 if ready else 503, None if ready else {"Retry-After": "1"})

        @app.get("/dplb/state")
        async def state() -> Response:
            """The slot as JSON (``WorkerSnapshot.to_dict()``)."""
            return json(self.slot_dict())

        @app.post("/dplb/restart")
        async def restart() -> Response:
            """Restart the engine now (202): drain in-flight requests, stop, start; lifts ``gave_up``.
            409 while the agent is shutting down."""
            prev = self.state.name.lower()
            if not self.request_restart():
                return error(f"worker {self.worker_id} is shutting down", "conflict", 409)
            return json({"worker_id": self.worker_id, "restarting": True, "state": prev,
                         "restarts": self.restarts}, 202)

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def not_here(path: str) -> Response:
            """Requests go to the engine, not to the agent (one hop)."""
            return error(f"the worker agent serves only /health, /dplb/state and /dplb/restart; requests go "
                         f"to worker {self.worker_id}'s engine at {self.endpoint} (the slot's endpoint)",
                         "not_found_error", 404)

        return app

    def _previous_agent(self) -> WorkerSnapshot | None:
        """The slot as a previous agent of this worker left it when that agent died (its pid no
        longer runs; the launcher may have marked the slot DEAD ``agent_exited``), else None (a
        fresh slot, or one released by a clean stop)."""
        try:
            prev = self.segment.read_slot(self.worker_id)
        except Exception:  # noqa: BLE001 - an unreadable slot: start afresh
            return None
        pid = int(prev.pid)
        if prev.state == WorkerState.EMPTY or pid <= 0 or pid == os.getpid():
            return None
        try:
            import psutil

            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return None    # it still runs (a mirror, or an agent being replaced by hand)
        except psutil.Error:
            pass
        return prev

    async def _serve_control(self, sockets: list[socket.socket]) -> None:
        """Serve the control API on ``sockets`` (bound and listening since the start: a connection
        made before it serves waits in the backlog, it is not refused). It starts once the first
        engine start opens its gate (:meth:`_start_engine_once`: a fresh engine spawned, or a
        re-attached one READY or failed), at most :data:`CONTROL_DEFER_MAX_S` after the claim, and
        imports its modules in a thread meanwhile (:func:`load_control_modules`), so that the
        event loop keeps the slot's heartbeat and the engine's start going. Before, those imports
        came before the claim: a restarted agent's worker was out of routing 4-6 s longer on a
        loaded machine."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._control_go.wait(), CONTROL_DEFER_MAX_S)
        try:
            await asyncio.to_thread(load_control_modules)
            if self._stopping:
                return
            self._server = control_server(self._control_app())
            await self._server.serve(sockets=sockets)
        except Exception:   # the engine and the slot go on; a caller is refused, not left hanging
            log.exception("worker %d: the control API cannot be served; its sockets are closed", self.worker_id)
            for sock in sockets:
                sock.close()

    # -- main ----------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until SIGTERM/SIGINT (or :meth:`request_stop`); return the process exit code (0)."""
        loop = asyncio.get_running_loop()
        os.makedirs(os.path.dirname(self.cfg.uds), mode=0o700, exist_ok=True)
        sockets = [bind_unix_socket(self.cfg.uds)]  # OSError here: nothing claimed yet
        if self.cfg.control_port:
            sockets.append(bind_tcp_socket(self.cfg.control_host, self.cfg.control_port))
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.request_stop, sig)
        for sig in IGNORED_SIGNALS:   # no meaning to an agent: a line, not a death
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._ignored_signal, sig)
        before = self._previous_agent()
        self.writer.claim(worker_id=self.worker_id, pid=os.getpid(), endpoint=self.endpoint, control=self.cfg.uds,
                          gpu_ids=self.cfg.gpus, weight=self.cfg.weight, model=self.cfg.model or "",
                          max_num_seqs=self.cfg.max_num_seqs)
        self.state = WorkerState.STARTING
        if before is not None:   # this agent restarts a dead one: the worker's history goes on
            self.restarts = int(before.restarts)
            self.agent_restarts = int(before.agent_restarts) + 1
            log.warning("worker %d: agent restart %d (the previous agent, pid %d, died); looking for its engine",
                        self.worker_id, self.agent_restarts, before.pid)
            self.writer.publish(restarts=self.restarts, agent_restarts=self.agent_restarts,
                                last_exit_code=int(before.last_exit_code), state_reason=StateReason.AGENT_EXITED)
        server_task = asyncio.create_task(self._serve_control(sockets))
        self._tasks += [asyncio.create_task(self._guard(self._heartbeat_loop)),
                        asyncio.create_task(self._guard(self._probe_loop))]
        starter = asyncio.create_task(self._supervise_engine())
        try:
            await self._stop.wait()
            self._stopping = True
            starter.cancel()
            if self.state != WorkerState.DEAD:
                self.set_state(WorkerState.DRAINING)
                log.info("worker %d: draining (%d request(s) in flight), up to %.0fs", self.worker_id,
                         self.inflight, self.cfg.drain_timeout_s)
                if not await self.wait_idle(self.cfg.drain_timeout_s):
                    log.warning("worker %d: drain deadline passed with %d request(s) in flight",
                                self.worker_id, self.inflight)
        finally:
            self._stopping = True
            if self._server is not None:
                self._server.should_exit = True
            else:   # not serving yet (its imports, or waiting for the engine): nothing to shut down
                server_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(server_task, 10)
            for sock in sockets:   # closed by the server when it served; never served: closed here
                sock.close()
            for t in (starter, *self._tasks):
                t.cancel()
            await asyncio.gather(starter, *self._tasks, return_exceptions=True)
            rc = await self.adapter.stop()
            if rc is not None:
                log.info("worker %d: engine stopped (exit code %s)", self.worker_id, rc)
            self.nvml.close()
            self.writer.release()
            self.state = WorkerState.EMPTY
            if self._own_segment:
                self.segment.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.uds)
            for sig in (signal.SIGTERM, signal.SIGINT, *IGNORED_SIGNALS):
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    loop.remove_signal_handler(sig)
        return 0
