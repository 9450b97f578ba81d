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
to the stream ``<prefix>:loads`` (:data:`SYNC_SCRIPT`, a Lua script); every other replica blocks on
that stream (``XREAD BLOCK``, its own connection) and adds the counters to its router lines as they
arrive (:meth:`LoadShare.apply`), so a request that ends on one replica is off the others' books
one Redis hop later, before a client's next request gets there. Every ``interval_s`` (100 ms by
default) a poll reads every replica's hash as well (expired replicas dropped from the set: a
replica killed without a goodbye stops refreshing its hash and its share expires ``ttl_s`` later);
the sequence numbers keep a late answer from undoing a newer push. The kernel then prices each
engine with every replica's work, and the engine's outside requests ``X_i`` count it too.

**Placements.** Each prompt a replica dispatches is appended to the Redis stream
``<prefix>:placements`` (``XADD``, ``MAXLEN ~ max_placements``) by the push it triggers: the
engine's address, the prompt's prefix-index hashes (the policy's own index: chained over the
text and the model's name, the same in every process) and, with the engines' KV-cache events
(``kv_events``), its token block keys (:func:`router.kv_events.token_keys`, a pending placement
until the engine's ``BlockStored`` arrives: :class:`router.kv_events.PendingBlocks`). The same
blocking read hands the other replicas' placements to ``on_place``, so a session's next turn finds
the engine that holds its history whichever replica placed it.

**Catch-up.** :meth:`Share.start` reads the others' load and replays the placements stream (what
it still holds) before :meth:`Share.caught_up` turns True; a picker reports ready only then.

**Redis unreachable.** Each replica falls back to its own view: the others' counters it had added
are taken back (its lines hold its own work only, as without sharing), placements are not sent;
the failure is logged once (then once more when Redis answers again) and counted
(:attr:`Share.errors`, ``dplb_share_errors_total``). A replica that started while Redis was
unreachable did not catch up: when Redis answers it takes the placements made from then on, not
the older ones the stream holds (they would arrive as placed just now). No request waits for Redis: reads and writes
run on background tasks, the request path only queues placements and sets a flag.

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

if TYPE_CHECKING:
    from dplb_shm import Segment

log = logging.getLogger("dplb.share")

#: the router-line counters shared (``Segment.router_line`` keys), in the order they are encoded
FIELDS = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")
Counts = tuple[int, int, int, int]
ZERO: Counts = (0, 0, 0, 0)

#: One round trip per refresh: write this replica's hash when asked (``ARGV[3] == "1"``) and append
#: its counters to the loads stream (``ARGV[5]``: the stream's approximate length bound, ``ARGV[6]``:
#: the counters, msgpack), then read every other replica's hash. ``KEYS[1]``: the replicas' set;
#: ``KEYS[2]``: this replica's hash; ``KEYS[3]``: the loads stream; ``ARGV``: replica id, TTL ms,
#: write flag, key prefix of the hashes, the two stream arguments, then field/value pairs (the
#: first: ``_`` and the write's sequence number). A member whose hash expired is removed from the
#: set. Returns ``[replica, {field, value...}, ...]``.
SYNC_SCRIPT = """
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], unpack(ARGV, 7))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[1], ARGV[1])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'r', ARGV[1], 's', ARGV[8], 'c', ARGV[6])
end
local out = {}
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


def encode_counts(c: Counts) -> str:
    """The four counters as a hash value: ``"inflight prefill decode_reqs decode_ctx"``."""
    return " ".join(str(v) for v in c)


def decode_counts(v: bytes | str) -> Counts:
    """The inverse of :func:`encode_counts`; a malformed value, or one with a negative count (no
    replica writes one: its counts are its own in-flight requests and tokens), reads as zeros."""
    try:
        parts = [int(x) for x in (v.decode() if isinstance(v, bytes) else v).split()]
    except ValueError:
        return ZERO
    if len(parts) != 4 or min(parts) < 0:
        return ZERO
    return parts[0], parts[1], parts[2], parts[3]


class LoadShare:
    """The load half of :class:`Share`, without Redis: what this replica's own counters are and how
    the others' are added to its router lines.

    ``seg``: the replica's segment (``router_line``, ``router_inflight_add``, ``prefill_add``,
    ``decode_add``); ``engines``: a callable answering ``{engine address: slot}`` now. The others'
    counters added so far are kept per address (:attr:`got`, with the slot they went to), so
    :meth:`own` is the line minus them, and :meth:`apply` moves only the difference. Single
    threaded (the picker's event loop, as the request accounting)."""

    def __init__(self, seg: Segment, engines: Callable[[], dict[str, int]]) -> None:
        self.seg = seg
        self.engines = engines
        #: per engine address: (slot, the other replicas' counters added to that slot's line)
        self.got: dict[str, tuple[int, Counts]] = {}

    def own(self) -> dict[str, Counts]:
        """This replica's own counters per engine address (never below zero), zeros left out."""
        out: dict[str, Counts] = {}
        for addr, slot in self.engines().items():
            line = self.seg.router_line(slot)
            g = self.got.get(addr)
            add = g[1] if g is not None and g[0] == slot else ZERO
            c: Counts = (max(0, int(line["router_inflight"]) - add[0]), max(0, int(line["prefill_tokens"]) - add[1]),
                         max(0, int(line["decode_reqs"]) - add[2]), max(0, int(line["decode_ctx_tokens"]) - add[3]))
            if any(c):
                out[addr] = c
        return out

    def apply(self, others: dict[str, Counts]) -> None:
        """Make the router lines hold the other replicas' counters ``others`` (per engine address,
        summed over replicas; an address missing: zeros) on top of this replica's own."""
        engines = self.engines()
        for addr in [a for a, (slot, _) in self.got.items() if engines.get(a) != slot]:
            slot, add = self.got.pop(addr)   # the engine left, or moved to another slot: take it back
            self._add(slot, tuple(-v for v in add))   # type: ignore[arg-type]
        for addr, slot in engines.items():
            want = others.get(addr, ZERO)
            have = self.got.get(addr, (slot, ZERO))[1]
            if want != have:
                self._add(slot, (want[0] - have[0], want[1] - have[1], want[2] - have[2], want[3] - have[3]))
                if any(want):
                    self.got[addr] = (slot, want)
                else:
                    self.got.pop(addr, None)

    def clear(self) -> None:
        """Take every other replica's counters back (this replica's own view only)."""
        for slot, add in self.got.values():
            self._add(slot, (-add[0], -add[1], -add[2], -add[3]))
        self.got.clear()

    def _add(self, slot: int, d: Counts) -> None:
        seg = self.seg
        if d[0] and seg.router_inflight_add(slot, d[0]) < 0:   # never below zero (a line reset meanwhile)
            seg.router_inflight_add(slot, -seg.router_inflight_get(slot))
        if d[1] and seg.prefill_add(slot, d[1]) < 0:
            seg.prefill_add(slot, -int(seg.router_line(slot)["prefill_tokens"]))
        if d[2] or d[3]:
            reqs, ctx = seg.decode_add(slot, d[2], d[3])
            if reqs < 0 or ctx < 0:
                seg.decode_add(slot, -min(0, reqs), -min(0, ctx))


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
    load outlives its last refresh, s (> ``interval_s``); ``replay_s``: placements older than this
    (stream time) are not replayed into pending placements at catch-up (they still enter the prefix
    index); ``max_placements``: the placements stream's approximate length bound (the loads
    stream's: ``max_placements // 10``, at least 1000); ``timeout_s``: each Redis call's socket
    timeout, s.

    :meth:`start` connects and catches up (or, Redis unreachable, falls back at once), then runs
    the refresh and the stream reader until :meth:`close`. Single threaded: :meth:`place` and
    :meth:`poke` are called on the event loop that ran :meth:`start`. Raises ValueError for bad
    settings."""

    def __init__(self, url: str, seg: Segment, engines: Callable[[], dict[str, int]], on_place: OnPlace | None = None,
                 prefix: str = "dplb", replica: str | None = None, interval_s: float = 0.1, ttl_s: float = 2.0,
                 replay_s: float = 30.0, max_placements: int = 100_000, timeout_s: float = 1.0,
                 push_gap_s: float = 0.001) -> None:
        if interval_s <= 0 or ttl_s <= interval_s or push_gap_s < 0:
            raise ValueError(f"need 0 < interval_s < ttl_s and push_gap_s >= 0 (got {interval_s}, {ttl_s}, {push_gap_s})")
        if max_placements < 1 or timeout_s <= 0:
            raise ValueError(f"max_placements and timeout_s must be positive (got {max_placements}, {timeout_s})")
        import redis.asyncio as aioredis

        self.url = url
        self.load = LoadShare(seg, engines)
        self.on_place = on_place
        self.prefix = prefix
        self.replica = replica or default_replica_id()
        self.interval_s = interval_s
        self.push_gap_s = push_gap_s
        self.ttl_s = ttl_s
        self.replay_s = replay_s
        self.max_placements = max_placements
        self.max_loads = max(1000, max_placements // 10)
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
        self.loads_key = f"{prefix}:loads"
        #: placements of this replica not sent yet: (address, hashes, keys)
        self.outbox: list[tuple[str, Sequence[int], Sequence[int]]] = []
        self.last_id = b"0-0"         # the placements stream's last entry read
        self.loads_id = b"0-0"        # the loads stream's
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
        self.seq = 0
        self._caught_up = False
        self._written: dict[str, Counts] | None = None
        self._written_at = 0.0
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
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
            last = _entries(await self.redis.xrevrange(self.loads_key, count=1))
            self.loads_id = last[0][0] if last else b"0-0"   # what the hashes read next hold already
            await self._refresh()
            if self.on_place is not None:
                await self._replay()
            self._up(True)
        except Exception as e:   # noqa: BLE001  (redis errors, OSError, timeouts: fall back, never fail)
            self._down(e)
            # when Redis answers: what comes from then on (the poll has the rest of the load); the
            # placements the stream held before are not replayed there as placed just now (age 0)
            self.loads_id = self.last_id = b"$"
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
                    p.xadd(self.loads_key, {"r": self.replica, "s": str(self.seq + 1), "c": msgspec.msgpack.encode({})},
                           maxlen=self.max_loads, approximate=True)
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
                await self._refresh()
                self._up(True)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001
                self._down(e)
                await asyncio.sleep(min(1.0, self.ttl_s / 2))   # retry, not spin, while Redis is down
                wake.clear()

    async def _refresh(self) -> None:
        """One round trip: the queued placements, this replica's hash and its push when it
        changed (or a quarter TTL passed), every other replica's hash; then the lines take the
        others' sum."""
        own = self.load.own()
        now = time.monotonic()
        write = own != self._written or now - self._written_at >= self.ttl_s / 4
        seq = self.seq + 1 if write else self.seq
        pairs: list[str] = ["_", str(seq)]   # never empty: the hash exists while the replica runs
        counts = b""
        if write:
            for addr, c in own.items():
                pairs += [addr, encode_counts(c)]
            counts = msgspec.msgpack.encode({a: list(c) for a, c in own.items()})
        out, self.outbox = self.outbox, []
        args = [self.replica, int(self.ttl_s * 1000), "1" if write else "0", self.hash_prefix, self.max_loads, counts, *pairs]
        try:
            for attempt in (0, 1):
                async with self.redis.pipeline(transaction=False) as p:
                    for addr, hashes, keys in out if attempt == 0 else ():
                        p.xadd(self.stream_key, {"r": self.replica, "p": msgspec.msgpack.encode([addr, list(hashes), list(keys)])},
                               maxlen=self.max_placements, approximate=True)
                    p.evalsha(self.sync_sha, 3, self.replicas_key, self.own_key, self.loads_key, *args)
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
        rows = res[-1]
        seen: set[str] = set()
        for i in range(0, len(rows) - 1, 2):
            r = _s(rows[i])
            seen.add(r)
            flat = rows[i + 1]
            got: dict[str, Counts] = {}
            s = 0
            for j in range(0, len(flat) - 1, 2):
                field = _s(flat[j])
                if field == "_":
                    s = _int(flat[j + 1])
                else:
                    got[field] = decode_counts(flat[j + 1])
            self._take(r, s, got, now)
        for r in [r for r, v in self.per.items() if r not in seen and v[2] <= now]:
            del self.per[r]    # expired or said goodbye (not one that a push brought in meanwhile)
        self._sum()
        self.refreshes += 1

    def _take(self, replica: str, seq: int, counts: dict[str, Counts], now: float) -> bool:
        """Keep ``replica``'s counters unless a newer write of it is held already."""
        have = self.per.get(replica)
        if have is not None and have[0] > seq:
            return False
        self.per[replica] = (seq, counts, now)
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
        loads, places = self.loads_key.encode(), self.stream_key.encode()
        while not self._closed:
            streams = {self.loads_key: self.loads_id}
            if self.on_place is not None:
                streams[self.stream_key] = self.last_id
            try:
                got: object = await self.reader.xread(streams, count=1000, block=200)   # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001
                self._down(e)
                await asyncio.sleep(min(1.0, self.ttl_s / 2))
                continue
            # [[stream, entries], ...] (RESP2, redis-py's default protocol)
            changed = False
            for x in got if isinstance(got, list) else ():
                if not (isinstance(x, (list, tuple)) and len(x) == 2):
                    continue
                name = _b(x[0])
                for eid, fields in _entries(x[1]):
                    if name == loads:
                        self.loads_id = eid
                        changed = self._apply_load(fields) or changed
                    elif name == places:
                        self._apply_entry(eid, fields, 0.0)
                        self.last_id = eid
            if changed and self.up:
                self._sum()

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


def _b(v: object) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()


def _entries(raw: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """Stream entries as redis-py answers them (``[(id, {field: value}), ...]``), checked."""
    out: list[tuple[bytes, dict[bytes, bytes]]] = []
    if isinstance(raw, list):
        for e in raw:
            if isinstance(e, (list, tuple)) and len(e) == 2 and isinstance(e[1], dict):
                out.append((_b(e[0]), {_b(k): _b(v) for k, v in e[1].items()}))
    return out


def _s(v: object) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _int(v: object) -> int:
    try:
        return int(_s(v))
    except ValueError:
        return 0


def _id_ms(eid: bytes | str) -> int:
    """A stream entry id's milliseconds (Redis server time)."""
    return int(_b(eid).split(b"-")[0])


def _safe(url: str) -> str:
    """``url`` without its password."""
    head, at, tail = url.rpartition("@")
    return f"{head.split('//')[0]}//***@{tail}" if at else url


__all__ = ["FIELDS", "SYNC_SCRIPT", "LoadShare", "OnPlace", "Share", "decode_counts", "default_replica_id",
           "encode_counts"]
