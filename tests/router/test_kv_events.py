"""Engines' KV-cache events (router/kv_events.py) against the simulated engine's publisher
(sim_engine/kv_events.py, vLLM's wire format): events applied in order, gaps replayed, a publisher
restart or AllBlocksCleared empties the set, a late subscriber catches up, a real engine process's
stored blocks match a prompt tokenized the engine's way. ZMQ over ipc:// sockets in a temporary
directory (loopback only); every socket, thread and process is closed at the end."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import msgspec
import pytest

from router.kv_events import (
    BlockSet,
    Cleared,
    KVEventSubscriber,
    PendingBlocks,
    Removed,
    Stored,
    decode_batch,
    token_keys,
)
from sim_engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
    wire_events,
)
from sim_engine.tokenizer import token_ids
from tests.helpers import wait_until

ENC = msgspec.msgpack.Encoder()


def payload(*events: object) -> bytes:
    return ENC.encode(EventBatch(1.0, list(events), 0))


def stored(hashes: list[int], parent: int | None, bs: int = 2) -> BlockStored:
    ids = [h % 1000 for h in hashes for _ in range(bs)]
    return BlockStored(hashes, parent, ids, bs, None, "GPU", None)


@pytest.fixture
def ipc_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dplb-kv-", dir="/tmp")
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


# ---- the wire format ---------------------------------------------------------------------------

def test_batch_is_encoded_as_vllm_encodes_it():
    raw = msgspec.msgpack.decode(payload(stored([11, 12], None), BlockRemoved([5], "GPU"), AllBlocksCleared()))
    assert raw["ts"] == 1.0 and raw["data_parallel_rank"] == 0
    ev = raw["events"]
    assert ev[0] == {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                     "token_ids": [11, 11, 12, 12], "block_size": 2, "lora_id": None, "medium": "GPU",
                     "lora_name": None}
    assert ev[1] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}
    assert ev[2] == {"type": "AllBlocksCleared"}


def test_decode_reads_the_map_form_and_the_older_array_form():
    ts, events, rank = decode_batch(payload(stored([1, 2], 9), BlockRemoved([1], None), AllBlocksCleared()))
    assert (ts, rank) == (1.0, 0)
    assert events == [Stored((1, 2), 9, (1, 1, 2, 2), 2), Removed((1,)), Cleared()]
    # vLLM before 0.11: array_like structs, the tag first; bytes hashes (sha256)
    old = msgspec.msgpack.encode([2.5, [["BlockStored", [b"h1"], None, [7, 8], 2, None, None],
                                        ["BlockRemoved", [b"h1"], None], ["AllBlocksCleared"]]])
    ts, events, rank = decode_batch(old)
    assert (ts, rank) == (2.5, None)
    assert events == [Stored((b"h1",), None, (7, 8), 2), Removed((b"h1",)), Cleared()]


def test_wire_events_chain_consecutive_blocks_into_one_stored_event():
    raw = [("stored", 1, None, ["a", "b"]), ("stored", 2, 1, ["c", "d"]), ("stored", 7, 3, ["e", "f"]),
           ("removed", 4), ("removed", 5), ("cleared",)]
    ev = wire_events(raw, 2, 1000)
    assert [type(e).__name__ for e in ev] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert ev[0].block_hashes == [1, 2] and ev[0].parent_block_hash is None
    assert ev[0].token_ids == token_ids(["a", "b", "c", "d"], 1000)
    assert ev[1].block_hashes == [7] and ev[1].parent_block_hash == 3
    assert ev[2].block_hashes == [4, 5]


# ---- one engine's block set -----------------------------------------------------------------------

def test_events_apply_in_order_and_keys_follow_the_token_ids():
    bs = BlockSet("e")
    bs.on_message(0, payload(stored([1, 2, 3], None)))
    bs.on_message(1, payload(BlockRemoved([3], "GPU"), stored([4], 2)))
    assert set(bs.blocks) == {1, 2, 4}
    assert bs.match([1, 2, 3]) == 2 and bs.match([1, 2, 4]) == 3 and bs.match([9]) == 0
    # the keys are chained over token ids: block 4's key follows 1 and 2
    keys = token_keys([1, 1, 2, 2, 4, 4], 2)
    assert bs.match_keys(keys) == 3
    assert bs.match_keys(token_keys([1, 1, 2, 2, 3, 3], 2)) == 2
    assert (bs.next_seq, bs.complete, bs.lost) == (2, True, 0)


def test_a_gap_is_filled_from_the_replay_before_the_live_batch():
    log = [payload(stored([1], None)), payload(stored([2], 1)), payload(BlockRemoved([1], "GPU")),
           payload(stored([3], 2))]
    asked: list[int] = []

    def replay(start: int) -> list[tuple[int, bytes]]:
        asked.append(start)
        return [(s, p) for s, p in enumerate(log) if s >= start]

    bs = BlockSet()
    bs.on_message(0, log[0], replay)
    bs.on_message(3, log[3], replay)          # 1 and 2 missed
    assert asked == [1]
    assert set(bs.blocks) == {2, 3}           # the removal of 1 (batch 2) was applied before 3
    assert (bs.next_seq, bs.lost, bs.complete) == (4, 0, True)


def test_a_gap_the_replay_no_longer_holds_is_counted_lost():
    bs = BlockSet()
    bs.on_message(0, payload(stored([1], None)), lambda s: [])
    bs.on_message(5, payload(stored([2], 1)), lambda s: [(4, payload(stored([9], None)))])
    assert bs.lost == 3 and not bs.complete        # 1, 2, 3 gone; 4 replayed; 5 live
    assert set(bs.blocks) == {1, 9, 2}
    assert bs.next_seq == 6


def test_restart_and_all_blocks_cleared_empty_the_set():
    bs = BlockSet()
    bs.on_message(0, payload(stored([1, 2], None)))
    bs.on_message(1, payload(stored([3], 2)))
    bs.on_message(0, payload(stored([7], None)))   # the publisher started again at 0
    assert set(bs.blocks) == {7} and bs.resets == 1 and bs.next_seq == 1
    bs.on_message(1, payload(AllBlocksCleared(), stored([8], None)))
    assert set(bs.blocks) == {8} and bs.resets == 2
    assert bs.match_keys(token_keys([8, 8], 2)) == 1 and bs.match_keys(token_keys([1, 1], 2)) == 0


def test_catch_up_rebuilds_the_set_and_live_duplicates_of_it_are_not_a_restart():
    p = [payload(stored([1], None)), payload(stored([2], 1)), payload(BlockRemoved([1], "GPU"))]
    bs = BlockSet()
    bs.on_message(0, p[0])
    bs.catch_up([(1, p[1]), (2, p[2])])           # the buffer no longer holds batch 0
    assert set(bs.blocks) == {2} and bs.lost == 1 and not bs.complete and bs.next_seq == 3
    bs.on_message(2, p[2])                          # queued live while the replay answered
    assert bs.resets == 0 and bs.next_seq == 3
    bs.on_message(1, payload(stored([5], None)))    # a different batch 1: the engine restarted
    assert bs.resets == 1 and set(bs.blocks) == {5}


def test_a_bad_payload_is_skipped_and_its_number_consumed():
    bs = BlockSet()
    bs.on_message(0, b"\xc1 not msgpack")
    bs.on_message(1, payload(stored([1], None)))
    assert set(bs.blocks) == {1} and bs.next_seq == 2 and bs.lost == 0


# ---- live sockets ---------------------------------------------------------------------------------

def _publisher(d: str) -> ZmqEventPublisher:
    return ZmqEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{d}/pub", f"ipc://{d}/replay", buffer_steps=100))


def test_late_subscriber_catches_up_from_the_replay_then_follows_live(ipc_dir):
    pub = _publisher(ipc_dir)
    sub = None
    try:
        for i in range(5):   # published before anyone listens: only the replay has them
            pub.publish([stored([100 + i], None if i == 0 else 99 + i)])
        sub = KVEventSubscriber(pub.last_endpoint, pub.replay_last_endpoint, name="e0")
        sub.start()
        # a PUB socket drops messages until the subscription has propagated: keep publishing
        # removals of an unknown hash until the subscriber has caught up
        n = 5

        def seen() -> bool:
            nonlocal n
            if not sub.caught_up():
                pub.publish([BlockRemoved([-1], "GPU")])
                n += 1
            return sub.caught_up()

        wait_until(seen, timeout=30, what="the subscriber's first batch")
        wait_until(lambda: sub.blocks.next_seq == n, timeout=30, what="catch-up")
        assert set(sub.blocks.blocks) == {100, 101, 102, 103, 104}
        assert sub.blocks.complete and sub.blocks.lost == 0
        pub.publish([BlockRemoved([100], "GPU"), stored([200], None)])
        wait_until(lambda: 200 in sub.blocks.blocks, timeout=30, what="a live batch")
        assert 100 not in sub.blocks.blocks
    finally:
        if sub is not None:
            sub.close()
        pub.close()


def test_subscriber_of_an_idle_engine_is_caught_up_by_an_empty_replay(ipc_dir):
    pub = _publisher(ipc_dir)
    sub = KVEventSubscriber(pub.last_endpoint, pub.replay_last_endpoint)
    try:
        sub.start()
        wait_until(sub.caught_up, timeout=30, what="the empty catch-up")
        assert len(sub.blocks) == 0 and sub.blocks.complete and sub.blocks.next_seq == 0
    finally:
        sub.close()
        pub.close()


def test_replay_socket_answers_a_gap_request(ipc_dir):
    pub = _publisher(ipc_dir)
    sub = KVEventSubscriber(pub.last_endpoint, pub.replay_last_endpoint)
    try:
        sub.start()
        for i in range(4):
            pub.publish([stored([i + 1], i or None)])
        got = sub.replay(2)
        assert [s for s, _ in got] == [2, 3]
        assert decode_batch(got[0][1])[1] == [Stored((3,), 2, (3, 3), 2)]
    finally:
        sub.close()
        pub.close()


def test_a_replay_that_puts_the_topic_before_the_sequence_is_read(ipc_dir):
    """vLLM 0.32's replay socket answers ``(b"", topic, seq, payload)`` and ends with ``(b"", b"",
    -1, b"")`` (found against the real CPU vLLM: the 3-frame reader never saw the end, so a picker
    on a real vLLM never caught up)."""
    import threading

    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{ipc_dir}/replay4")
    batches = [(s, payload(stored([s + 1], s or None))) for s in range(3)]

    def serve() -> None:
        ident, _, start = router.recv_multipart()
        for s, p in batches:
            if s >= int.from_bytes(start, "big"):
                router.send_multipart((ident, b"", b"", s.to_bytes(8, "big"), p))
        router.send_multipart((ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sub = KVEventSubscriber(f"ipc://{ipc_dir}/pub-none", f"ipc://{ipc_dir}/replay4")
    sub._ctx = zmq.Context()   # the sockets only: no subscriber thread
    try:
        assert sub.ask_replay(1) == batches[1:]
        t.join(timeout=10)
    finally:
        sub._ctx.term()
        router.close(linger=0)
        ctx.term()


def test_engine_process_publishes_the_prompt_blocks(ipc_dir, procs, run_dir):
    """A real engine with vLLM's flag: its stored blocks are the prompt's full blocks, found by the
    prompt tokenized the engine's way (token keys), not by the engine's own hashes."""
    from tests.sim_engine.simhelpers import start_engine

    cfg = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
           f'"endpoint": "ipc://{ipc_dir}/pub", "replay_endpoint": "ipc://{ipc_dir}/replay"}}')
    c = start_engine(procs, run_dir, "--time-scale", "50", "--kv-events-config", cfg)
    sub = KVEventSubscriber(f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/replay", name="engine")
    try:
        sub.start()
        words = [f"w{i}" for i in range(16 * 5 + 3)]   # 5 full blocks of 16
        r = c.post("/v1/completions", json={"prompt": " ".join(words), "max_tokens": 2})
        assert r.status_code == 200, r.text
        # published before the subscription may have propagated: the replay has it
        c.post("/v1/completions", json={"prompt": "x y", "max_tokens": 1})

        def caught_up() -> bool:
            if not sub.caught_up():
                c.post("/v1/completions", json={"prompt": "z", "max_tokens": 1})
            return len(sub.blocks) >= 5

        wait_until(caught_up, timeout=60, what="the engine's stored blocks")
        keys = token_keys(token_ids(words, 128_256), 16)
        assert len(keys) == 5
        assert sub.blocks.match_keys(keys) == 5
        assert sub.blocks.match_keys(token_keys(token_ids(["q"] + words, 128_256), 16)) == 0
        assert sub.blocks.lost == 0
    finally:
        sub.close()
        c.close()


def test_kv_events_config_is_vllms_flag_and_bad_values_are_named(capsys):
    from sim_engine.server import main

    cfg = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                                   '"replay_endpoint": "tcp://*:5558", "buffer_steps": 100, "topic": "kv", '
                                   '"max_queue_size": 5}')
    assert cfg.active and cfg.buffer_steps == 100 and cfg.topic == "kv" and cfg.replay_endpoint == "tcp://*:5558"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false, "publisher": "zmq"}').active
    for bad, msg in (("{", "not JSON"), ("[1]", "JSON object"), ('{"nope": 1}', "unknown field"),
                     ('{"enable_kv_cache_events": true, "publisher": "lmcache"}', "publisher")):
        with pytest.raises(ValueError, match=msg):
            KVEventsConfig.from_json(bad)
    assert main(["--kv-events-config", '{"nope": 1}']) == 2
    assert "--kv-events-config: unknown field(s) nope" in capsys.readouterr().err


def test_pending_placements_count_until_stored_or_expired():
    bs = BlockSet("e")
    pending = PendingBlocks(ttl_s=5.0)
    bs.watchers.append(pending)
    bs.on_message(0, payload(stored([1, 2], None)))
    pending.place([1, 2, 3, 4], now=10.0)   # a prompt of 4 blocks dispatched; 1 and 2 already cached
    assert bs.match([1, 2, 3, 4]) == 2
    assert pending.match(bs, [1, 2, 3, 4], now=11.0) == 4
    assert pending.match(bs, [1, 2, 3, 4], now=15.0) == 2   # the bound passed: never stored
    # the engine stores block 3 then evicts it: from its BlockStored on the events alone answer
    pending.place([1, 2, 3, 4], now=20.0)
    bs.on_message(1, payload(stored([3], 2)))
    assert 3 not in pending.until and 4 in pending.until
    bs.on_message(2, payload(BlockRemoved([3], "GPU")))
    assert pending.match(bs, [1, 2, 3, 4], now=21.0) == 2
    # by token keys (the picker's way)
    keys = token_keys([7, 7, 8, 8], 2)
    pending.place(keys, now=30.0)
    assert pending.match(bs, keys, now=31.0, by_key=True) == 2
    assert pending.match(bs, keys, now=36.0, by_key=True) == 0
    with pytest.raises(ValueError):
        PendingBlocks(0)
