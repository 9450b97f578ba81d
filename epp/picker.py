"""The endpoint picker (:class:`Picker`): the router's own :class:`router.state.RouterState`
(scheduler, policies and native kernel, registry, breaker, health monitor with probes, accounting
on the segment's router lines and the process ledger, metrics, and request control, the
:class:`router.director.Director`) without any HTTP edge; endpoints from a file or an
InferencePool are scraped into slots by :class:`epp.discovery.ScrapeManager`.

The picker chooses and leases (:meth:`Picker.dispatch`, with up to :attr:`Picker.fallbacks`
other endpoints for Envoy's retries), moves a lease to the worker Envoy says served
(:meth:`Picker.served_by`), keeps its readiness (at least one eligible worker) and the pool's EDS
file (:mod:`epp.envoy`) current. Workers whose engine listens on a Unix socket cannot be Envoy
``ORIGINAL_DST`` targets and are left out (logged once). It speaks no protocol: the ext_proc
stream is :mod:`epp.stream`, the servers :mod:`epp.server`; it imports neither the router's HTTP
proxy nor uvicorn.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from epp.discovery import EndpointsFile, ScrapeManager
from epp.envoy import write_eds
from epp.events import EventsFeed, install, wanted
from epp.handoff import Handoffs
from router.config import Config
from router.director import Director
from router.errors import NoEligibleWorker
from router.policies.base import Decision, RequestInfo, pending
from router.scheduling import Lease
from router.state import RouterState
from router.workers import WorkerHandle

if TYPE_CHECKING:
    from dplb_shm import Segment
    from epp.kube import PoolWatcher
    from epp.share import PickerShare
    from router.admin_store import MirrorSpec

log = logging.getLogger("dplb.epp")

#: hosts an engine may publish that Envoy's ORIGINAL_DST cannot connect to as such (it needs an
#: IP literal; an unspecified address means "this node")
_LOCAL = {"0.0.0.0": "127.0.0.1", "localhost": "127.0.0.1", "[::]": "[::1]"}


def envoy_target(endpoint: str) -> str:
    """``endpoint`` as Envoy's ORIGINAL_DST cluster connects to it: an unspecified host
    (``0.0.0.0``, ``[::]``) or ``localhost`` becomes the loopback address, anything else is kept."""
    host, sep, port = endpoint.rpartition(":")
    local = _LOCAL.get(host)
    return f"{local}:{port}" if sep and local else endpoint


class Picker:
    """The router's pipeline for ``cfg`` without its HTTP server (module docstring). ``seg``: an
    attached segment to use (a private one; None: attach ``cfg.shm_name`` and share the node's
    router lines and ledger under ``cfg.state_dir``); ``endpoints_file``: engines without agents
    to scrape into slots (:mod:`epp.discovery`); ``kube``: an :class:`epp.kube.PoolWatcher` (not
    started; :meth:`start` starts it, :meth:`stop` stops it) whose endpoints are scraped the same way."""

    def __init__(self, cfg: Config, seg: Segment | None = None, endpoints_file: str | None = None,
                 kube: PoolWatcher | None = None,
                 fallbacks: int = 0, eds_path: str | None = None) -> None:
        self.state = RouterState(cfg, seg)
        #: the session header's name as the ext_proc headers carry it (lower case)
        self.session_header = cfg.routing_policy.session_header.lower()
        #: how many fallback endpoints follow the pick in the header (Envoy's pool cluster walks
        #: them on a connect failure or a reset before the response head; 0 for ORIGINAL_DST)
        self.fallbacks = fallbacks
        #: the pool cluster's EDS file, rewritten when the eligible endpoints change (:mod:`epp.envoy`)
        self.eds_path = eds_path
        self._eds: list[str] | None = None
        self._unix_only_warned = False
        self.endpoints = EndpointsFile(endpoints_file) if endpoints_file else None
        self.kube = kube
        self._file_eps: dict[str, MirrorSpec] = {}
        self._kube_eps: dict[str, MirrorSpec] = {}
        self.scrape: ScrapeManager | None = None
        self._unix_warned: set[int] = set()
        self.ready = False
        #: the engines' KV-cache events as the prefix index (:mod:`epp.events`; None: the policy's own)
        self.events: EventsFeed | None = None
        #: the load and placements shared with the other replicas through Redis (:mod:`epp.share`; None: off)
        self.share: PickerShare | None = None
        #: the leases handed off to an observed response side (:mod:`epp.observe`)
        self.handoffs = Handoffs()
        #: called with the new readiness when it changes (the health server's statuses, :mod:`epp.server`)
        self.on_ready_change: Callable[[bool], Awaitable[None]] | None = None

    async def start(self) -> None:
        """Start the router state (attach, registry, probes), then the endpoint scraping."""
        st = self.state
        await st.start()
        if self.events is not None:
            install(st.policy, self.events)
        hc = st.cfg.health_check
        if self.kube is not None:
            self.kube.start()
        if self.endpoints is not None or self.kube is not None:
            self.scrape = ScrapeManager(st.seg, st.transport, st.cfg.state_dir,
                                        timeout_s=max(0.2, hc.interval_ms / 1000.0), max_failures=hc.max_failures)
            await self._discover()
            st.monitor.sync()
            st.monitor.extra.insert(0, self._discover)
        if self.share is not None:   # catches up before the first readiness
            await self.share.start()
        st.monitor.extra.append(self._readiness)
        st.monitor.extra.append(self.handoffs.tick)
        await self._readiness()
        self.warn_unix_only()

    async def stop(self) -> None:
        """Give the scraped slots back, then stop the router state."""
        await self.state.monitor.stop()
        if self.kube is not None:
            await asyncio.to_thread(self.kube.stop)
        if self.scrape is not None:
            self.scrape.close()
        if self.events is not None:
            self.events.close()
        if self.share is not None:
            await self.share.close()
        await self.state.stop()

    async def _discover(self) -> None:
        """Health-tick extra: take the endpoints file's and the pool's endpoints when they changed
        (the file's spec wins for an address in both), scrape every endpoint."""
        assert self.scrape is not None
        changed = False
        if self.endpoints is not None and (eps := self.endpoints.poll()) is not None:
            self._file_eps, changed = eps, True
        if self.kube is not None and (keps := self.kube.poll()) is not None:
            self._kube_eps, changed = keps, True
        if changed:
            # the endpoint specs ({"model", "weight"}) as the mirror manager reads them
            self.scrape.wanted = {**self._kube_eps, **self._file_eps}
        await self.scrape.tick()
        if self.events is not None:
            self.events.sync(wanted(self.scrape.wanted, self.scrape.slot_of))
        self.state.registry.refresh()   # this tick's decisions see the scrape's heartbeat and counts

    async def _readiness(self) -> None:
        """Health-tick extra: readiness (the gRPC health statuses), the EDS file, the Unix-socket warning."""
        if self.eds_path is not None:
            self.write_eds()
        self.warn_unix_only()
        # with the engines' events, only once every subscriber has caught up (their replay)
        ready = bool(self.state.scheduler.ready_handles()) and (self.events is None or self.events.caught_up()) \
            and (self.share is None or self.share.caught_up())
        if ready != self.ready:
            self.ready = ready
            log.info("picker %s", "ready" if ready else "not ready: no eligible worker")
            if self.on_ready_change is not None:
                await self.on_ready_change(ready)

    def write_eds(self) -> bool:
        """Write the eligible workers' TCP endpoints (as Envoy connects to them) to the EDS file
        when they changed; returns True when it wrote. An error is logged, not raised (the next
        tick tries again)."""
        assert self.eds_path is not None
        eps = sorted({envoy_target(h.endpoint) for h in self.state.scheduler.ready_handles()
                      if not h.endpoint.startswith("/")})
        if eps == self._eds:
            return False
        try:
            write_eds(self.eds_path, eps, version=str(time.time_ns()))
        except OSError as e:
            log.error("cannot write Envoy's EDS file %s: %s", self.eds_path, e)
            return False
        self._eds = eps
        log.info("Envoy pool endpoints: %s", ", ".join(eps) or "none")
        return True

    def warn_unix_only(self) -> bool:
        """Log a WARNING (once, until a TCP worker shows up) when every worker there is to pick from
        serves its engine on a Unix socket, which Envoy cannot reach: every request would be a 503.
        Returns True when it warned now."""
        handles = self.state.registry.handles
        if not handles or not all(h.endpoint.startswith("/") for h in handles.values()):
            self._unix_only_warned = False
            return False
        if self._unix_only_warned:
            return False
        self._unix_only_warned = True
        log.warning("every worker (%d) serves its engine on a Unix socket, which Envoy cannot route to: every "
                    "request will be refused with a 503. Start the agents with --engine-host 127.0.0.1 (engines on "
                    "loopback TCP), or launch with ./scripts/launch_dplb.sh --gateway envoy, which does", len(handles))
        return True

    def _unix(self) -> set[int]:
        """Workers whose engine listens on a Unix socket (Envoy cannot route there), logged once."""
        out = set()
        for wid, h in self.state.registry.handles.items():
            if h.endpoint.startswith("/"):
                out.add(wid)
                if wid not in self._unix_warned:
                    self._unix_warned.add(wid)
                    log.warning("worker %d serves its engine on a Unix socket (%s), which Envoy cannot route to: "
                                "left out (start its agent with --engine-host 127.0.0.1, or launch with --gateway envoy)", wid, h.endpoint)
        return out

    @property
    def director(self) -> Director:
        """Request control (:class:`router.director.Director`); the state must be started."""
        d = self.state.director
        assert d is not None, "the picker is not started"
        return d

    def dispatch(self, info: RequestInfo) -> tuple[WorkerHandle, Lease, list[WorkerHandle]]:
        """Choose a worker for ``info`` and take its lease (:meth:`Director.pick`, then
        :meth:`Director.lease`, the workers on Unix sockets left out); also up to :attr:`fallbacks` other
        eligible workers serving the model, least pending first (no lease, no policy state touched:
        they serve only when Envoy retries). Raises NoEligibleWorker."""
        sched = self.state.scheduler
        director = self.director
        unix = self._unix()
        try:
            h, d = director.pick(info, unix)
        except NoEligibleWorker as e:
            if unix:
                e.message += f" ({len(unix)} worker(s) on Unix sockets left out: Envoy routes to ip:port only)"
            raise
        lease = director.lease(h, d, info)
        if not self.fallbacks:
            return h, lease, []
        cands = sched.candidates(info.model, unix | {h.worker_id}, "cached")
        handles = sched.registry.handles
        alts = [handles[s.worker_id] for s in sorted(cands, key=pending)[:self.fallbacks] if s.worker_id in handles]
        return h, lease, alts

    def served_by(self, info: RequestInfo, endpoint: str) -> tuple[WorkerHandle, Lease] | None:
        """A lease on the worker at ``endpoint`` (as Envoy connects to it), which served a request
        picked for another (Envoy retried it there); None when no worker has that address."""
        for h in self.state.registry.handles.values():
            if envoy_target(h.endpoint) == endpoint:
                return h, self.director.lease(h, Decision(h.worker_id, "fallback"), info)
        return None

    def any_worker(self, path: str) -> WorkerHandle:
        """A worker for a request without a body (no lease: nothing to account). Raises
        NoEligibleWorker."""
        from dplb_protocol.wire import RequestInfo

        self.state.monitor.sync_if_changed()
        h, _ = self.state.scheduler.decide(RequestInfo(path=path), self._unix())
        return h


__all__ = ["Picker", "envoy_target"]
