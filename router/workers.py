"""Router-side worker handles and the registry that keeps them in step with the segment.

Snapshot vs handle (STYLE.md): the segment holds the *shared* truth (state, heartbeat, queue,
KV use, router in-flight); a :class:`WorkerHandle` holds what is local to this router process —
probe results, the circuit breaker, admin drain, this process's in-flight count, and the last
snapshot read (used for listings and as a hint, never for liveness).

A worker is *router-eligible* when: its slot is READY, its heartbeat is younger than
``heartbeat_timeout_ms``, its probes have not failed ``max_failures`` times in a row, it is not
drained or removed by an admin, its breaker lets requests through, it serves the requested model
(or announces none), and this request has not already tried it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from router.breaker import CLOSED, CircuitBreaker
from router.config import Config

READY = 2  # dplb_shm.WorkerState.READY
DRAINING = 3


class WorkerHandle:
    """Router-local state of one worker (slot ``worker_id``)."""

    __slots__ = (
        "breaker",
        "drained",
        "endpoint",
        "last_head_at",
        "local_inflight",
        "mirror",
        "model",
        "pid",
        "probe_failures",
        "probe_ok",
        "snap",
        "worker_id",
    )

    def __init__(self, worker_id: int, endpoint: str, model: str, breaker: CircuitBreaker, pid: int = 0) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.model = model
        self.breaker = breaker
        self.probe_failures = 0
        self.probe_ok = True
        self.last_head_at = 0.0  # time.monotonic() of the last response head this worker sent us
        self.drained = False
        self.local_inflight = 0
        self.snap: Any = None
        self.mirror = False
        self.pid = pid

    def serves(self, model: str | None) -> bool:
        """True when this worker can serve ``model`` (None = any; an empty worker model = any)."""
        return model is None or not self.model or self.model == model

    def router_eligible(self) -> bool:
        """Probes, admin and breaker allow it (slot state/heartbeat are checked elsewhere)."""
        return self.probe_ok and not self.drained and self.breaker.available()


class Registry:
    """Handles of every live worker in the segment; :meth:`sync` reconciles them with a snapshot.

    ``seg``: a ``dplb_shm.Segment``; ``on_leave(worker_id, endpoint)`` is called when a worker
    leaves or its slot is reused by another process (policies forget it, pools are closed).
    ``clock``: the routing clock (ns, heartbeat domain) that heartbeat ages are judged against;
    None (live) = the age the snapshot computed when it was read (CLOCK_MONOTONIC). A virtual-time
    simulator passes its own clock, the same one its slot writers and the kernel use.
    """

    def __init__(self, seg: Any, cfg: Config, on_leave: Callable[[int, str], None] | None = None,
                 on_circuit: Callable[[int, int], None] | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.seg = seg
        self.clock = clock
        self.cfg = cfg
        self.handles: dict[int, WorkerHandle] = {}
        self.on_leave = on_leave
        self.on_circuit = on_circuit
        self.drained: set[int] = set()
        self.removed: set[int] = set()
        self.hb_timeout_ms = float(cfg.health_check.heartbeat_timeout_ms)

    def _breaker(self, wid: int) -> CircuitBreaker:
        cb = self.cfg.circuit_breaker

        def changed(state: int) -> None:
            if self.on_circuit is not None:
                self.on_circuit(wid, state)

        return CircuitBreaker(cb.failure_rate_threshold if cb.enabled else 2.0, cb.minimum_requests,
                              cb.window_size, cb.open_time_s, on_change=changed)

    def sync(self, snaps: Iterable[Any]) -> None:
        """Reconcile handles with ``snaps`` (every slot): new live slots get a handle, slots that
        became EMPTY/DEAD or changed endpoint/pid lose theirs."""
        seen = set()
        for s in snaps:
            st = int(s.state)
            if st in (0, 4) or not s.endpoint or s.worker_id in self.removed:
                continue
            wid = s.worker_id
            seen.add(wid)
            h = self.handles.get(wid)
            if h is not None and (h.endpoint != s.endpoint or h.pid != s.pid):
                self._leave(h)
                h = None
            if h is None:
                h = self.handles[wid] = WorkerHandle(wid, s.endpoint, s.model, self._breaker(wid), s.pid)
            h.model = s.model
            h.snap = s
            h.drained = wid in self.drained
        for wid in [w for w in self.handles if w not in seen]:
            self._leave(self.handles[wid])

    def _leave(self, h: WorkerHandle) -> None:
        self.handles.pop(h.worker_id, None)
        if h.breaker.state != CLOSED and self.on_circuit is not None:
            self.on_circuit(h.worker_id, CLOSED)
        if self.on_leave is not None:
            self.on_leave(h.worker_id, h.endpoint)

    def live(self, s: Any, now_ns: int | None = None) -> bool:
        """Slot READY with a fresh heartbeat: ``heartbeat_age_ms`` (computed at read time), or the
        age at ``now_ns`` / the registry's clock when one is given."""
        if now_ns is None and self.clock is not None:
            now_ns = self.clock()
        if now_ns is None:
            age_ms = float(s.heartbeat_age_ms)
        else:
            age_ms = (now_ns - int(s.heartbeat_ns)) / 1e6 if int(s.heartbeat_ns) > 0 else -1.0
        return int(s.state) == READY and age_ms <= self.hb_timeout_ms

    def candidates(self, model: str | None, exclude: set[int] | frozenset[int], fresh: bool | str) -> list[Any]:
        """Snapshots of router-eligible workers.

        ``fresh``: ``True``/``"fresh"`` re-reads each slot now (load-aware baselines, ~5 µs per
        slot); ``"cached"`` uses the last synced snapshot but still requires it READY and fresh
        (round_robin/random: no load read, liveness as of the last tick, ≤ one health interval old);
        ``False``/``"kernel"`` uses the last synced snapshot unchecked (the kernel re-reads state,
        heartbeat and circuit of the live slot itself)."""
        out = []
        cached = fresh == "cached"
        if fresh == "kernel" or cached:
            fresh = False
        for wid, h in self.handles.items():
            if wid in exclude or not h.router_eligible() or not h.serves(model):
                continue
            if cached:
                s = h.snap
                if s is not None and self.live(s) and int(s.circuit) != 1:
                    out.append(s)
            elif fresh:
                s = self.seg.read_slot(wid)
                # circuit 1: another router process opened it (the kernel skips it too)
                if not self.live(s) or s.endpoint != h.endpoint or int(s.circuit) == 1:
                    continue
                h.snap = s
                out.append(s)
            elif h.snap is not None:
                out.append(h.snap)
        return out

    def ready_handles(self) -> list[WorkerHandle]:
        """Handles that are eligible right now as far as the last synced snapshot shows."""
        return [h for h in self.handles.values() if h.snap is not None and self.live(h.snap) and h.router_eligible()]

    def models(self) -> list[str]:
        """Models served by ready workers (sorted, empty names left out)."""
        return sorted({h.model for h in self.ready_handles() if h.model})

    def knows_model(self, model: str | None) -> bool:
        """False only when ``model`` is named, some worker is live, and none serves it."""
        if model is None or not self.handles:
            return True  # with no worker up the answer is 503, not "unknown model"
        for h in self.handles.values():
            if h.snap is not None and int(h.snap.state) in (READY, DRAINING) and h.serves(model):
                return True
        return False

    def status_rows(self) -> list[dict[str, Any]]:
        """Per-worker rows of ``GET /dplb/status``."""
        from router.breaker import STATE_NAMES

        rows = []
        for wid in sorted(self.handles):
            h = self.handles[wid]
            s = h.snap
            eligible = s is not None and self.live(s) and h.router_eligible()
            if h.drained:
                st = "draining"
            elif s is None:
                st = "unknown"
            else:
                st = s.state.name.lower() if hasattr(s.state, "name") else str(s.state)
            if st == "ready" and not h.probe_ok:
                st = "unhealthy"
            if st == "ready" and s is not None and not self.live(s):
                st = "stale"
            rows.append({
                "id": wid, "worker_id": wid, "state": st, "eligible": eligible, "endpoint": h.endpoint,
                "model": h.model, "remote": h.mirror,
                "inflight": getattr(s, "inflight", None), "router_inflight": getattr(s, "router_inflight", None),
                "local_inflight": h.local_inflight,
                "running": getattr(s, "num_running", None), "waiting": getattr(s, "num_waiting", None),
                "kv_cache_usage": getattr(s, "kv_cache_usage", None),
                "latency_ms": {"ttft": getattr(s, "ttft_ms", None), "tpot": getattr(s, "tpot_ms", None),
                               "e2e": getattr(s, "e2e_ms", None)},
                "heartbeat_age_ms": getattr(s, "heartbeat_age_ms", None),
                "circuit": STATE_NAMES[h.breaker.state], "failure_rate": round(h.breaker.failure_rate, 4),
                "probe_failures": h.probe_failures, "weight": getattr(s, "weight", None),
            })
        return rows
