"""The simulated engine's KV-cache events under eviction: a cache too small for its prompts evicts
blocks (BlockRemoved), and a consumer that applies the events as the router does
(:class:`router.kv_events.BlockSet`, through vLLM's wire format) holds exactly the hashes the
engine's prefix cache holds after every request, and matches a prompt's token blocks as far as the
engine's own lookup hits. Requests go through KVCacheManager as the engine core drives it:
look up the cached prefix, reference it, allocate the rest, register the full blocks, free."""
from __future__ import annotations

import random

import msgspec

from dplb_prefix import leading_run
from router.kv_events import BlockSet, token_keys
from sim_engine.kv_cache import KVCacheManager, chain_hashes
from sim_engine.kv_events import EventBatch, wire_events
from sim_engine.tokenizer import token_ids

BS, VOCAB = 4, 1000


def _serve(kv: KVCacheManager, words: list[str]) -> None:
    """One request's prompt through the cache (prefix hit, allocation with eviction, caching, free)."""
    hashes = chain_hashes(words, BS)
    hit = kv.lookup(hashes, len(hashes))
    kv.touch(hit)
    need = kv.blocks_for(len(words)) - len(hit)
    new = kv.allocate(need)
    assert new is not None, "the cache holds at least one prompt"
    blocks = hit + new
    for i in range(len(hit), len(hashes)):
        kv.cache_block(blocks[i], hashes[i], hashes[i - 1] if i else None, words[i * BS:(i + 1) * BS])
    kv.free(blocks)


def test_the_events_reproduce_the_cache_through_evictions():
    rnd = random.Random(3)
    kv = KVCacheManager(num_blocks=40, block_size=BS)
    kv.events = []
    consumer = BlockSet("engine")
    enc = msgspec.msgpack.Encoder()
    docs = [[f"d{d}w{i}" for i in range(rnd.randrange(8, 60))] for d in range(6)]
    removed_seen = 0
    for seq in range(300):
        words = rnd.choice(docs) + [f"q{seq}w{i}" for i in range(rnd.randrange(0, 12))]
        _serve(kv, words)
        events = wire_events(kv.events, BS, VOCAB)
        kv.events.clear()
        removed_seen += sum(len(e.block_hashes) for e in events if type(e).__name__ == "BlockRemoved")
        consumer.on_message(seq, enc.encode(EventBatch(float(seq), events, 0)))
        assert set(consumer.blocks) == set(kv.cached), seq   # evicted blocks gone, stored ones there
        for doc in docs:   # the router's match by token blocks == the engine's own prefix hit
            engine_hit = len(kv.lookup(chain_hashes(doc, BS), len(doc)))
            keys = token_keys(token_ids(doc, VOCAB), BS)
            assert consumer.match_keys(keys) == leading_run(keys, consumer.keys) == engine_hit, seq
    assert kv.evictions > 100 and removed_seen == kv.evictions   # every eviction was published
    assert consumer.lost == 0 and consumer.resets == 0
