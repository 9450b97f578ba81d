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

Only one router process may write a slot, so the process holding an exclusive ``flock`` on
``<state_dir>/mirror.lock`` does the mirroring; the others see the mirrored slots as ordinary
workers. If that process dies the lock is freed and another process adopts the slots (by
endpoint) on its next tick.
"""
from __future__ import annotations

import fcntl
import logging
import os
from typing import Any

import orjson

from router.errors import TransportError
from router.transport import Transport

log = logging.getLogger("dplb.router.mirror")

# fields of /dplb/state that a mirror copies into its slot (SlotWriter.publish names)
COPIED = ("num_running", "num_waiting", "queued_prompt_tokens", "max_num_seqs", "kv_cache_usage",
          "gpu_mem_used_bytes", "gpu_mem_total_bytes", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_p99_ms",
          "tpot_p99_ms", "e2e_p99_ms", "prompt_len_hist", "restarts", "last_exit_code", "state_reason")
STATES = {"empty": 0, "starting": 1, "ready": 2, "draining": 3, "dead": 4}
LOCAL_HOSTS = frozenset({"127.0.0.1", "0.0.0.0", "::", "::1", "[::1]", "[::]", "localhost", ""})


def split_host(endpoint: str) -> tuple[str, str]:
    """``host:port`` → (host, port); an IPv6 host keeps its brackets."""
    host, _, port = endpoint.rpartition(":")
    return host, port


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
REASONS = {"none": 0, "engine_exited": 1, "start_failed": 2, "gave_up": 3, "admin_restart": 4}


class MirrorManager:
    """Keeps ``wanted`` remote endpoints mirrored. ``wanted``: endpoint → {"weight", "model"}.
    Subclasses that write other slots of the same segment (``dplb-epp``'s scraped endpoints,
    :mod:`epp.discovery`) name their own lock file (:attr:`LOCK`)."""

    #: the file in ``state_dir`` whose exclusive ``flock`` makes this process the writer
    LOCK = "mirror.lock"

    def __init__(self, seg: Any, transport: Transport, state_dir: str, timeout_s: float = 0.5,
                 max_failures: int = 3) -> None:
        self.seg = seg
        self.transport = transport
        self.state_dir = state_dir
        self.timeout_s = timeout_s
        self.max_failures = max_failures
        self.wanted: dict[str, dict[str, Any]] = {}
        self.writers: dict[str, Any] = {}
        self.failures: dict[str, int] = {}
        self._lock_fd: int | None = None

    def leader(self) -> bool:
        """Try (non-blocking) to hold the mirror lock; True while this process holds it."""
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
        return True

    def slot_of(self, endpoint: str) -> int | None:
        """Slot currently mirroring the agent at ``endpoint`` (its control address; any live
        state), or None."""
        for s in self.seg.snapshot():
            if int(s.state) != 0 and (s.control or s.endpoint) == endpoint:
                return s.worker_id
        return None

    def _claim(self, endpoint: str, spec: dict[str, Any], data: str) -> Any:
        slot = self.slot_of(endpoint)
        if slot is None:
            for s in reversed(self.seg.snapshot()):
                if int(s.state) == 0:
                    slot = s.worker_id
                    break
        if slot is None:
            raise RuntimeError(f"no free slot in segment {self.seg.name} to mirror {endpoint}")
        w = self.seg.writer(slot)
        cur = self.seg.read_slot(slot)
        if int(cur.state) == 0 or (cur.control or cur.endpoint) != endpoint or cur.endpoint != data:
            w.claim(worker_id=slot, pid=os.getpid(), endpoint=data, control=endpoint,
                    weight=float(spec.get("weight", 1.0)), model=spec.get("model") or "")
        return w

    async def refresh_one(self, endpoint: str, spec: dict[str, Any]) -> None:
        """Pull one remote agent's state (``endpoint``: its control address) into its slot,
        claiming the slot first (again when the engine's address changed)."""
        w = self.writers.get(endpoint)
        before = self._router_inflight(w)
        try:
            status, body = await self.transport.get(endpoint, "/dplb/state", self.timeout_s)
            if status != 200:
                raise TransportError("status", endpoint, str(status))
            d = orjson.loads(body)
            if not isinstance(d, dict):
                raise TypeError("/dplb/state is not a JSON object")
            data = data_endpoint(d.get("endpoint"), endpoint)
            if data is None:
                if w is None:
                    w = self.writers[endpoint] = self._claim(endpoint, spec, endpoint)
                if self.failures.get(endpoint) != -1:
                    log.warning("remote worker %s serves its engine on a Unix socket (%s), which this node cannot "
                                "reach: start its agent with --engine-host; marking it dead", endpoint,
                                d.get("endpoint"))
                self.failures[endpoint] = -1
                w.publish(state=4)
                return
            if w is None or self.seg.read_slot(w.slot_index).endpoint != data:
                w = self.writers[endpoint] = self._claim(endpoint, spec, data)
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
        except (TransportError, orjson.JSONDecodeError, ValueError, TypeError) as e:
            if w is None:   # never reached: take a slot anyway, so the worker is listed (dead) rather than absent
                w = self.writers[endpoint] = self._claim(endpoint, spec, endpoint)
            n = self.failures[endpoint] = max(0, self.failures.get(endpoint, 0)) + 1
            if n >= self.max_failures:
                if n == self.max_failures:
                    log.warning("remote worker %s unreachable (%s): marking it dead", endpoint, e)
                w.publish(state=4)

    def _router_inflight(self, w: Any) -> int:
        """This node's routers' in-flight count on ``w``'s slot (0 before it has one)."""
        if w is None:
            return 0
        return max(0, int(self.seg.router_inflight_get(w.slot_index)))

    async def tick(self) -> None:
        """Mirror every wanted endpoint (leader only) and release slots no longer wanted."""
        if not self.wanted and not self.writers:
            return
        if not self.leader():
            return
        for ep in [e for e in self.writers if e not in self.wanted]:
            self.writers.pop(ep).release()
            # a worker added again starts afresh: its old count would never equal max_failures again,
            # and an unreachable one would stay STARTING for good
            self.failures.pop(ep, None)
        for ep, spec in list(self.wanted.items()):
            try:
                await self.refresh_one(ep, spec)
            except RuntimeError as e:
                log.warning("%s", e)

    def close(self) -> None:
        """Release every mirror slot this process writes and drop the lock."""
        for w in self.writers.values():
            try:
                w.release()
            except Exception as e:  # noqa: BLE001 - segment may already be closed
                log.debug("releasing a mirror slot failed: %s", e)
        self.writers.clear()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
