"""Router-side worker handles and the registry that keeps them in step with the segment.

Snapshot vs handle: the segment holds the *shared* truth (state, heartbeat, queue,
KV use, router in-flight); a :class:`WorkerHandle` holds what is local to this router process —
the worker's two addresses (``endpoint``: the engine, where requests go; ``control``: its agent),
probe results (written by the health monitor only), the circuit breaker, admin drain, this
process's in-flight count, and the last snapshot read (used for listings and as a hint, never for
liveness). Which workers may take a request is decided in one place, the scheduler
(:mod:`router.scheduling`); the registry only keeps the handles in step with the segment.

Every slot that is not EMPTY (and not removed by an admin) has a handle, DEAD and STARTING ones
included, so that listings and metrics show a dead worker as dead rather than dropping it. A
handle leaves only when its slot empties, is removed, or is taken by another process (new pid or
endpoint). When a slot's engine dies or is restarted (``restarts`` moved, or the slot turned DEAD)
the handle stays but ``on_reset`` runs (policies forget the worker's prefixes: its cache is gone)
and its breaker closes (it is a new engine).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from dplb_shm import StateReason, WorkerSnapshot, WorkerState
from dplb_shm.exits import exit_words
from router.breaker import CLOSED, CircuitBreaker
from router.config import Config
from router.logtext import text

if TYPE_CHECKING:
    from dplb_shm import Segment

#: the slot states the router compares with ``int(snap.state)`` (plain ints: the hot path's test)
EMPTY = int(WorkerState.EMPTY)
READY = int(WorkerState.READY)
DRAINING = int(WorkerState.DRAINING)
DEAD = int(WorkerState.DEAD)
#: a slot state's name as ``dplb-shm-dump`` and ``/dplb/status`` print it
STATE_NAMES = {int(st): st.name.lower() for st in WorkerState}
log = logging.getLogger("dplb.router.workers")


def exit_code_or_none(snap: WorkerSnapshot | None) -> int | None:
    """The slot's ``last_exit_code``, or None while its engine never exited (or no slot):
    :attr:`dplb_shm.WorkerSnapshot.exit_code`."""
    return None if snap is None else snap.exit_code


def log_state_change(wid: int, before: int | None, snap: WorkerSnapshot) -> None:
    """One WARNING line for a worker whose slot changed state (``before`` None: first seen), with
    the slot's reason and the engine's last exit status where it has them (issue 32: "a warning
    with its cause for every worker state change")."""
    st = int(snap.state)
    r = snap.state_reason        # its names are the reasons
    reason = None if r == StateReason.NONE else r.name.lower()
    code = snap.exit_code
    # an agent's death is not its engine's: the engine's last status is named only for its own exits
    engine_exit = code is not None and r in (StateReason.ENGINE_EXITED, StateReason.START_FAILED, StateReason.GAVE_UP)
    why = "" if reason is None else f" ({reason}" + (f", engine {exit_words(code)}" if engine_exit else "") + ")"
    was = "new" if before is None else STATE_NAMES.get(before, str(before))
    log.warning("worker %d: %s -> %s%s, engine %s, model %s", wid, was, STATE_NAMES.get(st, str(st)), why,
                text(snap.endpoint or "-"), text(snap.model or "-"))


#: the slot's columns of a status row before the worker's slot was first read
NO_SLOT_COLUMNS: dict[str, object] = {
    "agent_pid": None, "pid": None, "engine_pid": None, "inflight": None, "router_inflight": None, "running": None,
    "waiting": None, "kv_cache_usage": None, "latency_ms": {"ttft": None, "tpot": None, "e2e": None},
    "heartbeat_age_ms": None, "weight": None, "restarts": 0, "agent_restarts": 0, "last_exit_code": None,
    "completed": 0, "failed": 0,
    "state_reason": "none", "restart_in_s": None}


def slot_columns(s: WorkerSnapshot, now: int) -> dict[str, object]:
    """The columns of a status row (:meth:`Registry.status_rows`) that come from the worker's slot
    ``s``; ``now``: ``dplb_shm.now_ns()`` (``restart_in_s`` is counted from it)."""
    nxt = s.next_restart_ns
    return {
        "state": STATE_NAMES.get(int(s.state), "unknown"),
        "agent_pid": s.pid, "pid": s.pid,   # pid: the old name
        "engine_pid": s.engine_pid or None,
        "inflight": s.inflight, "router_inflight": s.router_inflight,
        "running": s.num_running, "waiting": s.num_waiting, "kv_cache_usage": s.kv_cache_usage,
        "latency_ms": {"ttft": s.ttft_ms, "tpot": s.tpot_ms, "e2e": s.e2e_ms},
        "heartbeat_age_ms": s.heartbeat_age_ms, "weight": s.weight, "restarts": s.restarts,
        "agent_restarts": s.agent_restarts,
        "last_exit_code": exit_code_or_none(s), "completed": s.completed, "failed": s.failed,
        "state_reason": s.state_reason.name.lower(),
        "restart_in_s": round(max(0.0, (nxt - now) / 1e9), 3) if nxt > 0 else None,
    }


class WorkerHandle:
    """Router-local state of one worker (slot ``worker_id``)."""

    __slots__ = (
        "breaker",
        "control",
        "drained",
        "endpoint",
        "label",
        "label_b",
        "last_head_at",
        "local_inflight",
        "mirror",
        "model",
        "pid",
        "probe_failures",
        "probe_ok",
        "restarts",
        "snap",
        "worker_id",
    )

    def __init__(self, worker_id: int, endpoint: str, model: str, breaker: CircuitBreaker, pid: int = 0,
                 control: str = "") -> None:
        self.worker_id = worker_id
        #: ``str(worker_id)``, the ``worker`` metric label, and its bytes (the X-DPLB-Worker-ID header)
        self.label = str(worker_id)
        self.label_b = self.label.encode()
        #: the engine's address: requests are forwarded here (one hop), probes go here too
        self.endpoint = endpoint
        #: the agent's control address (``/dplb/state``, ``/dplb/restart``); the endpoint when it has none
        self.control = control or endpoint
        self.model = model
        self.breaker = breaker
        self.probe_failures = 0
        self.probe_ok = True
        self.last_head_at = 0.0  # time.monotonic() of the last response head this worker sent us
        self.drained = False
        self.local_inflight = 0
        self.snap: WorkerSnapshot | None = None
        self.mirror = False
        self.pid = pid
        self.restarts = 0  # the slot's engine restart count at the last sync (not at fresh reads)

    def serves(self, model: str | None) -> bool:
        """True when this worker can serve ``model`` (None = any; an empty worker model = any)."""
        return model is None or not self.model or self.model == model



class Registry:
    """Handles of every live worker in the segment; :meth:`sync` reconciles them with a snapshot.

    ``seg``: a ``dplb_shm.Segment``; ``on_leave(worker_id, endpoint)`` is called when a worker
    leaves or its slot is reused by another process (policies forget it, pools are closed).
    """

    def __init__(self, seg: Segment, cfg: Config, on_leave: Callable[[int, str], None] | None = None,
                 on_circuit: Callable[[int, int], None] | None = None,
                 on_reset: Callable[[int], None] | None = None,
                 is_mirror: Callable[[str], bool] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.seg = seg
        #: is this control address a remote agent this router mirrors? (the ``remote`` column)
        self.is_mirror = is_mirror
        self.cfg = cfg
        # the routing clock (ns, heartbeat domain) heartbeat ages are judged on; None (live): the
        # age each snapshot computed when read. The simulator passes its virtual clock.
        self.clock = clock
        self.handles: dict[int, WorkerHandle] = {}
        self.on_leave = on_leave
        self.on_circuit = on_circuit
        self.on_reset = on_reset
        self.drained: set[int] = set()
        self.removed: set[int] = set()
        #: every model a slot has announced since this router process started (a model stays known
        #: while its workers are down: its requests get 503, not 404; issue 27)
        self.models_seen: set[str] = set()
        self.hb_timeout_ms = float(cfg.health_check.heartbeat_timeout_ms)
        self._generation = -1

    def refresh(self) -> None:
        """Reconcile the handles with the segment now (cheap enough to call on demand): only the
        occupied slots are read (an EMPTY slot has no handle; a 64-slot segment with 4 workers
        cost 64 slot reads per health tick before)."""
        seg = self.seg
        self._generation = seg.generation
        self.sync([seg.read_slot(i) for i in seg.occupied()])

    def refresh_if_changed(self) -> None:
        """Reconcile only when the segment's membership generation moved (hot path: one load)."""
        if self.seg.generation != self._generation:
            self.refresh()

    def _breaker(self, wid: int) -> CircuitBreaker:
        cb = self.cfg.circuit_breaker

        def changed(state: int) -> None:
            if self.on_circuit is not None:
                self.on_circuit(wid, state)

        return CircuitBreaker(cb.failure_rate_threshold if cb.enabled else 2.0, cb.minimum_requests,
                              cb.window_size, cb.open_time_s, on_change=changed)

    def sync(self, snaps: Iterable[WorkerSnapshot]) -> None:
        """Reconcile handles with ``snaps`` (every slot): new non-empty slots get a handle, slots
        that became EMPTY, were removed or changed endpoint/pid lose theirs; an engine that died or
        was restarted resets its handle (see the module docstring)."""
        seen = set()
        for s in snaps:
            st = int(s.state)
            if st == EMPTY or not s.endpoint or s.worker_id in self.removed:
                continue
            wid = s.worker_id
            seen.add(wid)
            h = self.handles.get(wid)
            if h is not None and (h.endpoint != s.endpoint or h.pid != s.pid):
                self._leave(h)
                h = None
            restarts = s.restarts
            if h is None:
                h = self.handles[wid] = WorkerHandle(wid, s.endpoint, s.model, self._breaker(wid), s.pid, s.control)
            elif restarts != h.restarts or (st == DEAD and h.snap is not None and int(h.snap.state) != DEAD):
                self._reset(h)
            h.restarts = restarts
            if self.is_mirror is not None:
                h.mirror = self.is_mirror(h.control)
            h.model = s.model
            if s.model:
                self.models_seen.add(s.model)
            before = None if h.snap is None else int(h.snap.state)
            if before != st:
                log_state_change(wid, before, s)
            h.snap = s
            h.drained = wid in self.drained
        for wid in [w for w in self.handles if w not in seen]:
            self._leave(self.handles[wid])

    def _reset(self, h: WorkerHandle) -> None:
        """The worker's engine died or was restarted: a new engine, an empty cache."""
        h.breaker.reset()
        h.probe_failures = 0
        if self.on_reset is not None:
            self.on_reset(h.worker_id)

    def _leave(self, h: WorkerHandle) -> None:
        self.handles.pop(h.worker_id, None)
        if h.breaker.state != CLOSED and self.on_circuit is not None:
            self.on_circuit(h.worker_id, CLOSED)
        if self.on_leave is not None:
            self.on_leave(h.worker_id, h.endpoint)

    def status_rows(self, routing_state: Callable[[WorkerHandle, WorkerSnapshot | None], str]) -> list[dict[str, object]]:
        """Per-worker rows of ``GET /dplb/status`` and ``GET /dplb/workers``: every slot that is
        not EMPTY (removed ones excepted). ``state`` is the slot's own state, exactly as
        ``dplb-shm-dump`` prints it; ``routing`` is this router's verdict (``routing_state``, the
        scheduler's, on the same read of the slot); the slot's fields are read now, as the dump and ``/metrics`` read them (the
        health tick's snapshot only when the read fails or finds the slot released), so the
        counts do not lag one tick; ``endpoint`` the engine's address, ``control`` the agent's;
        ``agent_pid`` the worker agent's pid (also as ``pid``, its older name; None for a mirrored
        remote worker, whose slot the router process ``mirror_router_pid`` writes), ``engine_pid`` the engine process the agent spawned (None: none,
        e.g. an attached server); ``restarts``, ``last_exit_code``, ``state_reason`` and
        ``restart_in_s`` (seconds until the agent's next engine restart, None when none is
        scheduled) come from the slot."""
        from dplb_shm import now_ns
        from router.breaker import STATE_NAMES as CIRCUIT_NAMES

        rows = []
        now = now_ns()
        for wid in sorted(self.handles):
            h = self.handles[wid]
            s = h.snap
            with contextlib.suppress(Exception):   # a slot read mid-release: the last tick's snapshot
                live = self.seg.read_slot(wid)
                if live is not None and int(live.state) != 0:
                    s = live
            routing = routing_state(h, s)   # the verdict on the same read as the row's state
            row: dict[str, object] = {
                "id": wid, "worker_id": wid, "state": "unknown", "eligible": routing == "eligible", "routing": routing,
                "draining": h.drained, "endpoint": h.endpoint, "control": h.control, "model": h.model, "remote": h.mirror,
                "local_inflight": h.local_inflight,
                "circuit": CIRCUIT_NAMES[h.breaker.state], "failure_rate": round(h.breaker.failure_rate, 4),
                "probe_failures": h.probe_failures}
            cols = slot_columns(s, now) if s is not None else NO_SLOT_COLUMNS
            if h.mirror and s is not None:   # the slot's pid is the mirroring router's, not an agent's
                cols = {**cols, "agent_pid": None, "pid": None, "mirror_router_pid": s.pid}
            rows.append({**row, **cols})
        return rows
