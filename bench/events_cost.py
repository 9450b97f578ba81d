"""The picker's CPU per decision when it matches prompts against the engines' KV-cache events
(``dplb-epp --kv-events``, :mod:`epp.events`) beside its own text index, on long prompts.

    python -m bench.events_cost [--tokens 50000] [--engines 4] [--repeats 20]

One chat request of ``--tokens`` words (the simulated engine's tokenizer: one token per word),
parsed as the picker parses it (:func:`dplb_protocol.wire.parse_request`); ``--engines`` block
sets, one of which holds the whole prompt. Prints the median process CPU time (ms) of each step
of a decision: tokenizing the router's prompt text the engine's way, chaining the block keys,
the whole match over every engine (:meth:`epp.events.EventsFeed.match`), the policy's view
through :class:`epp.events.EventsIndex`, and the policy's own text index (hashes + match) for
comparison. No sockets: the block sets are filled directly.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import orjson

from dplb_protocol.wire import parse_request
from epp.events import EventsFeed, EventsIndex, WordTokenizer
from router.kv_events import BlockSet, KVEventSubscriber, token_keys
from router.policies.prefix_index import PrefixIndex

CHAT = "/v1/chat/completions"


def cpu_ms(f: Callable[[], object], repeats: int) -> float:
    """Median process CPU time of ``f()`` over ``repeats`` calls, ms."""
    xs = []
    for _ in range(repeats):
        t0 = time.process_time()
        f()
        xs.append(time.process_time() - t0)
    return statistics.median(xs) * 1000.0


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, build the prompt and the block sets, print one line per step."""
    p = argparse.ArgumentParser(prog="python -m bench.events_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=50_000, help="prompt length in tokens (words)")
    p.add_argument("--engines", type=int, default=4, help="engines' block sets to match against")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20, help="calls per step (the median is printed)")
    a = p.parse_args(argv)
    words = [f"w{i % 5000}x{i}" for i in range(a.tokens)]
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": " ".join(words)}]})
    text = parse_request(CHAT, body).text
    tok = WordTokenizer()
    ids = tok(CHAT, text)
    feed = EventsFeed(a.block_size, tok)
    for k in range(a.engines):
        sub = KVEventSubscriber(f"inproc://engine-{k}")   # never started: its block set only
        if k == 0:
            bs: BlockSet = sub.blocks
            for key in token_keys(ids[:len(ids) - 1], a.block_size):
                bs.keys[key] = 1
        feed.subs[k] = sub
    idx = EventsIndex(PrefixIndex(), feed)
    inner = idx.inner
    print(f"prompt: {len(ids)} tokens, {len(text) / 1024:.0f} KB of text; {a.engines} engines")
    steps: list[tuple[str, Callable[[], object]]] = [
        ("tokenize (the engine's word tokenizer)", lambda: tok(CHAT, text)),
        ("block keys", lambda: token_keys(ids, a.block_size)),
        ("match every engine (tokenize + keys + lookups)", lambda: feed.match(CHAT, text)),
        ("the policy's view through EventsIndex", lambda: idx.match(idx.hashes(text))),
        ("the policy's own text index (hashes + match)", lambda: inner.match(inner.hashes(text))),
    ]
    for name, f in steps:
        print(f"{name}: {cpu_ms(f, a.repeats):.2f} ms CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
