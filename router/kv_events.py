"""Engines' KV-cache events, consumed off the request path: each engine's set of cached blocks.

vLLM publishes every change of its prefix cache (``--kv-events-config``; the simulated engine
publishes the same wire format, :mod:`sim_engine.kv_events`): ZMQ PUB messages ``(topic, sequence
as 8-byte big-endian, msgpack(EventBatch))`` with ``EventBatch{ts, events, data_parallel_rank}``
and tagged events ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, ...}``,
``BlockRemoved{block_hashes, ...}``, ``AllBlocksCleared{}``; a ROUTER socket replays missed batches
(send ``(b"", start seq)``, receive ``(b"", seq, payload)`` frames until seq −1; vLLM 0.32 puts the
topic before the sequence: ``(b"", topic, seq, payload)``, read too). vLLM encodes the
structs as maps (``"type"`` names the event); releases before 0.11 encoded them as arrays (the tag
first, then the fields in order): :func:`decode_batch` reads both.

:class:`BlockSet` is one publisher's (one engine's, one data-parallel rank's) state, kept by
sequence number:

* batches are applied in sequence order, each exactly once;
* a gap (a batch ``s`` arrives while ``n < s`` is expected) is filled from the replay socket
  before ``s`` is applied; what the replay no longer holds is counted in ``lost`` (the set may
  then keep a block the engine evicted, or miss one it stored, until the block's next event);
* the publisher's restart (its sequence starts again: a live batch numbered below the one
  expected that is not a batch already applied) or ``AllBlocksCleared`` empties the set;
* a subscriber that joins a running engine first replays from sequence 0 (whatever the buffer
  still holds: :attr:`BlockSet.complete` says whether that was the whole history), so a replica
  that starts or returns catches up before it is counted ready (:meth:`KVEventSubscriber.caught_up`).

Besides the engine's block hashes, the set keeps for each block a key of its own, chained over
the token ids the event carries (``key = hash((parent key, *token ids))``: Python hashes ints and
tuples of ints the same in every process), so a router that tokenizes a prompt the engine's way
can match it without knowing the engine's hash function or its seed (vLLM's ``sha256`` chains
from a random root unless ``PYTHONHASHSEED`` is set): :func:`token_keys` and
:meth:`BlockSet.match_keys`.

:class:`KVEventSubscriber` runs one thread per engine endpoint (SUB + DEALER for replay) that feeds
a :class:`BlockSet`; readers on other threads take :meth:`BlockSet.match` under its lock.
"""
from __future__ import annotations

import logging
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat

import msgspec
import zmq

from dplb_prefix import leading_run, remove_blocks, store_blocks
from dplb_prefix import token_keys as _token_keys

log = logging.getLogger(__name__)

#: the replay socket's end marker
END_SEQ = -1
#: a chain's root key (the parent key of a first block)
ROOT_KEY = 0

BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class Stored:
    """``BlockStored``: ``hashes`` entered the cache, chained on ``parent`` (None: a first block);
    ``token_ids``: their tokens in order (``block_size`` per block)."""

    hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class Removed:
    """``BlockRemoved``: ``hashes`` left the cache."""

    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class Cleared:
    """``AllBlocksCleared``: every block left the cache."""


Event = Stored | Removed | Cleared


class EventFormatError(ValueError):
    """A payload that is not a KV-cache ``EventBatch``."""


def _hash(x: object) -> BlockHash:
    if isinstance(x, (int, bytes)) and not isinstance(x, bool):
        return x
    raise EventFormatError(f"block hash {x!r}: expected an int or bytes")


def _event(raw: object) -> Event | None:
    """One decoded event (map or array form); None for an event kind this consumer ignores."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        f = raw
        get = f.get
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
                 "BlockRemoved": ("block_hashes",), "AllBlocksCleared": ()}.get(kind, ())
        f = dict(zip(names, raw[1:]))
        get = f.get
    else:
        raise EventFormatError(f"event {raw!r}: expected a tagged map or array")
    if kind == "BlockStored":
        hashes = tuple(map(_hash, get("block_hashes") or ()))
        parent = get("parent_block_hash")
        ids = tuple(map(int, get("token_ids") or ()))   # one C loop: thousands of ids a batch
        bs = int(get("block_size") or 0)
        if bs <= 0 or len(ids) != bs * len(hashes):
            raise EventFormatError(f"BlockStored: {len(ids)} token ids for {len(hashes)} blocks of {bs}")
        return Stored(hashes, None if parent is None else _hash(parent), ids, bs)
    if kind == "BlockRemoved":
        return Removed(tuple(map(_hash, get("block_hashes") or ())))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


class _StoredMap(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | bytes | None = None


class _RemovedMap(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]


class _ClearedMap(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _BatchMap(msgspec.Struct):
    ts: float
    events: list[_StoredMap | _RemovedMap | _ClearedMap]
    data_parallel_rank: int | None = None


#: today's vLLM batches (the map form, the three kinds), decoded and type-checked in one C pass:
#: a batch of a 4,500-token prompt's blocks costs ~0.1 ms instead of ~1 ms through the generic path
_TYPED = msgspec.msgpack.Decoder(_BatchMap)


def _typed(payload: bytes) -> tuple[float, list[Event], int | None] | None:
    """:func:`decode_batch` through :data:`_TYPED`; None for anything it does not take (an array
    form, another event kind, a wrong field type: the generic path decides)."""
    try:
        b = _TYPED.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    out: list[Event] = []
    for e in b.events:
        if isinstance(e, _StoredMap):
            bs = e.block_size
            if bs <= 0 or len(e.token_ids) != bs * len(e.block_hashes):
                raise EventFormatError(f"BlockStored: {len(e.token_ids)} token ids for {len(e.block_hashes)} "
                                       f"blocks of {bs}")
            out.append(Stored(tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), bs))
        elif isinstance(e, _RemovedMap):
            out.append(Removed(tuple(e.block_hashes)))
        else:
            out.append(Cleared())
    return b.ts, out, b.data_parallel_rank


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None]:
    """``(ts, events, data_parallel_rank)`` of one msgpack ``EventBatch`` (map or array form).
    Raises :class:`EventFormatError` when it is not one."""
    got = _typed(payload)
    if got is not None:
        return got
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventFormatError(f"not msgpack: {e}") from None
    if isinstance(obj, dict):
        ts, events, rank = obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    else:
        raise EventFormatError("not an EventBatch")
    if not isinstance(events, list):
        raise EventFormatError("EventBatch.events is not a list")
    out = [ev for ev in (_event(r) for r in events) if ev is not None]
    return float(ts or 0.0), out, None if rank is None else int(rank)


def token_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """This consumer's chained keys of the full blocks of ``token_ids`` (a partial tail is ignored):
    ``hash((parent key, *ids))`` per block, the same in every process. Native
    (:func:`dplb_prefix.token_keys`, bit for bit CPython's tuple hash;
    :func:`dplb_prefix.reference.token_keys` is the Python definition). Raises ValueError for a
    ``block_size`` below 1. Cost: about 20 ns per block of 16 ids."""
    return _token_keys(token_ids, block_size, parent)


#: ``replay(start) -> [(seq, payload), ...]``: the buffered batches from ``start`` on, in order
Replay = Callable[[int], list[tuple[int, bytes]]]


class BlockSet:
    """One engine's cached blocks, from its KV-cache events (see the module docstring).

    ``blocks``: engine block hash → this consumer's key (None when the parent's key was unknown);
    ``keys``: the keys present. Thread safety: :meth:`on_message` and the readers take ``lock``.

    ``orphans`` counts the keys present whose parent key is not (a block kept after its parent was
    evicted). While it is 0 the keys present are closed under "parent of": a key of a request's
    chain is present only if every key before it is, so :meth:`held_run` finds a request's leading
    run by bisection (about 12 lookups for 3,000 blocks instead of one per block: a 50k-token
    prompt's walk over every engine cost as much as tokenizing it); with orphans it walks."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.blocks: dict[BlockHash, int | None] = {}
        self.keys: dict[int, int] = {}          # key -> how many engine blocks carry it
        self.orphans = 0                        # keys present whose parent key is not
        self._parent: dict[int, int] = {}       # key present -> its parent key (ROOT_KEY: a first block)
        self._kids: dict[int, int] = {}         # key -> how many keys present have it as parent
        self.next_seq: int | None = None        # None: nothing applied yet
        self.complete = False                   # the history since sequence 0 was applied
        self.lost = 0                           # batches a gap's replay no longer held
        self.resets = 0                         # publisher restarts and AllBlocksCleared seen
        self.applied = 0
        self.lock = threading.Lock()
        self._recent: OrderedDict[int, int] = OrderedDict()   # seq -> crc32 of the applied payload
        #: told of every block stored (its hash and key): a router's placements not yet stored
        self.watchers: list[PendingBlocks] = []

    # ---- state ---------------------------------------------------------------------------------
    #: how many applied batches are remembered to tell a replayed duplicate from a restart
    RECENT = 4096

    def clear(self) -> None:
        """Forget every block."""
        self.blocks.clear()
        self.keys.clear()
        self._parent.clear()
        self._kids.clear()
        self.orphans = 0

    def store(self, hashes: Iterable[BlockHash], parent: BlockHash | None = None,
              token_ids: Sequence[int] = (), block_size: int = 0) -> None:
        """Add blocks ``hashes`` (chained on ``parent``); with their ``token_ids`` also their keys.
        The per-block step (the four maps and the orphan count) is native
        (:func:`dplb_prefix.store_blocks`; :func:`dplb_prefix.reference.store_blocks` defines it)."""
        hashes = list(hashes)
        keys: list[int | None]
        if block_size > 0 and len(token_ids) == block_size * len(hashes):
            pkey = ROOT_KEY if parent is None else self.blocks.get(parent)
            keys = list(token_keys(token_ids, block_size, pkey)) if pkey is not None else [None] * len(hashes)
        else:
            keys = [None] * len(hashes)
        for w in self.watchers:
            w.stored(hashes)
            w.stored(k for k in keys if k is not None)
        pk = ROOT_KEY if parent is None else self.blocks.get(parent)
        self.orphans += store_blocks(self.blocks, self.keys, self._parent, self._kids, hashes, keys, pk, ROOT_KEY)

    def remove(self, hashes: Iterable[BlockHash]) -> None:
        """Drop blocks ``hashes`` (unknown ones are ignored)."""
        self.orphans += remove_blocks(self.blocks, self.keys, self._parent, self._kids, hashes, ROOT_KEY)

    def apply(self, events: Iterable[Event]) -> None:
        """Apply decoded events in order."""
        for ev in events:
            if isinstance(ev, Stored):
                self.store(ev.hashes, ev.parent, ev.token_ids, ev.block_size)
            elif isinstance(ev, Removed):
                self.remove(ev.hashes)
            else:
                self.clear()
                self.resets += 1

    # ---- the stream ----------------------------------------------------------------------------
    def catch_up(self, batches: Sequence[tuple[int, bytes]]) -> None:
        """Apply what the replay socket answered for sequence 0 on (a subscriber's start): the set
        is rebuilt from them; batches before the first one held count as ``lost``."""
        with self.lock:
            self.clear()
            self._recent.clear()
            self.next_seq = 0
            self.complete = True
            for s, p in sorted(batches, key=lambda b: b[0]):
                if s < self.next_seq:
                    continue
                if s > self.next_seq:
                    self._lose(s - self.next_seq)
                self._apply_payload(s, p)

    def on_message(self, seq: int, payload: bytes, replay: Replay | None = None) -> None:
        """One live message from the PUB socket: apply it in order, filling a gap from ``replay``
        first (see the module docstring). A payload that does not decode is skipped (logged) but
        its sequence number is consumed."""
        with self.lock:
            if self.next_seq is None:
                # first message: catch up from the start of what the publisher still holds
                self.next_seq = 0
                self.complete = True
            elif seq < self.next_seq:
                if self._recent.get(seq) == zlib.crc32(payload):
                    return   # already applied (the catch-up's replay held it too)
                # otherwise the live stream only goes back when the publisher restarted
                log.info("KV events %s: sequence went back %d -> %d: the engine restarted", self.name,
                         self.next_seq, seq)
                self.clear()
                self.resets += 1
                self.next_seq = 0
                self.complete = True
            if seq > self.next_seq:
                got = replay(self.next_seq) if replay is not None else []
                for s, p in got:
                    if s < self.next_seq or s >= seq:
                        continue
                    if s > self.next_seq:
                        self._lose(s - self.next_seq)
                    self._apply_payload(s, p)
                if seq > self.next_seq:
                    self._lose(seq - self.next_seq)
            self._apply_payload(seq, payload)

    def _lose(self, n: int) -> None:
        self.lost += n
        self.complete = False
        log.warning("KV events %s: %d batch(es) missed and no longer replayable", self.name, n)

    def _apply_payload(self, seq: int, payload: bytes) -> None:
        try:
            _, events, _ = decode_batch(payload)
        except EventFormatError as e:
            log.warning("KV events %s: batch %d skipped: %s", self.name, seq, e)
            events = []
        self.apply(events)
        self.applied += 1
        self.next_seq = seq + 1
        self._recent[seq] = zlib.crc32(payload)
        if len(self._recent) > self.RECENT:
            self._recent.popitem(last=False)

    # ---- readers -------------------------------------------------------------------------------
    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading ``hashes`` (the engine's hashes of a request's blocks) are cached."""
        with self.lock:
            return leading_run(hashes, self.blocks)

    def match_keys(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` (:func:`token_keys` of a request's token ids) are cached."""
        with self.lock:
            return self.held_run(keys)

    def held_run(self, keys: Sequence[int]) -> int:
        """:meth:`match_keys` for a caller that holds ``lock``: by bisection while no key is an
        orphan (class docstring), else one lookup per leading key."""
        present = self.keys
        if self.orphans:
            return leading_run(keys, present)
        lo, hi = 0, len(keys)
        while lo < hi:   # keys[:lo] present, keys[hi:] not
            mid = (lo + hi) >> 1
            if keys[mid] in present:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def __len__(self) -> int:
        return len(self.blocks)


class PendingBlocks:
    """The blocks a router placed on one engine (dispatched prompts) that the engine's events do
    not show yet: the events arrive when the step that computed a block ends (vLLM publishes after
    each step), so without these a prompt dispatched a moment ago looks cached nowhere and its
    copies arriving meanwhile spread over several engines, where the router's own index would have
    followed the first placement.

    A block counts as the engine's (:meth:`match`) from :meth:`place` until the engine's
    ``BlockStored`` of it arrives (:meth:`stored`: from then on the block set alone answers, and an
    eviction is seen) or ``ttl_s`` seconds pass (the request failed, was aborted or preempted:
    never stored). Keys are what the block set is matched with: the engine's block hashes, or
    :func:`token_keys`. Not thread safe: a live reader takes the block set's ``lock``, which the
    subscriber holds while it stores."""

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 (got {ttl_s})")
        self.ttl_s = ttl_s
        self.until: dict[BlockHash, float] = {}   # key -> expiry (the caller's clock, seconds)
        self._prune_at = 1024

    def __len__(self) -> int:
        return len(self.until)

    def place(self, keys: Iterable[BlockHash], now: float) -> None:
        """A prompt whose blocks are ``keys`` was dispatched to the engine at ``now`` (seconds)."""
        until = self.until
        until.update(dict.fromkeys(keys, now + self.ttl_s))   # one C loop (a prompt: thousands of keys)
        if len(until) > self._prune_at:   # expired entries go in amortised O(1)
            for k in [k for k, u in until.items() if u <= now]:
                del until[k]
            self._prune_at = max(1024, 2 * len(until))

    def stored(self, keys: Iterable[BlockHash]) -> None:
        """The engine's events stored ``keys``: no longer pending."""
        until = self.until
        if until:   # until.pop(k, None) for each key, the loop in C (a stored batch: thousands of keys)
            deque(map(until.pop, keys, repeat(None)), maxlen=0)

    def match(self, blocks: BlockSet, keys: Sequence[BlockHash], now: float, by_key: bool = False) -> int:
        """How many leading ``keys`` the engine holds (``blocks``: its hashes, or with ``by_key``
        its token keys) or was given by a placement not yet stored and not expired at ``now``."""
        return leading_run(keys, blocks.keys if by_key else blocks.blocks, self.until, now)


class KVEventSubscriber:
    """A thread that subscribes to one publisher (``endpoint``, its ``replay_endpoint``) and keeps
    :attr:`blocks` (a :class:`BlockSet`). :meth:`start`, then :meth:`close` (joins the thread,
    closes the sockets and the context; idempotent). ``topic``: the subscription prefix ("": all).
    At its start the thread asks the replay socket for everything from sequence 0 (an idle engine
    answers nothing, and that is a catch-up too); :meth:`caught_up` says whether that, or a first
    live batch, has been applied (readiness: a replica that starts waits for it)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 name: str = "", replay_timeout_s: float = 2.0) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.blocks = BlockSet(name or endpoint)
        self.replay_timeout_s = replay_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None

    def start(self) -> None:
        """Connect and start the thread."""
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()

    def caught_up(self) -> bool:
        """True once the start's replay or a live batch has been applied."""
        return self.blocks.next_seq is not None

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The batches from ``start`` on (empty without a replay socket or an answer)."""
        return self.ask_replay(start) or []

    def ask_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Ask the replay socket for the batches from ``start`` on; None without a replay socket
        or when it does not finish answering within ``replay_timeout_s``."""
        ctx = self._ctx
        if not self.replay_endpoint or ctx is None:
            return None
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(int(self.replay_timeout_s * 1000)):
                frames = sock.recv_multipart()
                # (b"", seq, payload), or with the topic as the PUB socket sends it, (b"", topic,
                # seq, payload): what vLLM's replay socket answers since (at least) 0.32
                if len(frames) not in (3, 4):
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return out
                out.append((seq, frames[-1]))
        finally:
            sock.close(linger=0)
        return None

    def _run(self) -> None:
        ctx = self._ctx
        assert ctx is not None   # started
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            # catch up: what the publisher still holds (live batches queue meanwhile; those the
            # replay also held are recognised as duplicates)
            while not self._stop.is_set() and self.replay_endpoint and self.blocks.next_seq is None:
                got = self.ask_replay(0)
                if got is not None:
                    self.blocks.catch_up(got)
                    break
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    log.warning("KV events %s: a message of %d frames skipped", self.endpoint, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=False)
                self.blocks.on_message(seq, frames[2], self.replay)
        except zmq.ZMQError as e:
            if not self._stop.is_set():
                log.warning("KV events %s: subscriber stopped: %s", self.endpoint, e)
        finally:
            sub.close(linger=0)

    def close(self) -> None:
        """Stop the thread, close the sockets and the context (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
