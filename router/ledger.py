"""Each router process's share of the segment's router lines, reclaimable when the process dies.

The router line of a slot (``csrc/dplb_shm.h``, line 22) holds counters that every router process
of a deployment changes by atomic add: ``router_inflight`` (requests dispatched, not finished),
``prefill_tokens`` (outstanding prefill), ``decode_reqs`` and ``decode_ctx_tokens`` (requests past
their first token). A process killed with requests in flight never gives its share back, and the
workers it used look busy for ever (issue 27, item 4: 8 in flight and 13 k prefill tokens left by a
kill -9, a later burst of 40 split 38/2, every stop waiting the agents' full drain limit).

So every router process also writes its own share to a **ledger**: a small file of its own,
``<state_dir>/shares/<pid>-<start>.ledger``, that only it writes (no lock, no atomics: one writer)
and that any router process of the deployment can read once it is dead. Layout (little-endian
int64s): a 4-word header ``magic, num_slots, pid, start``, then ``num_slots`` rows of
``router_inflight, prefill_tokens, decode_reqs, decode_ctx_tokens``. ``start`` is the process's
start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), so a reused pid is not taken
for the dead process.

:func:`sweep_dead` (run by every router process on each health tick, and by the first one at its
start) finds ledgers whose process is gone, claims each one by renaming it (exactly one sweeper
wins the rename), subtracts its rows from the segment and removes it: a dead process's load leaves
within one health interval (200 ms by default). A clean stop settles the process's own ledger the
same way (:meth:`Ledger.close`).

A process killed between its segment add and its ledger add (a few hundred nanoseconds) leaves one
request's worth of error; a sweep never drives a counter below zero.
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dplb_shm import Segment

log = logging.getLogger("dplb.router.ledger")

MAGIC = 0x44504C424C454447  # "DPLBLEDG"
HEADER_WORDS = 4
FIELDS = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")
ROW_WORDS = len(FIELDS)
SUFFIX = ".ledger"


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22), or
    None when no such process runs (or it is a zombie: it will never give anything back)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after the last ')'
    rest = stat[stat.rfind(b")") + 2:].split()
    if not rest or rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def shares_dir(state_dir: str) -> str:
    """The directory that holds the deployment's ledgers."""
    return os.path.join(state_dir, "shares")


class Ledger:
    """This process's share of every slot's router line, in ``<state_dir>/shares/<pid>-<start>.ledger``.

    ``num_slots``: the segment's slot count. Raises ``OSError`` when the file cannot be created.
    The ``*_add`` methods mirror :class:`dplb_shm.Segment`'s and are called right after them."""

    def __init__(self, state_dir: str, num_slots: int) -> None:
        self.pid = os.getpid()
        start = process_start(self.pid)
        self.start = 0 if start is None else start
        self.num_slots = int(num_slots)
        d = shares_dir(state_dir)
        os.makedirs(d, mode=0o700, exist_ok=True)
        self.path = os.path.join(d, f"{self.pid}-{self.start}{SUFFIX}")
        size = 8 * (HEADER_WORDS + ROW_WORDS * self.num_slots)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.rows = memoryview(self._map).cast("q")
        self.rows[0:HEADER_WORDS] = memoryview(bytearray(8 * HEADER_WORDS)).cast("q")
        self.rows[1], self.rows[2], self.rows[3] = self.num_slots, self.pid, self.start
        self.rows[0] = MAGIC

    def inflight_add(self, slot: int, delta: int) -> None:
        """Requests this process dispatched to ``slot`` and has not finished, += ``delta``."""
        self.rows[HEADER_WORDS + ROW_WORDS * slot] += delta

    def prefill_add(self, slot: int, delta: int) -> None:
        """Outstanding prefill tokens this process put on ``slot``, += ``delta``."""
        self.rows[HEADER_WORDS + ROW_WORDS * slot + 1] += delta

    def decode_add(self, slot: int, reqs: int, ctx_tokens: int) -> None:
        """Decoding requests (and their prompt tokens) this process has on ``slot``, += the deltas."""
        i = HEADER_WORDS + ROW_WORDS * slot
        self.rows[i + 2] += reqs
        self.rows[i + 3] += ctx_tokens

    def share(self, slot: int) -> dict[str, int]:
        """This process's share of ``slot``'s router line, by field name."""
        i = HEADER_WORDS + ROW_WORDS * slot
        return {name: int(self.rows[i + k]) for k, name in enumerate(FIELDS)}

    def close(self, seg: Segment | None = None) -> None:
        """Stop recording. With ``seg``, first give back whatever share is left (a lease never
        finished at the stop) and remove the file; idempotent."""
        if self._map.closed:
            return
        rows = [int(v) for v in self.rows[HEADER_WORDS:]]
        self.rows.release()
        self._map.close()
        if seg is not None:
            _give_back(seg, rows, self.num_slots)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


class AccountedSegment:
    """The segment as :class:`router.accounting.RequestAccount` sees it: every add to the router
    line is also written to this process's :class:`Ledger`. Only the methods a request account
    calls are offered (a plain attribute each, no per-call indirection for the others)."""

    __slots__ = ("decode_add", "dispatched_add", "latency_observe", "ledger", "outcome_add", "prefill_add",
                 "prefill_rate_observe", "router_inflight_add", "router_line", "seg")

    def __init__(self, seg: Segment, ledger: Ledger) -> None:
        self.seg, self.ledger = seg, ledger
        self.dispatched_add = seg.dispatched_add
        self.prefill_rate_observe = seg.prefill_rate_observe
        self.latency_observe = seg.latency_observe
        self.outcome_add = seg.outcome_add     # monotonic counts: nothing to give back
        self.router_line = seg.router_line
        self.router_inflight_add = self._pair(seg.router_inflight_add, ledger.inflight_add)
        self.prefill_add = self._pair(seg.prefill_add, ledger.prefill_add)
        self.decode_add = self._decode(seg.decode_add, ledger.decode_add)

    @staticmethod
    def _pair(shared: Callable[[int, int], int], own: Callable[[int, int], None]) -> Callable[[int, int], int]:
        def add(slot: int, delta: int) -> int:
            after = shared(slot, delta)
            own(slot, delta)
            return after
        return add

    @staticmethod
    def _decode(shared: Callable[[int, int, int], tuple[int, int]],
                own: Callable[[int, int, int], None]) -> Callable[[int, int, int], tuple[int, int]]:
        def add(slot: int, reqs: int, ctx_tokens: int) -> tuple[int, int]:
            after = shared(slot, reqs, ctx_tokens)
            own(slot, reqs, ctx_tokens)
            return after
        return add


def _give_back(seg: Segment, rows: list[int], num_slots: int) -> dict[str, int]:
    """Subtract a ledger's ``rows`` (flat, ``ROW_WORDS`` per slot) from ``seg``'s router lines,
    never below zero. Returns the totals given back by field name."""
    totals = dict.fromkeys(FIELDS, 0)
    for slot in range(min(num_slots, seg.num_slots)):
        inflight, prefill, dreqs, dctx = rows[ROW_WORDS * slot: ROW_WORDS * slot + ROW_WORDS]
        if inflight and seg.router_inflight_add(slot, -inflight) < 0:
            seg.router_inflight_add(slot, -seg.router_inflight_get(slot))
        if prefill and seg.prefill_add(slot, -prefill) < 0:
            seg.prefill_add(slot, -seg.router_line(slot)["prefill_tokens"])
        if dreqs or dctx:
            after_reqs, after_ctx = seg.decode_add(slot, -dreqs, -dctx)
            if after_reqs < 0 or after_ctx < 0:
                seg.decode_add(slot, -min(0, after_reqs), -min(0, after_ctx))
        for name, v in zip(FIELDS, (inflight, prefill, dreqs, dctx), strict=True):
            totals[name] += v
    return totals


def read_rows(path: str) -> tuple[int, int, int, list[int]] | None:
    """A ledger file's ``(num_slots, pid, start, rows)``, or None when it is not a whole ledger."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < 8 * HEADER_WORDS or len(data) % 8:
        return None
    words = memoryview(data).cast("q")
    if words[0] != MAGIC or len(words) != HEADER_WORDS + ROW_WORDS * words[1]:
        return None
    return int(words[1]), int(words[2]), int(words[3]), [int(v) for v in words[HEADER_WORDS:]]


def sweep_dead(seg: Segment, state_dir: str, everyone: bool = False) -> list[tuple[int, dict[str, int]]]:
    """Give back the share of every router process of this deployment that is no longer running
    (``everyone``: of every ledger but this process's own, for the first router process of a
    deployment, when no other one can be alive). Each ledger is claimed by renaming it, so two
    sweepers never subtract it twice. Returns ``[(pid, totals given back), ...]``."""
    d = shares_dir(state_dir)
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    me = os.getpid()
    swept: list[tuple[int, dict[str, int]]] = []
    for name in names:
        if not name.endswith(SUFFIX):
            continue
        pid_s, _, start_s = name[: -len(SUFFIX)].partition("-")
        try:
            pid, start = int(pid_s), int(start_s)
        except ValueError:
            continue
        if pid == me or (not everyone and process_start(pid) == start):
            continue
        path = os.path.join(d, name)
        claimed = f"{path}.sweep-{me}"
        try:
            os.rename(path, claimed)
        except FileNotFoundError:
            continue  # another router process swept it first
        try:
            got = read_rows(claimed)
            if got is not None:
                totals = _give_back(seg, got[3], got[0])
                swept.append((pid, totals))
                if any(totals.values()):
                    log.warning("router process %d is gone: gave back its share (%s)", pid,
                                ", ".join(f"{k} {v}" for k, v in totals.items() if v))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claimed)
    return swept


__all__ = ["AccountedSegment", "Ledger", "process_start", "read_rows", "shares_dir", "sweep_dead"]
