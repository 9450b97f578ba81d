"""Mirror slots for remote workers (``host:port`` backends from config or the admin API).

A remote node runs its own agents and segment; this router keeps one slot of its *local* segment
per remote agent and fills it from the agent's ``GET /dplb/state`` (``WorkerSnapshot.to_dict()``
JSON) every health interval, so the kernel scores local and remote workers alike. Mirror slots
are taken from the top of the segment down (agents use the low slots ``0..N-1``).

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
COPIED = ("num_running", "num_waiting", "inflight", "queued_prompt_tokens", "max_num_seqs", "kv_cache_usage",
          "gpu_mem_used_bytes", "gpu_mem_total_bytes", "ttft_ms", "tpot_ms", "e2e_ms", "ttft_p99_ms",
          "tpot_p99_ms", "e2e_p99_ms", "prompt_len_hist", "restarts", "last_exit_code", "state_reason")
STATES = {"empty": 0, "starting": 1, "ready": 2, "draining": 3, "dead": 4}
REASONS = {"none": 0, "engine_exited": 1, "start_failed": 2, "gave_up": 3, "admin_restart": 4}


class MirrorManager:
    """Keeps ``wanted`` remote endpoints mirrored. ``wanted``: endpoint → {"weight", "model"}."""

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
        fd = os.open(os.path.join(self.state_dir, "mirror.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def slot_of(self, endpoint: str) -> int | None:
        """Slot currently holding ``endpoint`` (any live state), or None."""
        for s in self.seg.snapshot():
            if int(s.state) != 0 and s.endpoint == endpoint:
                return s.worker_id
        return None

    def _claim(self, endpoint: str, spec: dict[str, Any]) -> Any:
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
        if int(cur.state) == 0 or cur.endpoint != endpoint:
            w.claim(worker_id=slot, pid=os.getpid(), endpoint=endpoint, weight=float(spec.get("weight", 1.0)),
                    model=spec.get("model") or "")
        return w

    async def refresh_one(self, endpoint: str, spec: dict[str, Any]) -> None:
        """Pull one remote agent's state into its slot (claiming the slot first if needed)."""
        w = self.writers.get(endpoint)
        if w is None:
            w = self.writers[endpoint] = self._claim(endpoint, spec)
        try:
            status, body = await self.transport.get(endpoint, "/dplb/state", self.timeout_s)
            if status != 200:
                raise TransportError("status", endpoint, str(status))
            d = orjson.loads(body)
            fields = {k: d[k] for k in COPIED if k in d and d[k] is not None}
            if spec.get("model") or d.get("model"):
                fields["model"] = spec.get("model") or d.get("model")
            fields["weight"] = float(spec.get("weight", d.get("weight", 1.0)))
            fields["state"] = STATES.get(str(d.get("state", "ready")).lower(), 2)
            if "state_reason" in fields:
                fields["state_reason"] = REASONS.get(str(fields["state_reason"]).lower(), 0)
            w.publish(**fields)
            self.failures[endpoint] = 0
        except (TransportError, orjson.JSONDecodeError, ValueError, TypeError) as e:
            n = self.failures[endpoint] = self.failures.get(endpoint, 0) + 1
            if n == self.max_failures:
                log.warning("remote worker %s unreachable (%s): marking it dead", endpoint, e)
                w.publish(state=4)

    async def tick(self) -> None:
        """Mirror every wanted endpoint (leader only) and release slots no longer wanted."""
        if not self.wanted and not self.writers:
            return
        if not self.leader():
            return
        for ep in [e for e in self.writers if e not in self.wanted]:
            self.writers.pop(ep).release()
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
