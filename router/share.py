"""Router processes and picker replicas on different nodes share their load and their placements
through Redis (``share.url`` in the config file; ``dplb-router --share-url``, ``dplb-epp --share-url``).

Each replica (a ``dplb-epp`` picker, or a node's ``dplb-router``) keeps its own segment (its router
lines: the requests *it* dispatched per engine, their outstanding prefill, their decoding requests)
and its own prefix index. With a Redis URL (:class:`Share`) every replica also sees what the others
have in flight on each engine and where they placed which prompt, as one replica would:

**Load** (the router-line counters ``router_inflight``, ``prefill_tokens``, ``decode_reqs``,
``decode_ctx_tokens`` per engine). Each replica writes its *own* counters (its line minus what it
added for the others) as a Redis hash ``<prefix>:load:<replica>`` (field: the engine's address,
value: the four counters; field ``_``: a sequence number that grows with each write) with a TTL
(``ttl_s``, 2 s by default) that it refreshes while it runs, and lists itself in the set
``<prefix>:replicas``. **A change is pushed**: when a request is dispatched, leaves prefill or ends
on this replica (:meth:`Share.poke`, called by the request accounting:
:class:`router.share_state.Notifying`), one
pipelined round trip (at most one per ``push_gap_s``) writes the hash and appends the same counters
to the replica's own stream ``<prefix>:loads:<replica>`` (:data:`SYNC_SCRIPT`, a Lua script; the
stream expires with the hash); every other replica blocks on the others' streams (``XREAD BLOCK``,
its own connection: it never wakes for its own pushes) and adds the counters to its router lines as
they arrive (:meth:`LoadShare.apply`), so a request that ends on one replica is off the others'
books one Redis hop later. Every ``interval_s`` (100 ms by default) a poll reads every replica's
hash as well (a push does not: it only writes; expired replicas dropped from the set: a replica
killed without a goodbye stops refreshing its hash and its share expires ``ttl_s`` later); the
sequence numbers keep a late answer from undoing a newer push. The kernel then prices each
engine with every replica's work, and the engine's outside requests ``X_i`` count it too.

**Placements.** Each prompt a replica dispatches is appended to the Redis stream
``<prefix>:placements`` (``XADD``, ``MAXLEN ~``: at most ``max_placements`` entries and about
``max_stream_bytes``, by the mean size of this replica's entries) by the push it triggers: the
engine's address, the prompt's prefix-index hashes (the policy's own index: chained over the
text and the model's name, the same in every process) and, with the engines' KV-cache events
(``kv_events``), its token block keys (:func:`router.kv_events.token_keys`, a pending placement
until the engine's ``BlockStored`` arrives: :class:`router.kv_events.PendingBlocks`). The same
blocking read hands the other replicas' placements to ``on_place``, so a session's next turn finds
the engine that holds its history whichever replica placed it.

**A miss looks first** (:meth:`Share.sync`, ``lookup_s``). A client that sends its next request
the moment an answer is in can beat the push of its previous placement to the replica that gets
it. A request whose prompt head this replica's index misses (:meth:`router.share_state.StateShare.wants_lookup`)
therefore reads the streams once more, without blocking, before it is priced: one round trip,
waited for at most ``lookup_s``; a request whose prefix is known never waits.

**Catch-up.** :meth:`Share.start` reads the others' load and replays the placements stream (what
it still holds) before :meth:`Share.caught_up` turns True; a picker reports ready only then.

**Redis unreachable.** Each replica falls back to its own view: the others' counters it had added
are taken back (its lines hold its own work only, as without sharing), placements are not sent;
the failure is logged once (then once more when Redis answers again) and counted
(:attr:`Share.errors`, ``dplb_share_errors_total``). A replica that started while Redis was
unreachable did not catch up: when Redis answers it takes the placements made from then on, not
the older ones the stream holds (they would arrive as placed just now). Reads and writes run on background tasks; the request
path queues placements and sets a flag, and only a prefix miss waits (``lookup_s`` at most).

Why Redis: platform teams already run it (and its operators, failover and monitoring); a hash per
replica with a TTL is how a dead replica's share disappears without a protocol of our own, a
stream keeps placements and load changes in order and lets a late reader catch up, and a blocking
stream read is a push without a second connection kind (docs/DESIGN.md).
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
from redis.exceptions import NoScriptError

from router.share_load import (
    FIELDS,
    ZERO,
    Counts,
    LoadShare,
    decode_counts,
    encode_counts,
)
from router.share_wire import (
    _b,
    _entries,
    _id_key,
    _id_ms,
    _int,
    _s,
    _safe,
    _streams_of,
)

if TYPE_CHECKING:
    from dplb_shm import Segment

log = logging.getLogger("dplb.share")

#: One round trip per refresh: write this replica's hash when asked (``ARGV[3] == "1"``) and append
#: its counters to its own loads stream (``ARGV[5]``: the stream's approximate length bound,
#: ``ARGV[6]``: the counters, msgpack; the stream expires with the hash), then, when asked
#: (``ARGV[7] == "1"``: a poll, not a push), read every other replica's hash. ``KEYS[1]``: the
#: replicas' set (a replica that joins it says so on the stream ``KEYS[4]``: the others read its
#: loads stream from then on); ``KEYS[2]``: this replica's hash; ``KEYS[3]``: its loads stream; ``ARGV``:
#: replica id, TTL ms, write flag, key prefix of the hashes, the two stream arguments, the read
#: flag, then field/value pairs (the first: ``_`` and the write's sequence number). A member whose
#: hash expired is removed from the set. Returns ``[replica, {field, value...}, ...]`` (empty
#: without the read).
SYNC_SCRIPT = """
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], unpack(ARGV, 8))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', 1000, '*', 'r', ARGV[1])
  end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'r', ARGV[1], 's', ARGV[9], 'c', ARGV[6])
  redis.call('PEXPIRE', KEYS[3], ARGV[2])
end
local out = {}
if ARGV[7] ~= '1' then
  return out
end
for _, r in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if r ~= ARGV[1] then
    local h = redis.call('HGETALL', ARGV[4] .. r)
    if #h == 0 then
      redis.call('SREM', KEYS[1], r)
    else
      out[#out + 1] = r
      out[#out + 1] = h
    end
  end
end
return out
"""

#: ``on_place(engine address, prefix-index hashes, token block keys, age in seconds)``
OnPlace = Callable[[str, list[int], list[int], float], None]


def default_replica_id() -> str:
    """``<hostname>-<pid>-<6 hex>``: unique per process, readable in ``redis-cli``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Share:
    """The shared load and placements of replicas through Redis (module docstring).

    ``url``: a Redis URL (``redis://host:port/db``, ``rediss://`` for TLS, a password in the URL);
    ``seg`` and ``engines``: as :class:`LoadShare`; ``on_place``: called with each other replica's
    placement (:data:`OnPlace`; None: placements are neither sent nor read); ``prefix``: the keys'
    prefix (one per deployment: replicas of one pool share it); ``interval_s``: the poll period of
    every replica's hash, s (> 0); ``push_gap_s``: the shortest time between two pushes of this
    replica's changes, s (>= 0; changes meanwhile go together); ``ttl_s``: how long a replica's
    load outlives its last refresh, s (at least ``3 * interval_s``: the hash is rewritten within
    ``ttl_s / 4 + interval_s`` of its last write, so a replica that runs never expires between two
    writes, with an interval to spare for a late loop); ``replay_s``: placements older than this
    (stream time) are not replayed into pending placements at catch-up (they still enter the prefix
    index); ``max_placements``: the placements stream's approximate length bound (the loads
    stream's: ``max_placements // 10``, at least 1000); ``max_stream_bytes``: its approximate size
    bound, bytes (entries carry a prompt's chunk hashes and block keys: a long prompt's can reach
    100 KB; the length bound is lowered to this over the mean size of the entries this replica
    sent, at least 100 entries); ``timeout_s``: each Redis call's socket
    timeout, s; ``lookup_s``: the longest a request waits for :meth:`sync` (0: no lookups).

    :meth:`start` connects and catches up (or, Redis unreachable, falls back at once), then runs
    the refresh and the stream reader until :meth:`close`. Single threaded: :meth:`place` and
    :meth:`poke` are called on the event loop that ran :meth:`start`. Raises ValueError for bad
    settings."""

    def __init__(self, url: str, seg: Segment, engines: Callable[[], dict[str, int]], on_place: OnPlace | None = None,
                 prefix: str = "dplb", replica: str | None = None, interval_s: float = 0.1, ttl_s: float = 2.0,
                 replay_s: float = 30.0, max_placements: int = 100_000, timeout_s: float = 1.0,
                 push_gap_s: float = 0.001, lookup_s: float = 0.01, max_stream_bytes: int = 256 << 20) -> None:
        if interval_s <= 0 or ttl_s < 3 * interval_s or push_gap_s < 0 or lookup_s < 0:
            raise ValueError("need interval_s > 0, ttl_s >= 3 * interval_s, push_gap_s >= 0 and lookup_s >= 0 (got "
                             f"{interval_s}, {ttl_s}, {push_gap_s}, {lookup_s})")
        if max_placements < 1 or timeout_s <= 0 or max_stream_bytes < 1:
            raise ValueError("max_placements, max_stream_bytes and timeout_s must be positive (got "
                             f"{max_placements}, {max_stream_bytes}, {timeout_s})")
        import redis.asyncio as aioredis

        self.url = url
        self.load = LoadShare(seg, engines)
        self.on_place = on_place
        self.prefix = prefix
        self.replica = replica or default_replica_id()
        self.interval_s = interval_s
        self.push_gap_s = push_gap_s
        self.lookup_s = lookup_s
        self.ttl_s = ttl_s
        self.replay_s = replay_s
        self.max_placements = max_placements
        self.max_loads = max(1000, max_placements // 10)
        self.max_stream_bytes = max_stream_bytes
        self.entry_bytes = 0.0        # the mean size of this replica's placement entries (EWMA), bytes
        self.timeout_s = timeout_s
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # the stream reader blocks on its own connection
        self.reader = aioredis.Redis.from_url(url, socket_timeout=timeout_s + 1.0, socket_connect_timeout=timeout_s)
        # EVALSHA in the pipeline, the script loaded once (and again after a NOSCRIPT: a Redis that
        # restarted): redis-py's registered scripts cost a SCRIPT EXISTS round trip per pipeline
        self.sync_sha = hashlib.sha1(SYNC_SCRIPT.encode()).hexdigest()
        self.replicas_key = f"{prefix}:replicas"
        self.hash_prefix = f"{prefix}:load:"
        self.own_key = self.hash_prefix + self.replica
        self.stream_key = f"{prefix}:placements"
        #: each replica pushes its counters to a stream of its own (``<prefix>:loads:<replica>``):
        #: a replica's blocking read wakes for the others' pushes only, never its own
        self.loads_prefix = f"{prefix}:loads:"
        self.own_loads_key = self.loads_prefix + self.replica
        self.hello_key = f"{prefix}:hello"
        #: placements of this replica not sent yet: (address, hashes, keys)
        self.outbox: list[tuple[str, Sequence[int], Sequence[int]]] = []
        self.last_id = b"0-0"         # the placements stream's last entry read
        #: per other replica: its loads stream's last entry read
        self.loads_ids: dict[str, bytes] = {}
        self._read_at = 0.0           # when the others' hashes were last read (a poll)
        self.hello_id = b"0-0"        # the stream of replicas joining: its last entry read
        #: per other replica: (sequence number, its counters per engine, time.monotonic() when taken)
        self.per: dict[str, tuple[int, dict[str, Counts], float]] = {}
        #: the other replicas seen, and their counters per engine summed
        self.others: list[str] = []
        self.remote: dict[str, Counts] = {}
        self.errors = 0         # failed Redis round trips (each is a refresh or a read in fallback)
        self.sent = 0           # placements sent
        self.received = 0       # other replicas' placements applied
        self.refreshes = 0      # round trips done (polls and pushes)
        self.pushed = 0         # load changes taken from the loads stream
        self.up = False         # the last round trip succeeded
        self.lookups = 0        # requests that waited for a :meth:`sync`
        self.lookups_late = 0   # ... and went on before it answered (``lookup_s``)
        self._sync_task: asyncio.Task[bool] | None = None
        self.seq = 0
        self._caught_up = False
        self._written: dict[str, Counts] | None = None
        self._written_at = 0.0
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None] | asyncio.Task[bool]] = []
        self._closed = False
        self.on_error: Callable[[], None] | None = None   # called on each counted error (a metric)

    # ---- the request path ---------------------------------------------------------------------

    def place(self, address: str, hashes: Sequence[int], keys: Sequence[int] = ()) -> None:
        """This replica dispatched a prompt (prefix-index ``hashes``, token block ``keys``) to the
        engine at ``address``: queued and pushed at once (nothing while Redis is down)."""
        if self.on_place is not None and self.up and (hashes or keys):
            self.outbox.append((address, hashes, keys))
            self.poke()

    def poke(self) -> None:
        """This replica's counters changed (a request dispatched, past prefill or ended): push them
        now (the refresh task wakes; no I/O here)."""
        w = self._wake
        if w is not None and not w.is_set():
            w.set()

    # ---- life cycle ---------------------------------------------------------------------------

    def caught_up(self) -> bool:
        """True once the start's catch-up finished (or Redis was unreachable: own view)."""
        return self._caught_up

    async def start(self) -> None:
        """Catch up (the others' load, then the placements stream), then start the background tasks."""
        self._wake = asyncio.Event()
        try:
            await self.redis.ping()
            last = _entries(await self.redis.xrevrange(self.hello_key, count=1))
            self.hello_id = last[0][0] if last else b"0-0"   # who joins from now on (the poll has the rest)
            await self._refresh()
            if self.on_place is not None:
                await self._replay()
            self._up(True)
        except Exception as e:   # noqa: BLE001  (redis errors, OSError, timeouts: fall back, never fail)
            self._down(e)
            # when Redis answers: what comes from then on (the poll has the rest of the load); the
            # placements the stream held before are not replayed there as placed just now (age 0)
            self.last_id = self.hello_id = b"$"
        self._caught_up = True
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._refresh_loop(), name="share-refresh"))
        self._tasks.append(loop.create_task(self._read_loop(), name="share-read"))

    async def close(self) -> None:
        """Stop the tasks, remove this replica's hash and push that (the others drop its load at
        once), take the others' counters back; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._wake is not None:
            self._wake.set()
        # the loops see the flag after their round trip (each bounded by the socket timeout): a
        # round trip cancelled halfway can leave redis-py's pipeline waiting for ever
        if self._sync_task is not None:
            self._tasks.append(self._sync_task)
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=2 * self.timeout_s + 1.0)
            for t in late:
                t.cancel()
        self._tasks.clear()
        if self.up:
            try:
                async with self.redis.pipeline(transaction=True) as p:
                    p.delete(self.own_key)
                    p.srem(self.replicas_key, self.replica)
                    p.xadd(self.own_loads_key, {"r": self.replica, "s": str(self.seq + 1), "c": msgspec.msgpack.encode({})},
                           maxlen=self.max_loads, approximate=True)
                    p.pexpire(self.own_loads_key, int(self.ttl_s * 1000))
                    await p.execute()
            except Exception as e:   # noqa: BLE001
                log.debug("share: goodbye not written: %s", e)
        self.load.clear()
        for r in (self.redis, self.reader):
            try:
                await r.aclose()
            except Exception as e:   # noqa: BLE001
                log.debug("share: close: %s", e)

    # ---- background -----------------------------------------------------------------------------

    async def _refresh_loop(self) -> None:
        assert self._wake is not None
        wake = self._wake
        last = 0.0
        while not self._closed:
            try:
                await asyncio.wait_for(wake.wait(), self.interval_s)
            except TimeoutError:
                pass
            if self._closed:
                return
            gap = last + self.push_gap_s - time.monotonic()
            if gap > 0 and wake.is_set():
                await asyncio.sleep(gap)   # changes meanwhile go with this push
            wake.clear()
            last = time.monotonic()
            try:
                # a push writes only; the others' hashes are read (a poll) once an interval
                await self._refresh(read=last - self._read_at >= self.interval_s)
                self._up(True)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001
                self._down(e)
                await asyncio.sleep(min(1.0, self.ttl_s / 2))   # retry, not spin, while Redis is down
                wake.clear()

    async def _refresh(self, read: bool = True) -> None:
        """One round trip: the queued placements, this replica's hash and its push when it
        changed (or a quarter TTL passed), and with ``read`` (a poll) every other replica's hash;
        then the lines take the others' sum. Nothing to write and no read: no round trip."""
        own = self.load.own()
        now = time.monotonic()
        write = own != self._written or now - self._written_at >= self.ttl_s / 4
        if not (write or read or self.outbox):
            return
        seq = self.seq + 1 if write else self.seq
        pairs: list[str] = ["_", str(seq)]   # never empty: the hash exists while the replica runs
        counts = b""
        if write:
            for addr, c in own.items():
                pairs += [addr, encode_counts(c)]
            counts = msgspec.msgpack.encode({a: list(c) for a, c in own.items()})
        out, self.outbox = self.outbox, []
        args = [self.replica, int(self.ttl_s * 1000), "1" if write else "0", self.hash_prefix, self.max_loads, counts,
                "1" if read else "0", *pairs]
        try:
            for attempt in (0, 1):
                async with self.redis.pipeline(transaction=False) as p:
                    for addr, hashes, keys in out if attempt == 0 else ():
                        body = msgspec.msgpack.encode([addr, list(hashes), list(keys)])
                        p.xadd(self.stream_key, {"r": self.replica, "p": body}, maxlen=self._maxlen(len(body)),
                               approximate=True)
                    p.evalsha(self.sync_sha, 4, self.replicas_key, self.own_key, self.own_loads_key, self.hello_key, *args)
                    res = await p.execute(raise_on_error=False)
                if not isinstance(res[-1], NoScriptError) or attempt:
                    break
                await self.redis.script_load(SYNC_SCRIPT)   # not loaded yet (or Redis restarted): once more
            for r in res:
                if isinstance(r, Exception):
                    raise r
        except Exception:
            self.outbox = out + self.outbox if len(out) < 10_000 else self.outbox   # sent with the next one
            raise
        self.sent += len(out)
        if write:
            self.seq = seq
            self._written, self._written_at = own, now
        self.refreshes += 1
        if read:
            self._read_at = now
            self._read_hashes(res[-1], now)

    def _maxlen(self, size: int) -> int:
        """The placements stream's length bound for an entry of ``size`` bytes (payload; about 64
        more in Redis): ``max_stream_bytes`` over the mean entry, within [100, ``max_placements``]."""
        e = float(size + 64)
        self.entry_bytes = e if self.entry_bytes <= 0 else 0.9 * self.entry_bytes + 0.1 * e
        return max(100, min(self.max_placements, int(self.max_stream_bytes / self.entry_bytes)))

    def _read_hashes(self, rows: list[object], now: float) -> None:
        """Take every other replica's hash (the script's answer to a poll), forget those gone."""
        seen: set[str] = set()
        for i in range(0, len(rows) - 1, 2):
            r = _s(rows[i])
            seen.add(r)
            flat = rows[i + 1]
            got: dict[str, Counts] = {}
            s = 0
            for j in range(0, len(flat) - 1, 2):   # type: ignore[arg-type]
                field = _s(flat[j])                  # type: ignore[index]
                if field == "_":
                    s = _int(flat[j + 1])            # type: ignore[index]
                else:
                    got[field] = decode_counts(flat[j + 1])   # type: ignore[index]
            self._take(r, s, got, now)
        for r in [r for r, v in self.per.items() if r not in seen and v[2] <= now]:
            del self.per[r]    # expired or said goodbye (not one that a push brought in meanwhile)
            self.loads_ids.pop(r, None)
        self._sum()

    def _take(self, replica: str, seq: int, counts: dict[str, Counts], now: float) -> bool:
        """Keep ``replica``'s counters unless a newer write of it is held already; a replica seen
        for the first time has its loads stream read from then on (from its start: the writes
        older than the one held are left by their sequence numbers)."""
        have = self.per.get(replica)
        if have is not None and have[0] > seq:
            return False
        self.per[replica] = (seq, counts, now)
        self.loads_ids.setdefault(replica, b"0-0")
        return True

    def _sum(self) -> None:
        remote: dict[str, Counts] = {}
        for _, counts, _ in self.per.values():
            for addr, c in counts.items():
                t = remote.get(addr, ZERO)
                remote[addr] = (t[0] + c[0], t[1] + c[1], t[2] + c[2], t[3] + c[3])
        self.others, self.remote = list(self.per), remote
        self.load.apply(remote)

    async def _replay(self) -> None:
        """The placements the stream still holds, oldest first (catch-up)."""
        last = _entries(await self.redis.xrevrange(self.stream_key, count=1))
        if not last:
            return
        newest_ms = _id_ms(last[0][0])
        start = b"-"
        while True:
            batch = _entries(await self.redis.xrange(self.stream_key, min=start, count=1000))
            if not batch:
                break
            for eid, fields in batch:
                self._apply_entry(eid, fields, max(0.0, (newest_ms - _id_ms(eid)) / 1000.0))
            self.last_id = batch[-1][0]
            if len(batch) < 1000:
                break
            start = b"(" + self.last_id

    async def _read_loop(self) -> None:
        while not self._closed:
            try:
                got: object = await self.reader.xread(self._streams(), count=1000, block=200)   # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001
                self._down(e)
                await asyncio.sleep(min(1.0, self.ttl_s / 2))
                continue
            self._apply_streams(got)

    def _streams(self) -> dict[str, bytes]:
        """What the stream reads ask for: each stream past the last entry applied."""
        streams = {self.hello_key: self.hello_id, **{self.loads_prefix + r: i for r, i in self.loads_ids.items()}}
        if self.on_place is not None:
            streams[self.stream_key] = self.last_id
        return streams

    def _apply_streams(self, got: object) -> None:
        """Apply an XREAD answer (``[[stream, entries], ...]``, RESP2, redis-py's default protocol):
        the entries past the last applied of each stream (the blocking read and :meth:`sync` may
        both bring one), then the others' sum when a load changed."""
        loads, places, hello = self.loads_prefix.encode(), self.stream_key.encode(), self.hello_key.encode()
        changed = False
        for x in _streams_of(got):
            name = _b(x[0])
            r = name[len(loads):].decode(errors="replace") if name.startswith(loads) else None
            for eid, fields in _entries(x[1]):
                if name == hello and _id_key(eid) > _id_key(self.hello_id):
                    self.hello_id = eid
                    joined = fields.get(b"r", b"").decode(errors="replace")
                    if joined and joined != self.replica:
                        self.loads_ids.setdefault(joined, b"0-0")   # its pushes from the next read on
                elif r is not None:
                    if r in self.loads_ids and _id_key(eid) > _id_key(self.loads_ids[r]):
                        self.loads_ids[r] = eid
                        changed = self._apply_load(fields) or changed
                elif name == places and _id_key(eid) > _id_key(self.last_id):
                    self._apply_entry(eid, fields, 0.0)
                    self.last_id = eid
        if changed and self.up:
            self._sum()

    async def sync(self) -> bool:
        """Bring this replica's view up to what Redis holds now: one round trip (``XREAD`` without
        blocking: the other replicas' pushes and placements not applied yet), waited for at most
        ``lookup_s`` (the read goes on in the background past that; requests that ask meanwhile
        wait for the same read). For a request whose prefix this replica's index misses: another
        replica may have placed it a moment ago, its push still on the way here. True when the
        view is current; False when Redis is down, the lookup is off, or it took too long (the
        request is then priced on the view as it is: never an error)."""
        if not self.up or self._closed or self.lookup_s <= 0:
            return False
        t = self._sync_task
        if t is None or t.done():
            t = self._sync_task = asyncio.get_running_loop().create_task(self._sync_once(), name="share-sync")
        self.lookups += 1
        done, _ = await asyncio.wait({t}, timeout=self.lookup_s)
        if not done:
            self.lookups_late += 1
            return False
        return not t.cancelled() and t.result()

    async def _sync_once(self) -> bool:
        try:
            got = await self.redis.xread(self._streams(), count=1000)   # type: ignore[arg-type]
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001
            self._down(e)
            return False
        self._apply_streams(got)
        return True

    def _apply_load(self, fields: dict[bytes, bytes]) -> bool:
        """A pushed write of another replica's counters (the loads stream); True when taken."""
        r = fields.get(b"r", b"").decode(errors="replace")
        if r == self.replica or not r:
            return False
        try:
            raw = msgspec.msgpack.decode(fields[b"c"])
            counts = {str(a): decode_counts(" ".join(str(int(v)) for v in c)) for a, c in raw.items()}
            seq = int(fields[b"s"])
        except (KeyError, ValueError, TypeError, AttributeError, msgspec.DecodeError):
            log.debug("share: load entry of %s unreadable", r)
            return False
        self.pushed += 1
        return self._take(r, seq, counts, time.monotonic())

    def _apply_entry(self, eid: bytes, fields: dict[bytes, bytes], age_s: float) -> None:
        if fields.get(b"r", b"").decode(errors="replace") == self.replica or self.on_place is None:
            return
        try:
            addr, hashes, keys = msgspec.msgpack.decode(fields[b"p"])
        except (KeyError, ValueError, TypeError, msgspec.DecodeError):
            log.debug("share: placement %s unreadable", eid)
            return
        self.received += 1
        self.on_place(str(addr), list(hashes), list(keys), age_s if age_s <= self.replay_s else float("inf"))

    def _up(self, ok: bool) -> None:
        if ok and not self.up:
            self.up = True
            if self.errors:
                log.warning("share: Redis %s answers again: sharing load and placements with %d other replica(s)",
                            _safe(self.url), len(self.others))

    def _down(self, e: BaseException) -> None:
        self.errors += 1
        if self.on_error is not None:
            self.on_error()
        if self.up or self.errors == 1:
            log.warning("share: Redis %s unreachable (%s: %s): routing on this replica's own view until it answers",
                        _safe(self.url), type(e).__name__, e)
        self.up = False
        self.outbox.clear()
        self.load.clear()
        self.per.clear()
        self.remote, self.others = {}, []
        self._written = None


__all__ = ["FIELDS", "SYNC_SCRIPT", "LoadShare", "OnPlace", "Share", "decode_counts", "default_replica_id",
           "encode_counts"]
