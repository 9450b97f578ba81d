"""Picker replicas on different nodes share their load and their placements through Redis.

Each ``dplb-epp`` replica keeps its own segment (its router lines: the requests *it* dispatched
per engine, their outstanding prefill, their decoding requests) and its own prefix index. With
``--share-url redis://host:6379/0`` (:class:`Share`) every replica also sees what the others have
in flight on each engine and where they placed which prompt, as one picker would:

**Load** (the router-line counters ``router_inflight``, ``prefill_tokens``, ``decode_reqs``,
``decode_ctx_tokens`` per engine). Each replica writes its *own* counters (its line minus what it
added for the others) as a Redis hash ``<prefix>:load:<replica>`` (field: the engine's address as
the endpoints file or the pool names it, value: the four counters) with a TTL (``ttl_s``, 2 s by
default) that it refreshes while it runs, and lists itself in the set ``<prefix>:replicas``. Every
``interval_s`` (5 ms by default) one pipelined round trip writes its hash when it changed (and at
least every ``ttl_s / 4``) and reads every other replica's hash (:data:`SYNC_SCRIPT`, a Lua script:
one atomic read, expired replicas dropped from the set); the sum of the others' counters per engine
is added to this replica's router lines (:meth:`LoadShare.apply`). The kernel then prices each
engine with every replica's work, and the scraper's ``inflight`` (so the engine's outside requests
``X_i``) counts it too. A replica killed without a goodbye stops refreshing its hash: its share
expires ``ttl_s`` later on every other replica.

**Placements.** Each prompt a replica dispatches is appended to the Redis stream
``<prefix>:placements`` (``XADD``, ``MAXLEN ~ max_placements``) in the same round trip: the
engine's address, the prompt's prefix-index hashes (the policy's own index: chained over the
text and the model's name, the same in every process) and, with the engines' KV-cache events
(``--kv-events``), its token block keys (:func:`router.kv_events.token_keys`, a pending placement
until the engine's ``BlockStored`` arrives: :class:`router.kv_events.PendingBlocks`). A task reads
the stream (``XREAD BLOCK``) and hands the other replicas' placements to ``on_place``, so a
session's next turn finds the engine that holds its history whichever replica placed it.

**Catch-up.** :meth:`Share.start` reads the others' load and replays the stream (what it still
holds) before :meth:`Share.caught_up` turns True; the picker reports ready only then.

**Redis unreachable.** Each replica falls back to its own view: the others' counters it had added
are taken back (its lines hold its own work only, as without sharing), placements are not sent;
the failure is logged once (then once more when Redis answers again) and counted
(:attr:`Share.errors`, ``dplb_epp_share_errors_total``). No request waits for Redis: reads and writes
run on a background task, the request path only queues placements.

Why Redis: platform teams already run it (and its operators, failover and monitoring); a hash per
replica with a TTL is how a dead replica's share disappears without a protocol of our own, a
stream keeps placements in order and lets a late reader catch up (docs/DESIGN.md).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec

if TYPE_CHECKING:
    from dplb_shm import Segment
    from epp.discovery import ScrapeManager
    from epp.events import EventsFeed
    from router.policies.prefix_index import PrefixIndex
    from router.state import RouterState

log = logging.getLogger("dplb.epp.share")

#: the router-line counters shared (``Segment.router_line`` keys), in the order they are encoded
FIELDS = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")
Counts = tuple[int, int, int, int]
ZERO: Counts = (0, 0, 0, 0)

#: One round trip per refresh: write this replica's hash when asked (``ARGV[3] == "1"``), then read
#: every other replica's. ``KEYS[1]``: the replicas' set; ``KEYS[2]``: this replica's hash;
#: ``ARGV``: replica id, TTL ms, write flag, key prefix of the hashes, then field/value pairs.
#: A member whose hash expired is removed from the set. Returns ``[replica, {field, value...}, ...]``.
SYNC_SCRIPT = """
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[2])
  redis.call('HSET', KEYS[2], unpack(ARGV, 5))
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
  redis.call('SADD', KEYS[1], ARGV[1])
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
    """The inverse of :func:`encode_counts`; a malformed value reads as zeros."""
    try:
        parts = [int(x) for x in (v.decode() if isinstance(v, bytes) else v).split()]
    except ValueError:
        return ZERO
    if len(parts) != 4:
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
    """The shared load and placements of picker replicas through Redis (module docstring).

    ``url``: a Redis URL (``redis://host:port/db``, ``rediss://`` for TLS, a password in the URL);
    ``seg`` and ``engines``: as :class:`LoadShare`; ``on_place``: called with each other replica's
    placement (:data:`OnPlace`; None: placements are neither sent nor read); ``prefix``: the keys'
    prefix (one per deployment: replicas of one pool share it); ``interval_s``: the refresh period,
    s (> 0); ``ttl_s``: how long a replica's load outlives its last refresh, s (> ``interval_s``);
    ``replay_s``: placements older than this (stream time) are not replayed into pending
    placements at catch-up (they still enter the prefix index); ``max_placements``: the stream's
    approximate length bound; ``timeout_s``: each Redis call's socket timeout, s.

    :meth:`start` connects and catches up (or, Redis unreachable, falls back at once), then runs
    the refresh and the stream reader until :meth:`close`. Raises ValueError for bad settings."""

    def __init__(self, url: str, seg: Segment, engines: Callable[[], dict[str, int]], on_place: OnPlace | None = None,
                 prefix: str = "dplb", replica: str | None = None, interval_s: float = 0.005, ttl_s: float = 2.0,
                 replay_s: float = 30.0, max_placements: int = 100_000, timeout_s: float = 1.0) -> None:
        if interval_s <= 0 or ttl_s <= interval_s:
            raise ValueError(f"need 0 < interval_s < ttl_s (got {interval_s}, {ttl_s})")
        if max_placements < 1 or timeout_s <= 0:
            raise ValueError(f"max_placements and timeout_s must be positive (got {max_placements}, {timeout_s})")
        import redis.asyncio as aioredis

        self.url = url
        self.load = LoadShare(seg, engines)
        self.on_place = on_place
        self.prefix = prefix
        self.replica = replica or default_replica_id()
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.replay_s = replay_s
        self.max_placements = max_placements
        self.timeout_s = timeout_s
        self.redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        # the stream reader blocks on its own connection
        self.reader = aioredis.Redis.from_url(url, socket_timeout=timeout_s + 1.0, socket_connect_timeout=timeout_s)
        self.sync_script = self.redis.register_script(SYNC_SCRIPT)
        self.replicas_key = f"{prefix}:replicas"
        self.hash_prefix = f"{prefix}:load:"
        self.own_key = self.hash_prefix + self.replica
        self.stream_key = f"{prefix}:placements"
        #: placements of this replica not sent yet: (address, hashes, keys)
        self.outbox: list[tuple[str, Sequence[int], Sequence[int]]] = []
        self.last_id = b"0-0"
        #: the other replicas seen at the last refresh, and their counters per engine summed
        self.others: list[str] = []
        self.remote: dict[str, Counts] = {}
        self.errors = 0         # failed Redis round trips (each is a refresh or a read in fallback)
        self.sent = 0           # placements sent
        self.received = 0       # other replicas' placements applied
        self.refreshes = 0
        self.up = False         # the last round trip succeeded
        self._caught_up = False
        self._written: dict[str, Counts] | None = None
        self._written_at = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.on_error: Callable[[], None] | None = None   # called on each counted error (a metric)

    # ---- the request path ---------------------------------------------------------------------

    def place(self, address: str, hashes: Sequence[int], keys: Sequence[int] = ()) -> None:
        """This replica dispatched a prompt (prefix-index ``hashes``, token block ``keys``) to the
        engine at ``address``: queued, sent with the next refresh (nothing while Redis is down)."""
        if self.on_place is not None and self.up and (hashes or keys):
            self.outbox.append((address, hashes, keys))

    # ---- life cycle ---------------------------------------------------------------------------

    def caught_up(self) -> bool:
        """True once the start's catch-up finished (or Redis was unreachable: own view)."""
        return self._caught_up

    async def start(self) -> None:
        """Catch up (the others' load, then the placements stream), then start the background tasks."""
        try:
            await self.redis.ping()
            await self._refresh()
            if self.on_place is not None:
                await self._replay()
            self._up(True)
        except Exception as e:   # noqa: BLE001  (redis errors, OSError, timeouts: fall back, never fail)
            self._down(e)
        self._caught_up = True
        self._tasks.append(asyncio.get_running_loop().create_task(self._refresh_loop(), name="share-refresh"))
        if self.on_place is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._read_loop(), name="share-read"))

    async def close(self) -> None:
        """Stop the tasks, remove this replica's hash (the others drop its load at once), take the
        others' counters back; idempotent."""
        if self._closed:
            return
        self._closed = True
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
        while not self._closed:
            await asyncio.sleep(self.interval_s)
            if self._closed:
                return
            try:
                await self._refresh()
                self._up(True)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001
                self._down(e)
                await asyncio.sleep(min(1.0, self.ttl_s / 2))   # retry, not spin, while Redis is down

    async def _refresh(self) -> None:
        """One round trip: the queued placements, this replica's hash when it changed (or a
        quarter TTL passed), every other replica's hash; then the lines take the others' sum."""
        own = self.load.own()
        now = time.monotonic()
        write = own != self._written or now - self._written_at >= self.ttl_s / 4
        pairs: list[str] = ["_", self.replica]   # never empty: the hash exists while the replica runs
        if write:
            for addr, c in own.items():
                pairs += [addr, encode_counts(c)]
        out, self.outbox = self.outbox, []
        try:
            async with self.redis.pipeline(transaction=False) as p:
                for addr, hashes, keys in out:
                    p.xadd(self.stream_key, {"r": self.replica, "p": msgspec.msgpack.encode([addr, list(hashes), list(keys)])},
                           maxlen=self.max_placements, approximate=True)
                await self.sync_script(keys=[self.replicas_key, self.own_key],
                                 args=[self.replica, int(self.ttl_s * 1000), "1" if write else "0", self.hash_prefix, *pairs],
                                 client=p)
                res = await p.execute()
        except Exception:
            self.outbox = out + self.outbox if len(out) < 10_000 else self.outbox   # sent with the next one
            raise
        self.sent += len(out)
        if write:
            self._written, self._written_at = own, now
        rows = res[-1]
        others: list[str] = []
        remote: dict[str, Counts] = {}
        for i in range(0, len(rows) - 1, 2):
            others.append(rows[i].decode() if isinstance(rows[i], bytes) else str(rows[i]))
            flat = rows[i + 1]
            for j in range(0, len(flat) - 1, 2):
                field = flat[j].decode() if isinstance(flat[j], bytes) else str(flat[j])
                if field == "_":
                    continue
                c = decode_counts(flat[j + 1])
                s = remote.get(field, ZERO)
                remote[field] = (s[0] + c[0], s[1] + c[1], s[2] + c[2], s[3] + c[3])
        self.others, self.remote = others, remote
        self.load.apply(remote)
        self.refreshes += 1

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
                got: object = await self.reader.xread({self.stream_key: self.last_id}, count=1000, block=200)
            except asyncio.CancelledError:
                raise
            except Exception as e:   # noqa: BLE001
                self._down(e)
                await asyncio.sleep(min(1.0, self.ttl_s / 2))
                continue
            # [[stream, entries]] (RESP2, redis-py's default protocol)
            streams = [x[1] for x in got if isinstance(x, (list, tuple)) and len(x) == 2] if isinstance(got, list) else []
            for raw in streams:
                for eid, fields in _entries(raw):
                    self._apply_entry(eid, fields, 0.0)
                    self.last_id = eid

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
        self.remote, self.others = {}, []
        self._written = None


class SharedIndex:
    """A policy's prefix index whose insertions are also sent to the other replicas
    (:meth:`Share.place`): ``inner`` is the index it stands in front of (the policy's own, or the
    :class:`epp.events.EventsIndex` over it), ``addr_of`` the engine address of a slot (None: not
    shared). With the engines' events (``feed``), the prompt's token block keys that the events
    index places as pending go with it (:attr:`epp.events.EventsFeed.on_place`). Everything else
    is the inner index's."""

    def __init__(self, inner: PrefixIndex, share: Share, addr_of: Callable[[int], str | None],
                 feed: EventsFeed | None = None) -> None:
        self.inner = inner
        self.share = share
        self.addr_of = addr_of
        self._keys: Sequence[int] = ()
        if feed is not None:
            feed.on_place = self._placed

    def _placed(self, slot: int, keys: Sequence[int]) -> None:
        self._keys = keys

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def chunk_chars(self) -> int:
        """The inner index's."""
        return int(self.inner.chunk_chars)

    def hashes(self, text: str, model: str | None = None) -> Sequence[int]:
        """The inner index's hashes of ``text``."""
        return self.inner.hashes(text, model)

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """The inner index's match."""
        return dict(self.inner.match(hashes))

    def insert(self, hashes: Sequence[int], worker_id: int) -> None:
        """Into the inner index, then queued for the other replicas with the engine's address."""
        self._keys = ()
        self.inner.insert(hashes, worker_id)
        addr = self.addr_of(worker_id)
        if addr is not None:
            self.share.place(addr, hashes, self._keys)

    def size(self, worker_id: int) -> int:
        """The inner index's size for ``worker_id``."""
        return int(self.inner.size(worker_id))

    def remove_worker(self, worker_id: int) -> None:
        """Forget ``worker_id`` in the inner index."""
        self.inner.remove_worker(worker_id)


class PickerLike(Protocol):
    """What :class:`PickerShare` reads of an :class:`epp.picker.Picker` (which holds it: no import
    back): its router state, its scrape of the endpoints and its KV-events feed."""

    state: RouterState
    scrape: ScrapeManager | None
    events: EventsFeed | None


class PickerShare:
    """A :class:`Share` wired into a started :class:`epp.picker.Picker` (``dplb-epp --share-url``):
    the engines are the picker's scraped endpoints (address as the endpoints file or the pool names
    it → its slot in the picker's private segment); the policy's prefix index is wrapped in a
    :class:`SharedIndex`; the other replicas' placements enter the policy's own index under the
    engine's local slot and, with the engines' events, the events index's pending placements (aged
    by their time in the stream). ``kwargs``: :class:`Share`'s settings. The metrics
    ``dplb_epp_share_errors_total`` (failed Redis round trips) and ``dplb_epp_share_replicas`` (the
    other replicas seen) go on the picker's registry."""

    def __init__(self, picker: PickerLike, url: str, **kwargs: float | str) -> None:
        self.picker = picker
        self.url = url
        self.kwargs = kwargs
        self.share: Share | None = None

    def engines(self) -> dict[str, int]:
        """``{engine address: slot}`` of the picker's scraped endpoints that have a slot."""
        scrape = self.picker.scrape
        if scrape is None:
            return {}
        out = {}
        for addr in scrape.wanted:
            slot = scrape.slot_of(addr)
            if slot is not None:
                out[addr] = slot
        return out

    def addr_of(self, slot: int) -> str | None:
        """The engine address of ``slot`` (None: not a scraped endpoint)."""
        for addr, s in self.engines().items():
            if s == slot:
                return addr
        return None

    def caught_up(self) -> bool:
        """True once the share caught up (or fell back: Redis unreachable at the start)."""
        return self.share is not None and self.share.caught_up()

    async def start(self) -> None:
        """Build the share over the picker's segment, wrap the policy's index, catch up, run."""
        from prometheus_client import Counter, Gauge

        st = self.picker.state
        policy = st.policy
        inner = getattr(policy, "index", None)
        events = self.picker.events
        share = self.share = Share(self.url, st.seg, self.engines, self._on_place if inner is not None else None,
                                   **self.kwargs)   # type: ignore[arg-type]
        if inner is not None:
            policy.index = SharedIndex(inner, share, self.addr_of, events)   # type: ignore[attr-defined]
        reg = st.metrics.registry
        errors = Counter("dplb_epp_share_errors", "Failed round trips to the shared store (Redis) of the picker "
                         "replicas; while it fails this replica routes on its own view", registry=reg)
        share.on_error = errors.inc
        Gauge("dplb_epp_share_replicas", "Other picker replicas whose load this replica adds (Redis)",
              registry=reg).set_function(lambda: len(share.others))
        await share.start()

    def _on_place(self, addr: str, hashes: list[int], keys: list[int], age_s: float) -> None:
        slot = self.engines().get(addr)
        index = getattr(self.picker.state.policy, "index", None)
        if slot is None or index is None:
            return
        base = index.inner if isinstance(index, SharedIndex) else index
        events = self.picker.events
        from epp.events import EventsIndex

        if isinstance(base, EventsIndex):
            base = base.inner
        if hashes:
            base.insert(hashes, slot)
        if events is not None and keys and age_s < float("inf"):
            events.place(slot, keys, events.clock() - age_s)

    async def close(self) -> None:
        """Close the share (idempotent)."""
        if self.share is not None:
            await self.share.close()


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


def _id_ms(eid: bytes | str) -> int:
    """A stream entry id's milliseconds (Redis server time)."""
    return int(_b(eid).split(b"-")[0])


def _safe(url: str) -> str:
    """``url`` without its password."""
    head, at, tail = url.rpartition("@")
    return f"{head.split('//')[0]}//***@{tail}" if at else url


__all__ = ["FIELDS", "SYNC_SCRIPT", "LoadShare", "OnPlace", "PickerShare", "Share", "SharedIndex", "decode_counts", "default_replica_id",
           "encode_counts"]
