"""The router's events index (router/events_index.py) on a long prompt's hot path: a placement
leaves out the blocks the engine's events already show stored (an eviction of one is seen at
once, not masked as a pending placement), and a policy that reads nothing of its own prefix index
but the match (``dplb``) no longer hashes and fills it while events are subscribed, with the same
matches; ``cache_aware`` (which reads the index's sizes) keeps it. ZMQ over ipc:// sockets in a
temporary directory; every socket and thread is closed at the end."""
from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator

import orjson
import pytest

from dplb_protocol.wire import parse_request
from router.events_index import EventsFeed, EventsIndex, WordTokenizer, install
from router.kv_events import token_keys
from router.policies.prefix_index import PrefixIndex
from sim_engine.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    ZmqEventPublisher,
)
from sim_engine.tokenizer import render_chat, token_ids
from tests.helpers import wait_until

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"
BS, VOCAB = 4, 1000
MSGS = [{"role": "system", "content": " ".join(f"d{i}" for i in range(200))},
        {"role": "user", "content": "a question"}]


@pytest.fixture
def engine() -> Iterator[tuple[ZmqEventPublisher, EventsFeed, list[float]]]:
    """An engine's publisher and a feed (pending placements 30 s, a clock the test moves)
    subscribed to it as worker 2, caught up."""
    d = tempfile.mkdtemp(prefix="dplb-rt-evidx-", dir="/tmp")
    pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{d}/pub", f"ipc://{d}/replay", buffer_steps=100))
    now = [100.0]
    feed = EventsFeed(BS, WordTokenizer(VOCAB), pending_s=30.0, clock=lambda: now[0])
    try:
        feed.sync({2: (pub.last_endpoint, pub.replay_last_endpoint)})
        wait_until(feed.caught_up, timeout=60, what="the subscriber's catch-up")
        yield pub, feed, now
    finally:
        feed.close()
        pub.close()
        shutil.rmtree(d, ignore_errors=True)


def _text() -> str:
    return parse_request(CHAT, orjson.dumps({"model": "m", "messages": MSGS})).text


def _store_prompt(pub: ZmqEventPublisher) -> int:
    """The engine stores the prompt's blocks (hashes 100, 101, ...); returns how many."""
    ids = token_ids(render_chat(MSGS), VOCAB)
    n = (len(ids) - 1) // BS
    pub.publish([BlockStored(list(range(100, 100 + n)), None, ids[:n * BS], BS, None, "GPU", None)])
    return n


def test_a_placement_leaves_out_what_the_engine_holds_so_its_eviction_shows_at_once(engine):
    pub, feed, _ = engine
    index = EventsIndex(PrefixIndex(), feed)
    text = _text()
    n = _store_prompt(pub)
    wait_until(lambda: feed.match(CHAT, text)[0] == {2: n * BS}, timeout=30, what="the stored prompt")
    hashes = index.hashes(text)
    assert index.match(hashes) != {}
    index.insert(hashes, 2)   # the router sends the prompt to worker 2, which holds all of it
    assert not feed.pending[2].until   # nothing pending: every block is the engine's already
    # the engine evicts the first block: the prompt is no longer a hit there, well before the
    # placement's 30 s (the clock does not move)
    pub.publish([BlockRemoved([100], "GPU")])
    wait_until(lambda: feed.match(CHAT, text)[0] == {}, timeout=30, what="the eviction seen")
    # a prompt the engine holds in part: only the blocks past what it holds become pending
    index.insert(index.hashes(text), 2)
    assert len(feed.pending[2].until) == n
    assert feed.match(CHAT, text)[0] == {2: n * BS}


def test_a_policy_that_reads_only_the_match_keeps_no_own_index_while_events_come(engine):
    pub, feed, _ = engine
    text = _text()
    n = _store_prompt(pub)
    wait_until(lambda: feed.match(CHAT, text)[0] == {2: n * BS}, timeout=30, what="the stored prompt")

    class Dplb:   # like router.policies.dplb: matches only
        def __init__(self) -> None:
            self.index = PrefixIndex()

    class CacheAware(Dplb):   # reads the index's sizes
        uses_index_sizes = True

    lean, full = Dplb(), CacheAware()
    assert install(lean, feed, own_index=None) and install(full, feed, own_index=None)
    assert isinstance(lean.index, EventsIndex) and not lean.index.own_index and full.index.own_index
    got = []
    for pol in (lean, full):
        idx = pol.index
        got.append(idx.match(idx.hashes(text)))
        idx.insert(idx.hashes(text), 2)
    assert got[0] == got[1] and set(got[0]) == {2}   # the same answer, from the events
    assert len(lean.index.inner) == 0 and lean.index.inner.size(2) == 0   # neither hashed nor filled
    assert len(full.index.inner) > 0 and full.index.inner.size(2) > 0
    # no engine's events any more: the own index answers (and is filled) again
    feed.close()
    lean.index.insert(lean.index.hashes(text), 3)
    assert lean.index.match(lean.index.hashes(text)) == {3: len(lean.index.inner.hashes(text))}


def test_the_leading_run_by_bisection_equals_the_walk_under_any_store_and_eviction():
    """BlockSet.held_run bisects while no key present lacks its parent key, and walks otherwise:
    random stores (chains branching from shared prefixes) and evictions (any block, leaves or
    not, and clears), checked after every step against the walk and a recount of the orphans."""
    import random

    from dplb_prefix import leading_run
    from router.kv_events import ROOT_KEY, BlockSet

    rnd = random.Random(7)
    bs = 2
    docs = [[rnd.randrange(50) for _ in range(bs * 12)] for _ in range(4)]
    blocks = BlockSet("e")
    stored: list[int] = []
    next_hash = [1000]
    bisected = walked = 0

    def chain(doc: list[int], cut: int, tail: int) -> list[int]:
        ids = doc[:cut * bs] + [rnd.randrange(50) for _ in range(tail * bs)]
        return ids

    for step in range(600):
        op = rnd.random()
        if op < 0.45:   # the engine stores a prompt's blocks from its first one (some already held)
            ids = chain(rnd.choice(docs), rnd.randrange(1, 13), rnd.randrange(0, 3))
            n = len(ids) // bs
            hashes = list(range(next_hash[0], next_hash[0] + n))
            next_hash[0] += n
            blocks.store(hashes, None, ids, bs)
            stored += hashes
        elif op < 0.9 and stored:   # it evicts one block, a leaf or not
            h = stored.pop(rnd.randrange(len(stored)))
            blocks.remove([h])
        elif op < 0.92:
            blocks.clear()
            stored.clear()
        parent = blocks._parent
        assert set(parent) == set(blocks.keys)
        assert blocks.orphans == sum(1 for k in blocks.keys if parent[k] != ROOT_KEY and parent[k] not in blocks.keys)
        for doc in docs:
            keys = token_keys(doc, bs)
            assert blocks.held_run(keys) == leading_run(keys, blocks.keys), step
            bisected += not blocks.orphans
            walked += bool(blocks.orphans)
    assert bisected > 100 and walked > 100   # both ways taken, many times


def test_the_typed_decode_agrees_with_the_generic_one():
    """decode_batch takes today's vLLM batches through one typed msgspec pass; whatever it does not
    take (another event kind, the older array form) goes the generic way, with the same answers."""
    import msgspec

    from router import kv_events as K

    enc = msgspec.msgpack.encode
    stored = {"type": "BlockStored", "block_hashes": [b"h1", 2], "parent_block_hash": 7, "token_ids": [1, 2, 3, 4],
              "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    removed = {"type": "BlockRemoved", "block_hashes": [2], "medium": None}
    batch = enc({"ts": 3, "events": [stored, removed, {"type": "AllBlocksCleared"}], "data_parallel_rank": 1})
    want = (3.0, [K.Stored((b"h1", 2), 7, (1, 2, 3, 4), 2), K.Removed((2,)), K.Cleared()], 1)
    assert K._typed(batch) == want and K.decode_batch(batch) == want
    # another kind: the typed pass declines, the generic path keeps the known events
    other = enc({"ts": 1.0, "events": [stored, {"type": "BlockUpdated", "x": 1}]})
    assert K._typed(other) is None
    assert K.decode_batch(other) == (1.0, [want[1][0]], None)
    # a wrong count of token ids is refused either way
    bad = dict(stored, token_ids=[1, 2, 3])
    for payload in (enc({"ts": 1.0, "events": [bad]}), enc({"ts": 1.0, "events": [bad, {"type": "Other"}]})):
        with pytest.raises(K.EventFormatError):
            K.decode_batch(payload)


def test_a_prompt_resumed_after_its_kept_leading_messages_has_the_keys_of_one_pass():
    # a shared document, then sessions whose histories grow turn by turn (with newlines in the
    # messages, a non-ASCII one and messages that look like roles): every prompt's keys equal the
    # engine's (token_keys of the simulated engine's ids), whether it resumed or not
    import random

    rnd = random.Random(3)
    vocab = [f"w{i}" for i in range(300)] + ["ü", "user:", "\u4e2d"]

    def words(n: int) -> str:
        return " ".join(rnd.choice(vocab) + ("\n" if rnd.random() < 0.02 else "") for _ in range(n))

    docs = [words(1500) for _ in range(3)]
    tok = WordTokenizer(VOCAB)
    tok.RESUME_MIN_CHARS = 2000   # the document alone is kept; a history grows past it
    plain = WordTokenizer(VOCAB, resume=False)
    for session in range(6):
        msgs = [{"role": "system", "content": docs[session % 3]}]
        for turn in range(5):
            msgs.append({"role": "user", "content": words(rnd.randint(5, 400))})
            text = parse_request(CHAT, orjson.dumps({"model": "m", "messages": msgs})).text
            for bs in (BS, 16):
                ids = token_ids(render_chat(msgs), VOCAB)
                want = token_keys(ids[:len(ids) - 1], bs)
                assert tok.block_keys(CHAT, text, bs) == (len(ids), want)
                assert plain.block_keys(CHAT, text, bs) == (len(ids), want)
            msgs.append({"role": "assistant", "content": words(rnd.randint(5, 300))})
    assert tok.resumed >= 40   # most prompts resumed (the first of each document and size did not)
    assert plain.resumed == 0


def test_the_kept_prefixes_stay_within_their_bounds():
    tok = WordTokenizer(VOCAB)
    tok.RESUME_MIN_CHARS, tok.RESUME_ENTRIES, tok.RESUME_CHARS = 100, 3, 10_000
    for i in range(20):
        text = f"system:{' '.join(f'd{i}x{j}' for j in range(60))}\nuser: q"
        tok.block_keys(CHAT, text, BS)
        assert len(tok._kept) <= 3 and tok._kept_chars == sum(len(p) for _, p in tok._kept)
    tok.RESUME_CHARS = 500   # one entry is ~600 characters: none stays
    tok.block_keys(CHAT, "system:" + "y " * 400 + "\nuser: q", BS)
    assert not tok._kept and tok._kept_chars == 0
