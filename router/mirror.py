"""Mirror slots for remote workers (``host:port`` backends from config or the admin API).

A remote node runs its own agents and segment; this router keeps one slot of its *local* segment
per remote agent and fills it from the agent's ``GET /dplb/state`` (``WorkerSnapshot.to_dict()``
JSON) every health interval, so the kernel scores local and remote workers alike. Mirror slots
are taken from the top of the segment down (agents use the low slots ``0..N-1``).

The wanted address is the remote agent's **control** address (its control API on TCP:
``dplb-worker-agent --control-port P``); it becomes the slot's ``control``. The slot's
``endpoint`` (where requests go, one hop) is the remote **engine's** address from the state:
``host:port`` as published, with a loopback or unspecified host (``127.0.0.1``, ``0.0.0.0``,
``::``, ``localhost``) replaced by the agent's host, since that is the node the engine runs on. An
engine that listens on a Unix socket cannot be reached from another node: that mirror stays DEAD
with a warning (start the remote agent with ``--engine-host``). A state without an ``endpoint``
(a server that serves the API and the control paths on one address) is forwarded to directly.

One owner writes every mirror slot (issue 27, item 7: concurrent admin add/remove of one endpoint
leaked slots that no one wrote or released any more, and that a DELETE could not remove):

- **One process.** Only the router process holding an exclusive ``flock`` on
  ``<state_dir>/mirror.lock`` (the *leader*, held for the process's life) claims, publishes or
  releases a mirror slot; the other ``--workers`` processes see mirror slots as ordinary workers.
  It claims with ``pid`` = its own pid and ``control`` = the agent's address: that pair is the
  slot's owner mark, checked before every write (:meth:`MirrorManager.owns`).
- **One place in it.** :meth:`MirrorManager.reconcile` is the only code that claims or releases,
  and it is synchronous (no ``await`` inside: nothing else of the event loop runs between its
  reads and its writes), run after every admin change and every health tick. The state fetch
  (:meth:`MirrorManager.refresh_one`) awaits the network *outside* it and writes only if the
  slot's writer is still the one it started with (not released or replaced meanwhile) and the
  slot still carries the owner mark; one fetch per endpoint at a time.
- **A record for the next owner.** After every change the leader writes
  ``<state_dir>/mirror-slots.json`` atomically: its pid, the admin version (``admin.json``'s
  counter, :class:`router.admin_store.AdminStore`) it has applied, ``slots`` (endpoint → slot) and
  ``errors`` (wanted endpoints without a slot, and why). A process that becomes leader (the old
  one died: the kernel dropped its lock) adopts the recorded slots that still carry the old
  owner's mark and releases those no longer wanted: no mirror slot is left without an owner.
  Admin calls answered by another process wait (bounded) until the record shows their version
  applied, so their answer names the slot the leader claimed, or says that it released it.
- **Agents.** An agent claims its own fixed slot (``0..N-1``) and mirrors take the highest EMPTY
  one; a claim is a plain write, not a compare-and-swap, so the two meet only in a segment too
  small for both. Then the agent's claim wins: the leader sees its owner mark gone at its next
  write, drops that slot without touching it and claims another one (a mirror write that slipped
  in between is overwritten by the agent's next publish, which writes its whole slot).
- **The generation counter** in the segment header is bumped by every claim and release: it tells
  the other processes' registries that membership moved (they re-read the slots), it arbitrates
  nothing. Limits: a dead leader's pid reused by a new agent before a successor adopts would let
  the successor take that agent's slot only if its ``control`` were also the recorded endpoint;
  a record lost with its state dir (removed by hand while every router was killed) leaves that
  segment's mirror slots to be released by hand (``dplb-shm-dump`` shows them with a dead pid).
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import orjson

from dplb_shm import WorkerSnapshot
from dplb_shm.types import SlotFields
from router.errors import TransportError
from router.transport import Transport
from router.workers import EMPTY
from worker_agent.metrics import (
    SGLANG,
    VLLM,
    EngineMetrics,
    parse_engine_metrics,
    slot_fields,
)

if TYPE_CHECKING:
    from dplb_shm import Segment, SlotWriter
    from router.admin_store import MirrorSpec

log = logging.getLogger("dplb.router.mirror")

# fields of /dplb/state that a mirror copies into its slot (SlotWriter.publish names)
COPIED = ("num_running", "num_waiting", "queued_prompt_tokens", "max_num_seqs", "kv_cache_usage",
          "gpu_mem_used_bytes", "gpu_mem_total_bytes", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_p99_ms",
          "tpot_p99_ms", "e2e_p99_ms", "prompt_len_hist", "restarts", "agent_restarts", "last_exit_code", "state_reason")
STATES = {"empty": 0, "starting": 1, "ready": 2, "draining": 3, "dead": 4}
LOCAL_HOSTS = frozenset({"127.0.0.1", "0.0.0.0", "::", "::1", "[::1]", "[::]", "localhost", ""})


def split_host(endpoint: str) -> tuple[str, str]:
    """``host:port`` → (host, port); an IPv6 host keeps its brackets."""
    host, _, port = endpoint.rpartition(":")
    return host, port


def starved_timeout(err: BaseException, t0: float, timeout_s: float) -> bool:
    """True when ``err`` is a timeout that says nothing about the far end: the call, started at
    ``t0`` (``time.monotonic()``), ended more than ``2 * timeout_s`` later, so this process's own
    timers fired late (a starved event loop on a busy machine) and the answer may never have been
    read. Such a fetch is no verdict, the same rule as :meth:`router.health.HealthMonitor.probe`."""
    return (isinstance(err, TransportError) and err.kind == "timeout"
            and time.monotonic() - t0 > 2 * timeout_s)


def data_endpoint(published: str | None, control: str) -> str | None:
    """Where requests to a remote worker go: the engine address its agent ``published`` in
    ``/dplb/state``, reached from here (module docstring); None when it cannot be (a Unix socket
    on another node)."""
    if not published:
        return control
    if published.startswith("/"):
        return None
    host, port = split_host(published)
    if host.startswith("127.") or host in LOCAL_HOSTS:
        host = split_host(control)[0]
    return f"{host}:{port}"
READY, DEAD = 2, 4


def engine_metrics(text: str) -> EngineMetrics:
    """Running, waiting and KV-cache usage of a ``/metrics`` page: vLLM's families, else
    SGLang's (an empty :class:`EngineMetrics` when neither is there or the page is malformed)."""
    for names in (VLLM, SGLANG):
        try:
            m = parse_engine_metrics(text, names)
        except ValueError:
            return EngineMetrics()
        if not m.empty:
            return m
    return EngineMetrics()


REASONS = {"none": 0, "engine_exited": 1, "start_failed": 2, "gave_up": 3, "admin_restart": 4, "agent_exited": 5}


RECORD = "mirror-slots.json"


class MirrorManager:
    """The owner of every mirror slot of this router's segment (module docstring).

    ``wanted``: endpoint (the agent's control address) → ``{"weight", "model"}`` and ``version``
    (the admin version it comes from) are set by :meth:`router.state.RouterState.apply_admin`;
    ``writers``: endpoint → the ``SlotWriter`` of its slot (leader only); ``errors``: wanted
    endpoints that have no slot, and why. ``timeout_s``: one ``/dplb/state`` fetch;
    ``max_failures``: failed fetches in a row before the slot is published DEAD. Subclasses that
    write other slots of the same segment (``dplb-epp``'s scraped endpoints, :mod:`epp.discovery`)
    name their own lock file (:attr:`LOCK`)."""

    #: the file in ``state_dir`` whose exclusive ``flock`` makes this process the writer
    LOCK = "mirror.lock"
    #: the file in ``state_dir`` where the writer records what it owns (module docstring)
    RECORD = RECORD

    def __init__(self, seg: Segment, transport: Transport, state_dir: str, timeout_s: float = 0.5,
                 max_failures: int = 3) -> None:
        self.seg = seg
        self.transport = transport
        self.state_dir = state_dir
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self.wanted: dict[str, MirrorSpec] = {}
        self.version = 0
        self.writers: dict[str, SlotWriter] = {}
        self.errors: dict[str, str] = {}
        self.failures: dict[str, int] = {}
        self._data: dict[str, str] = {}           # endpoint → the engine address last published
        self._fetching: dict[str, asyncio.Lock] = {}
        self._lock_fd: int | None = None
        # Any: a JSON document (the leader's record file), its fields read with int() and get(); the record last written (rewritten when it changes)
        self._written: Any = None                  # type: ignore[explicit-any]
        self.pid = os.getpid()

    # -- who owns what --------------------------------------------------------------------------
    def leader(self) -> bool:
        """Try (non-blocking) to hold the mirror lock; True while this process holds it. On
        taking it, adopts the previous leader's recorded slots (:meth:`_adopt`)."""
        if self._lock_fd is not None:
            return True
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.state_dir, self.LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        self.pid = os.getpid()
        self._adopt()
        self.reconcile()
        return True

    def owns(self, snap: WorkerSnapshot, endpoint: str, pid: int | None = None) -> bool:
        """Does slot ``snap`` carry the owner mark of the mirror of ``endpoint`` (claimed by
        process ``pid``, this one by default)?"""
        return int(snap.state) != EMPTY and snap.control == endpoint and snap.pid == (self.pid if pid is None else pid)

    def owner_pid(self) -> int | None:
        """PID that marks mirror slots: this process's while it leads, else the recorded
        leader's (None before any process led)."""
        if self._lock_fd is not None:
            return self.pid
        rec = self.read_record()
        return int(rec["pid"]) if rec else None

    @staticmethod
    def is_mirror_slot(snap: WorkerSnapshot, owner: int | None) -> bool:
        """Is the (non-EMPTY) slot ``snap`` a mirror slot: marked by ``owner`` (:meth:`owner_pid`)?"""
        return owner is not None and int(snap.state) != EMPTY and bool(snap.control) and snap.pid == owner

    def slot_of(self, endpoint: str) -> int | None:
        """Slot mirroring the agent at ``endpoint`` (its control address): this process's own
        writer while it leads, else the record's; None when it has none."""
        if self._lock_fd is not None:
            w = self.writers.get(endpoint)
            return None if w is None else int(w.slot_index)
        rec = self.read_record()
        slot = (rec or {}).get("slots", {}).get(endpoint)
        return None if slot is None else int(slot)

    # Any: a JSON document (the leader's record file), its fields read with int() and get()
    def read_record(self) -> dict[str, Any] | None:  # type: ignore[explicit-any]
        """The leader's record (module docstring), or None when there is none (yet)."""
        try:
            with open(os.path.join(self.state_dir, self.RECORD), "rb") as f:
                d = orjson.loads(f.read())
        except (OSError, orjson.JSONDecodeError):
            return None
        return d if isinstance(d, dict) else None

    def _write_record(self) -> None:
        rec = {"pid": self.pid, "admin_version": self.version, "errors": dict(self.errors),
               "slots": {ep: int(w.slot_index) for ep, w in self.writers.items()}}
        if rec == self._written:
            return
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.state_dir, self.RECORD)
        tmp = f"{path}.{self.pid}.tmp"
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(rec))
        os.replace(tmp, path)
        self._written = rec

    def _adopt(self) -> None:
        """Take over the slots the previous leader recorded and still marks as its own (it died
        holding them); :meth:`reconcile` then releases those no longer wanted."""
        rec = self.read_record()
        if not rec or int(rec.get("pid", 0)) == self.pid:
            return
        old = int(rec["pid"])
        for ep, slot in dict(rec.get("slots", {})).items():
            if not 0 <= int(slot) < self.seg.num_slots:
                continue                     # a record from a segment of another size
            snap = self.seg.read_slot(int(slot))
            if ep in self.writers or not self.owns(snap, ep, old):
                continue
            w = self.seg.writer(int(slot))   # starts from the slot's current content
            w.publish(pid=self.pid)          # the owner mark is now ours
            self.writers[ep] = w
            self._data[ep] = snap.endpoint
            log.warning("mirror slot %d of %s adopted from router process %d (gone)", slot, ep, old)

    # -- the state machine ----------------------------------------------------------------------
    def reconcile(self) -> None:
        """Make the mirror slots match ``wanted`` (leader only; synchronous, module docstring):
        release the slots of endpoints no longer wanted, forget slots an agent took over, claim
        the highest EMPTY slot for each wanted endpoint that has none (``errors`` says why when
        there is none), then write the record."""
        if self._lock_fd is None:
            return
        for ep, w in list(self.writers.items()):
            mine = self.owns(self.seg.read_slot(w.slot_index), ep)
            if ep not in self.wanted or not mine:
                del self.writers[ep]
                # a worker added again starts afresh: its old count would never equal max_failures
                # again, and an unreachable one would stay STARTING for good
                self.failures.pop(ep, None)
                if mine:
                    w.release()
                else:
                    log.warning("mirror slot %d of %s was claimed by another writer; mirroring it elsewhere",
                                w.slot_index, ep)
        for ep in [e for e in self.errors if e not in self.wanted]:
            del self.errors[ep]
        free = [s.worker_id for s in reversed(self.seg.snapshot()) if int(s.state) == EMPTY]
        for ep, spec in self.wanted.items():
            if ep in self.writers:
                continue
            if not free:
                if ep not in self.errors:
                    log.warning("no free slot in segment %s to mirror %s", self.seg.name, ep)
                self.errors[ep] = f"no free slot in segment {self.seg.name} ({self.seg.num_slots} slots)"
                continue
            slot = free.pop(0)
            w = self.seg.writer(slot)
            w.claim(worker_id=slot, pid=self.pid, endpoint=self._data.get(ep, ep), control=ep,
                    weight=float(spec.get("weight", 1.0)), model=spec.get("model") or "")
            # a slot reused for another worker starts with fresh counters and learned averages
            # (EMPTY a moment ago: no router holds a lease on it)
            self.seg.router_reset(slot)
            self.writers[ep] = w
            self.errors.pop(ep, None)
        self._write_record()

    # Any: a JSON document (the leader's record file), its fields read with int() and get()
    async def wait_applied(self, version: int, timeout_s: float) -> dict[str, Any] | None:  # type: ignore[explicit-any]
        """Wait until the leader's record shows admin ``version`` (or a later one) applied and
        return the record; None after ``timeout_s``. Becomes the leader itself if there is none
        (the last one died), then the record is its own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            if self.leader():
                self.reconcile()
                return dict(self._written or {})
            rec = self.read_record()
            if rec is not None and int(rec.get("admin_version", -1)) >= version:
                return rec
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(0.02)

    async def refresh(self) -> None:
        """Pull every mirrored agent's state into its slot, all at once (leader only)."""
        if self._lock_fd is None:
            return
        await asyncio.gather(*(self.refresh_one(ep) for ep in list(self.writers)))

    def is_engine(self, endpoint: str) -> bool:
        """Is the wanted ``endpoint`` a plain engine without an agent (``MirrorSpec["engine"]``),
        scraped (:meth:`scrape_one`) rather than asked for its ``/dplb/state``?"""
        return bool(self.wanted.get(endpoint, {}).get("engine"))

    async def refresh_one(self, endpoint: str) -> None:
        """Pull one remote agent's state (``endpoint``: its control address) into its slot,
        claiming the slot again when the engine's address changed (a plain engine is scraped
        instead: :meth:`scrape_one`). Writes nothing when the slot was released, replaced or taken
        by another writer while the fetch was out."""
        lock = self._fetching.setdefault(endpoint, asyncio.Lock())
        async with lock:
            if self.is_engine(endpoint):
                await self.scrape_one(endpoint)
                return
            w: SlotWriter | None = self.writers.get(endpoint)
            if w is None:
                return
            before = self._router_inflight(w)
            # Any: the remote agent's /dplb/state JSON, checked a dict below, its fields read with get()
            d: Any = None  # type: ignore[explicit-any]
            err: Exception | None = None
            t0 = time.monotonic()
            try:
                status, body = await self.transport.get(endpoint, "/dplb/state", self.timeout_s)
                if status != 200:
                    raise TransportError("status", endpoint, str(status))
                d = orjson.loads(body)
                if not isinstance(d, dict):
                    raise TypeError("/dplb/state is not a JSON object")
            except (TransportError, orjson.JSONDecodeError, ValueError, TypeError) as e:
                err = e
            spec = self.wanted.get(endpoint)
            now = self.writers.get(endpoint)
            if now is None or now is not w or spec is None:
                return                               # released or replaced while the fetch was out
            cur = self.seg.read_slot(w.slot_index)
            if not self.owns(cur, endpoint):
                return                               # taken by another writer: reconcile moves it
            if err is not None:
                if starved_timeout(err, t0, self.timeout_s):
                    return                           # no verdict: this process was starved, not the agent slow
                n = self.failures[endpoint] = max(0, self.failures.get(endpoint, 0)) + 1
                if n >= self.max_failures:
                    if n == self.max_failures:
                        log.warning("remote worker %s unreachable (%s): marking it dead", endpoint, err)
                    w.publish(state=4)
                return
            self._publish(endpoint, spec, w, cur, d, before)

    # Any: d: the remote agent's /dplb/state JSON object (fields read with get(), copied as they came)
    def _publish(self, endpoint: str, spec: MirrorSpec, w: SlotWriter, cur: WorkerSnapshot, d: dict[str, Any],  # type: ignore[explicit-any]
                 before: int) -> None:
        data = data_endpoint(d.get("endpoint"), endpoint)
        if data is None:
            if self.failures.get(endpoint) != -1:
                log.warning("remote worker %s serves its engine on a Unix socket (%s), which this node cannot "
                            "reach: start its agent with --engine-host; marking it dead", endpoint,
                            d.get("endpoint"))
            self.failures[endpoint] = -1
            w.publish(state=4)
            return
        if cur.endpoint != data:
            w.claim(worker_id=w.slot_index, pid=self.pid, endpoint=data, control=endpoint,
                    weight=float(spec.get("weight", 1.0)), model=spec.get("model") or "")
            self._data[endpoint] = data
        fields = {k: d[k] for k in COPIED if k in d and d[k] is not None}
        if "num_running" in fields or "num_waiting" in fields:
            # the remote engine's counts go with the in-flight count of THIS node's routers at
            # the same fetch: what the engine holds beyond it (the remote node's own routers'
            # requests, anything else) is outside load to us (csrc/dplb_kernel.h, X_i)
            fields["inflight"] = max(before, self._router_inflight(w))
        if spec.get("model") or d.get("model"):
            fields["model"] = spec.get("model") or d.get("model")
        wt = spec.get("weight", d.get("weight"))
        fields["weight"] = float(wt) if wt is not None else 1.0
        fields["state"] = STATES.get(str(d.get("state", "ready")).lower(), 2)
        if "state_reason" in fields:
            fields["state_reason"] = REASONS.get(str(fields["state_reason"]).lower(), 0)
        w.publish(**fields)
        self.failures[endpoint] = 0

    async def scrape_one(self, endpoint: str) -> None:
        """Scrape the plain engine at ``endpoint`` (no agent: its address is the slot's endpoint
        and its owner mark) once into its slot, as ``dplb-epp --endpoints-file`` does
        (:mod:`epp.discovery`): its Prometheus ``/metrics`` with the agent's parser (vLLM's names,
        else SGLang's): running, waiting, KV-cache usage, and this node's in-flight count read at
        the same scrape. A page without those families (or no ``/metrics``, answered below 500)
        publishes the in-flight count as the engine's running requests. READY after a scrape
        answered, DEAD after ``max_failures`` failed ones in a row; the router's probes
        (``GET /health``) still decide eligibility."""
        w = self.writers.get(endpoint)
        if w is None:
            return
        before = self._router_inflight(w)
        t0 = time.monotonic()
        try:
            status, body = await self.transport.get(endpoint, "/metrics", self.timeout_s)
            if status >= 500:
                raise TransportError("status", endpoint, str(status))
        except TransportError as e:
            if starved_timeout(e, t0, self.timeout_s) or self.writers.get(endpoint) is not w:
                return   # no verdict (this process was starved, not the engine slow), or released meanwhile
            n = self.failures[endpoint] = max(0, self.failures.get(endpoint, 0)) + 1
            if n >= self.max_failures:
                if n == self.max_failures:
                    log.warning("endpoint %s fails (%s): marking it dead", endpoint, e)
                w.publish(state=DEAD)
            return
        spec = self.wanted.get(endpoint)
        if spec is None or self.writers.get(endpoint) is not w or not self.owns(self.seg.read_slot(w.slot_index), endpoint):
            return   # released, replaced or taken by another writer while the scrape was out
        m = engine_metrics(body.decode("utf-8", "replace")) if status == 200 else EngineMetrics()
        inflight = max(before, self._router_inflight(w))
        fields: SlotFields = {"state": READY, "weight": float(spec.get("weight", 1.0))}
        if model := spec.get("model"):
            fields["model"] = model
        fields.update(slot_fields(m, inflight, stand_in=True))
        if self.failures.get(endpoint, 0) >= self.max_failures:
            log.warning("endpoint %s answers again", endpoint)
        self.failures[endpoint] = 0
        w.publish(**fields)

    def _router_inflight(self, w: SlotWriter | None) -> int:
        """This node's routers' in-flight count on ``w``'s slot (0 before it has one)."""
        if w is None:
            return 0
        return max(0, int(self.seg.router_inflight_get(w.slot_index)))

    async def tick(self) -> None:
        """Health tick: (try to) lead, reconcile, refresh every mirror."""
        if not self.leader():
            return
        self.reconcile()
        await self.refresh()

    def close(self) -> None:
        """Release every mirror slot this process writes, record that, and drop the lock."""
        for ep, w in self.writers.items():
            try:
                if self.owns(self.seg.read_slot(w.slot_index), ep):
                    w.release()
            except Exception as e:  # noqa: BLE001 - segment may already be closed
                log.debug("releasing a mirror slot failed: %s", e)
        self.writers.clear()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                self._write_record()
            os.close(self._lock_fd)
            self._lock_fd = None
