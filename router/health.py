"""Background upkeep of one router process: segment sync, active probes, gauges, admin state.

Every ``health_check.interval_ms`` (200 ms) the :class:`HealthMonitor`:

1. re-reads the segment and reconciles the registry (new workers appear, gone ones leave);
2. probes ``GET /health`` on every ready or draining worker's **engine** (the data endpoint
   requests go to; the agent is off the request path; a worker still starting is not in rotation
   and its engine may not listen yet, so it is not probed and a start logs no failed probes)
   with ``timeout_ms`` (50 ms): any answer below 500 passes (a
   server without ``/health`` answers 404 and is alive; readiness is the slot's state). ``max_failures``
   (3) failures in a row take the worker out, one success brings it back. A probe that merely timed
   out is not held against a worker that sent a response head to a real request, or a chunk of a
   stream this router relays (``Transport.last_rx``), within the last tick (it is busy, not hung:
   an engine's ``/health`` shares its event loop with the streams it serves), nor counted at all
   when this router's own event loop woke up
   late by more than the probe timeout (the timer cannot tell a slow worker from a starved
   router; on a saturated 2-core machine 50 ms timeouts otherwise flap healthy workers out).
   Refused connections, error statuses and hung workers (no response heads either) still count;
3. reloads the admin state file when it changed (drain/remove made through another process);
4. refreshes remote mirror slots (only in the process holding the mirror lock, see
   :mod:`router.mirror`).

The per-worker gauges are not sampled here: ``/metrics`` reads the segment when it is scraped
(:class:`router.metrics.SegmentCollector`), so a burst between two ticks is not missed.

Heartbeat staleness and slot state are checked on every decision from the live segment, not here.
The monitor is also the :class:`router.scheduling.HealthReporter` that leases report to: a refused
connection takes the worker out at once (:meth:`HealthMonitor.on_refused`), a response head is
liveness evidence (:meth:`HealthMonitor.on_head`). Nothing else writes probe state.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from router.errors import TransportError
from router.transport import Transport
from router.workers import DRAINING, READY, Registry, WorkerHandle

if TYPE_CHECKING:
    from router.metrics import Metrics

log = logging.getLogger("dplb.router.health")


class HealthMonitor:
    """Periodic sync + probes. ``extra``: async callables run every tick (admin reload, mirrors)."""

    def __init__(self, registry: Registry, transport: Transport, metrics: Metrics, interval_ms: int = 200,
                 timeout_ms: int = 50, max_failures: int = 3, probes: bool = True) -> None:
        self.registry = registry
        self.transport = transport
        self.metrics = metrics
        self.interval = interval_ms / 1000.0
        self.timeout = timeout_ms / 1000.0
        self.max_failures = max_failures
        self.probes = probes
        self.extra: list[Callable[[], Awaitable[None]]] = []
        self._task: asyncio.Task | None = None
        self.loop_lag = 0.0  # seconds the last tick started late (event-loop starvation)

    def sync(self) -> None:
        """Reconcile the registry with the segment now (cheap enough to call on demand)."""
        self.registry.refresh()

    def sync_if_changed(self) -> None:
        """Sync only when the segment's membership generation moved (hot path)."""
        self.registry.refresh_if_changed()

    # -- HealthReporter: what leases report ------------------------------------------------------
    def on_refused(self, h: WorkerHandle) -> None:
        """Nothing accepted a connection to ``h``'s engine: out now, not after ``max_failures``
        probes (a passing probe brings it back)."""
        h.probe_failures = max(h.probe_failures, self.max_failures)
        if h.probe_ok:
            log.warning("worker %d out: its engine at %s refused a connection", h.worker_id, h.endpoint)
        h.probe_ok = False

    def on_head(self, h: WorkerHandle) -> None:
        """``h`` answered a real request with a response head: busy is not hung."""
        h.last_head_at = time.monotonic()

    async def probe(self, h: WorkerHandle) -> bool:
        """One ``GET /health`` probe; updates ``probe_failures``/``probe_ok``; returns success."""
        t0 = time.monotonic()
        try:
            status, _ = await self.transport.get(h.endpoint, "/health", self.timeout)
            ok = status < 500
        except TransportError as e:
            ok = False
            if e.kind == "timeout":
                now = time.monotonic()
                late = max(self.loop_lag, now - t0 - self.timeout)  # our timers fired this late
                busy = max(h.last_head_at, self.transport.last_rx(h.endpoint))
                if late > self.timeout or now - busy <= self.interval + self.timeout:
                    return False  # no verdict: a starved router or a busy-but-answering worker
        except Exception:
            log.exception("probe of worker %d failed unexpectedly", h.worker_id)
            ok = False
        if ok:
            if not h.probe_ok:
                log.warning("worker %d passes probes again", h.worker_id)
            h.probe_failures = 0
            h.probe_ok = True
        else:
            h.probe_failures += 1
            if h.probe_ok and h.probe_failures >= self.max_failures:
                log.warning("worker %d out: %d failed probes", h.worker_id, h.probe_failures)
                h.probe_ok = False
        return ok

    async def tick(self) -> None:
        """One round: sync, extras, probes (the per-worker gauges are read from the segment when
        ``/metrics`` is scraped, :class:`router.metrics.SegmentCollector`)."""
        self.sync()
        for fn in self.extra:
            try:
                await fn()
            except Exception:
                log.exception("health tick extra failed")
        handles = [h for h in self.registry.handles.values()
                   if h.snap is not None and int(h.snap.state) in (READY, DRAINING)]
        if self.probes and handles:
            await asyncio.gather(*(self.probe(h) for h in handles))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("health tick failed")
            want = max(0.0, self.interval - (loop.time() - t0))
            t1 = loop.time()
            await asyncio.sleep(want)
            self.loop_lag = max(0.0, loop.time() - t1 - want)

    def start(self) -> None:
        """Sync once synchronously, then run ticks in the background."""
        self.sync()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Cancel the background task and wait for it."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001, S110 - we are stopping it
                pass
            self._task = None
