"""The events-publishing instant worker of ``bench.router_overhead --kv-events``
(:mod:`bench.events_rig`): what it publishes for a request is what the router's events index
matches that request's prompt against (the same tokenization and block keys), so the bench
measures a router whose matches hit; blocks already stored are not published again."""
from __future__ import annotations

import shutil
import tempfile

import orjson

from bench.events_rig import EventsWorker
from dplb_protocol.wire import parse_request
from router.events_index import WordTokenizer
from router.kv_events import BlockSet, decode_batch
from sim_engine.kv_events import KVEventsConfig, ZmqEventPublisher

BS, VOCAB = 16, 128_256


class _Capture(ZmqEventPublisher):
    """The publisher, with every batch's payload also kept."""

    def __init__(self, cfg: KVEventsConfig) -> None:
        super().__init__(cfg)
        self.sent: list[bytes] = []

    def publish(self, events, ts=None):  # type: ignore[no-untyped-def]
        seq = super().publish(events, ts)
        self.sent.append(self._buffer[-1][1])
        return seq


def _body(doc: str, question: str) -> bytes:
    return orjson.dumps({"model": "bench", "messages": [{"role": "system", "content": doc},
                                                        {"role": "user", "content": question}]})


def test_published_blocks_are_what_the_router_matches():
    d = tempfile.mkdtemp(prefix="dplb-evrig-", dir="/tmp")
    pub = _Capture(KVEventsConfig(True, "zmq", f"ipc://{d}/pub", None, buffer_steps=100))
    try:
        w = EventsWorker(pub, BS, VOCAB)
        doc = " ".join(f"w{i % 97}x{i}" for i in range(5000))   # > 4096 characters: its ids cached
        blocks = BlockSet("engine")
        tok = WordTokenizer(VOCAB)

        def keys(body: bytes) -> list[int]:
            return tok.block_keys("/v1/chat/completions", parse_request("/v1/chat/completions", body).text, BS)[1]

        first = _body(doc, "what is w1x1")
        w.on_post(first)
        assert len(pub.sent) == 1
        for p in pub.sent:
            blocks.apply(decode_batch(p)[1])
        k1 = keys(first)
        assert len(k1) > 300 and blocks.match_keys(k1) == len(k1)   # every block the router asks for
        # a second question on the same document: only its own tail's blocks are new
        second = _body(doc, "and what is w2x2 " * 40)
        w.on_post(second)
        assert len(pub.sent) == 2
        stored = decode_batch(pub.sent[1])[1][0]
        k2 = keys(second)
        assert blocks.match_keys(k2) < len(k2) and len(stored.hashes) < 60   # the shared part not sent again
        blocks.apply(decode_batch(pub.sent[1])[1])
        assert blocks.match_keys(k2) == len(k2)
        # the same request again: nothing new
        w.on_post(second)
        assert len(pub.sent) == 2
    finally:
        pub.close()
        shutil.rmtree(d, ignore_errors=True)
