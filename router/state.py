"""The router's state: everything one router process holds (:class:`RouterState`: the segment,
the registry, the policy, the scheduler and its lease accounting, the transport, the health monitor,
the admin store, the mirrors, the metrics and request control, the
:class:`~router.director.Director`), and the builders of the kernel's and the accounting's
parameters from the config.

No web framework and no HTTP edge here: the HTTP router (:mod:`router.app`: its hot path
:class:`~router.proxy.Proxy`, FastAPI for the control API in :mod:`router.control`) and the
gateway's endpoint picker (:mod:`epp`) both hold one and call its Director.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from dplb_shm import ScoringParams, TtftParams
from router.access_log import AccessLog
from router.accounting import LearnSettings
from router.admin_store import AdminStore
from router.admission_gate import AdmissionGate
from router.config import Config
from router.director import Director
from router.health import HealthMonitor
from router.ledger import AccountedSegment, Ledger, shares_dir, sweep_dead
from router.metrics import Metrics
from router.mirror import MirrorManager
from router.policies import build_policy
from router.scheduling import Scheduler
from router.transport import Transport
from router.workers import Registry

if TYPE_CHECKING:
    from dplb_shm import Segment
    from router.admin_store import MirrorSpec
    from router.events_index import EventsFeed

log = logging.getLogger("dplb.router")


def attach_segment(name: str, wait_s: float = 10.0) -> Segment:
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


def ttft_params(cfg: Config) -> TtftParams:
    """The estimated-TTFT kernel's parameters (``dplb_shm.TtftParams``) from the config."""
    rp = cfg.routing_policy
    return TtftParams(prefill_rate=rp.prefill_tokens_per_s, waiting_tokens=float(rp.waiting_tokens),
                      step_tokens=float(rp.step_tokens),
                      step_base_s=rp.step_base_ms / 1e3, decode_seq_s=rp.decode_seq_ms / 1e3,
                      decode_ctx_s=rp.decode_ctx_ns / 1e9, kv_barrier_s=rp.kv_barrier_s, w_decode=rp.w_decode,
                      w_interf=rp.w_interf, w_miss=rp.w_miss, interf_batch_cap=float(rp.interf_batch_cap),
                      kv_cache_threshold=rp.kv_cache_threshold, rate_band=rp.rate_band,
                      heartbeat_timeout_ms=float(cfg.health_check.heartbeat_timeout_ms))


def scoring_params(cfg: Config) -> ScoringParams:
    """The weighted kernel's parameters (``dplb_shm.ScoringParams``) from the config."""
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
                         decode_seq_s=rp.decode_seq_ms / 1e3, decode_ctx_s=rp.decode_ctx_ns / 1e9,
                         attention_tokens=rp.attention_tokens)


class RouterState:
    """Everything one router process holds. ``seg``: an attached ``dplb_shm.Segment`` (attached
    from ``cfg.shm_name`` in :meth:`start` when None; closed in :meth:`stop` only if we attached)."""

    #: whether the Director writes access lines (``router.access_log``): the HTTP router's do,
    #: the endpoint picker's not (Envoy keeps the gateway's access log)
    access_log = False

    # Any: a dplb_shm.Segment, None until start() attaches one; its readers hold it non-None without a check
    def __init__(self, cfg: Config, seg: Any = None) -> None:  # type: ignore[explicit-any]
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
        #: request control (:class:`~router.director.Director`), built by :meth:`start`
        self.director: Director | None = None
        #: the engines' KV-cache events as the policy's prefix index (``kv_events.enabled``)
        self.events: EventsFeed | None = None

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
        if cfg.kv_events.enabled:
            self._start_events()
        self.monitor.start()
        self.metrics.attach(self.registry, self.seg, self.policy.name, self.scheduler.routing_state,
                            cfg.retries.retry_on_status, cfg.routing_policy.prefill_tokens_per_s)
        #: the admission step (docs/admission.md): the queue while the engines are saturated
        self.admission = AdmissionGate(cfg.admission, self.scheduler, self.metrics)
        self.director = Director(self.scheduler, self.metrics, self.policy.needs_text,
                                 AccessLog(cfg.router.access_log) if self.access_log else None,
                                 self.admission if cfg.admission.enabled else None)

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
        await self.admission.close()
        await self.monitor.stop()
        self.mirrors.close()
        if self.events is not None:
            self.events.close()
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

    def _start_events(self) -> None:
        """``kv_events.enabled``: the engines' KV-cache events as the policy's prefix index
        (:mod:`router.events_index`), subscribed on every health tick after the mirrors'."""
        from router.events_index import EventsFeed, WordTokenizer, install, wanted

        ke = self.cfg.kv_events
        feed = self.events = EventsFeed(ke.block_size, WordTokenizer(ke.vocab_size), ke.pending_s)
        # the own index stays filled where a policy reads its sizes, or where its hashes are shared
        # with the other replicas (share.url: they travel with each placement)
        if not install(self.policy, feed, own_index=True if self.cfg.share.url else None):
            log.warning("kv_events.enabled: policy %s keeps no prefix index; the events are not read",
                        self.policy.name)

        async def sync() -> None:
            feed.sync(wanted(self.mirrors.wanted, self.mirrors.slot_of))

        self.monitor.extra.insert(self.monitor.extra.index(self.mirrors.tick) + 1, sync)

    def apply_admin(self) -> None:
        """Push the admin store into the registry and the mirror manager."""
        a = self.admin
        self.registry.drained = set(a.drained)
        self.registry.removed = set(a.removed)
        for wid, h in self.registry.handles.items():
            h.drained = wid in a.drained
        wanted: dict[str, MirrorSpec] = {}
        for b in self.cfg.backend_servers:
            if b.endpoint not in a.unmirrored:
                spec: MirrorSpec = {"weight": b.weight, "model": b.model}
                wanted[b.endpoint] = spec
                if b.kv_events:
                    spec["kv_events"] = b.kv_events
                    if b.kv_events_replay:
                        spec["kv_events_replay"] = b.kv_events_replay
        wanted.update(a.mirrors)
        self.mirrors.wanted = wanted
        self.mirrors.version = a.version

    async def _sweep(self) -> None:
        """Health-tick extra: non-streamed requests past their estimated TTFT leave prefill; the
        coalesced request counters reach prometheus_client (:meth:`Metrics.flush`); the count of
        5xx warnings held back is written (:data:`router.access_log.REPEATS`)."""
        from router.access_log import REPEATS

        self.scheduler.sweep()
        self.metrics.flush()
        REPEATS.flush()

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
