"""KV-cache events in vLLM's wire format (``--kv-events-config``), published by the simulated engine.

vLLM (``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``) publishes every change of its
prefix cache on a ZMQ PUB socket as a three-frame message::

    (topic, sequence number as 8-byte big-endian, msgpack(EventBatch))

``EventBatch{ts, events, data_parallel_rank}`` holds tagged structs (msgspec ``tag=True``: the
map's ``"type"`` names the class): ``BlockStored{block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name}``, ``BlockRemoved{block_hashes, medium}`` and
``AllBlocksCleared{}``. The sequence numbers count batches from 0 in each publisher process (a
restarted engine starts again at 0). A ROUTER socket (``replay_endpoint``) serves missed batches:
a client sends ``(b"", start sequence as 8-byte big-endian)`` and receives ``(b"", seq, payload)``
for every buffered batch from ``start`` on (the last ``buffer_steps``), then ``(b"", -1, b"")``.
Each data-parallel rank publishes on the endpoint's port + rank. The structs below are declared
as vLLM declares them (field order and options), so msgspec encodes the same bytes.

Block hashes here are the simulated engine's own (Python's built-in hash chained over the block's
words, :func:`sim_engine.kv_cache.chain_hashes`: vLLM's ``builtin`` algorithm is likewise per
process), token ids are :func:`sim_engine.tokenizer.token_ids` of the block's words.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from sim_engine.kv_cache import RawEvent
from sim_engine.tokenizer import token_ids

if TYPE_CHECKING:
    import zmq

log = logging.getLogger(__name__)

#: the replay socket's end-of-replay sequence number (vLLM's ``END_SEQ``)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """One published batch: ``ts`` (publisher's wall clock, s), ``events``, the DP rank."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged KV-cache events."""


class BlockStored(KVCacheEvent):
    """Blocks ``block_hashes`` (a chain: each one's parent is the one before, the first one's is
    ``parent_block_hash``) entered the prefix cache; ``token_ids``: their tokens, in order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks ``block_hashes`` left the prefix cache."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the prefix cache."""


def wire_events(raw: Sequence[RawEvent], block_size: int, vocab_size: int) -> list[KVCacheEvent]:
    """The engine's raw events (:attr:`sim_engine.kv_cache.KVCacheManager.events`) as vLLM's events,
    in order: consecutive stored blocks that chain (each one's parent the previous one) become one
    :class:`BlockStored`, consecutive removals one :class:`BlockRemoved`."""
    out: list[KVCacheEvent] = []
    for ev in raw:
        kind = ev[0]
        last = out[-1] if out else None
        if kind == "stored" and len(ev) == 4:
            _, h, parent, words = ev
            ids = token_ids(list(words), vocab_size) if words is not None else []
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)
                last.token_ids.extend(ids)
            else:
                out.append(BlockStored([h], parent, ids, block_size, None, MEDIUM_GPU, None))
        elif kind == "removed" and len(ev) == 2:
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(ev[1])
            else:
                out.append(BlockRemoved([ev[1]], MEDIUM_GPU))
        elif kind == "cleared":
            out.append(AllBlocksCleared())
        else:  # pragma: no cover - a bug
            raise ValueError(f"unknown KV-cache event {kind!r}")
    return out


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``): the fields the simulated engine
    uses. ``endpoint``: PUB address (bound when it holds ``*``, ``::`` or is ipc/inproc, else
    connected, as vLLM); ``replay_endpoint``: ROUTER address or None; ``buffer_steps``: batches kept
    for replay; ``topic``: first frame of every message."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; raises ValueError naming a bad or unknown field."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--kv-events-config: not JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError("--kv-events-config: expected a JSON object")  # noqa: TRY004 - a flag value
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known - {"max_queue_size"})
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)}")
        d.pop("max_queue_size", None)
        cfg = cls(**d)
        if cfg.enable_kv_cache_events and cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {cfg.publisher!r} (the simulated engine has zmq)")
        return cfg

    @property
    def active(self) -> bool:
        """True when events are to be published over ZMQ."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqEventPublisher:
    """vLLM's reliable PUB/ROUTER publisher: :meth:`publish` numbers a batch, sends it and keeps it
    for replay; a thread answers replay requests. :meth:`close` stops the thread and closes the
    sockets (idempotent). Publishing happens on the caller's thread (the engine's step loop), which
    is the only sender on the PUB socket; the thread owns the ROUTER socket."""

    def __init__(self, cfg: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.cfg = cfg
        self.rank = data_parallel_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        ep = cfg.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._pub.bind(ep)
        else:
            self._pub.connect(ep)
        self._topic = cfg.topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._lock = threading.Lock()
        self._enc = msgspec.msgpack.Encoder()
        self._replay: zmq.Socket[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(cfg.replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, name="kv-events-replay", daemon=True)
            self._thread.start()

    @property
    def last_endpoint(self) -> str:
        """The PUB socket's bound address (a ``tcp://*:0`` endpoint gets its port here)."""
        import zmq

        return bytes(self._pub.getsockopt(zmq.LAST_ENDPOINT)).decode()

    @property
    def replay_last_endpoint(self) -> str | None:
        """The ROUTER socket's bound address, or None without replay."""
        import zmq

        return None if self._replay is None else bytes(self._replay.getsockopt(zmq.LAST_ENDPOINT)).decode()

    def publish(self, events: list[KVCacheEvent], ts: float | None = None) -> int:
        """Send one batch of ``events``; returns its sequence number."""
        batch = EventBatch(time.time() if ts is None else ts, list(events), self.rank)
        payload = self._enc.encode(batch)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        return seq

    def _serve_replay(self) -> None:
        import zmq

        sock = self._replay
        if sock is None:  # pragma: no cover - the thread only runs with a replay socket
            return
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not dict(poller.poll(100)):
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                log.warning("invalid KV-events replay request (%d frames)", len(frames))
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            try:
                for s, p in batches:
                    sock.send_multipart((client, b"", s.to_bytes(8, "big"), p))
                sock.send_multipart((client, b"", END_SEQ, b""))
            except zmq.ZMQError:
                return

    def close(self) -> None:
        """Stop the replay thread and close both sockets and the context (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for s in (self._pub, self._replay):
            if s is not None and not s.closed:
                s.close(linger=0)
        self._ctx.term()
