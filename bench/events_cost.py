"""The picker's CPU per decision when it matches prompts against the engines' KV-cache events
(``dplb-epp --kv-events``, :mod:`epp.events`) beside its own text index, on long prompts.

    python -m bench.events_cost [--tokens 50000 | --prompt-bytes 220000] [--engines 4] [--repeats 20]

One chat request, parsed as the picker parses it (:func:`dplb_protocol.wire.parse_request`):
``--tokens`` words ``w<i mod 5000>x<i>`` (the simulated engine's tokenizer: one token per word),
or with ``--prompt-bytes`` the long prompt :mod:`bench.router_overhead` sends smg and DPLB
(:func:`bench.rawclient.long_prompt_requests`: words of 2-8 letters, a 200 KB shared document
and a user message of its own for 220 KB); ``--engines`` block sets, one of which holds the whole
prompt. Prints the median process CPU time (ms) of each step of a decision: tokenizing the
router's prompt text the engine's way (the Python definition, then the native tokenizer the
picker runs), chaining the block keys, both in one native pass, the whole match over every
engine (:meth:`epp.events.EventsFeed.match`), the policy's view through
:class:`epp.events.EventsIndex`, and the policy's own text index (hashes + match) for
comparison. With the ``tokenizers`` library installed (``pip install tokenizers``, not a DPLB
dependency) also what a real model's tokenizer would cost on the same text: Hugging Face's
tokenizers (Rust) with a byte-level BPE of ``--bpe-vocab`` merges trained on the prompt, and with
a whitespace word-level model (its cheapest pipeline). No sockets: the block sets are filled
directly.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import orjson

from dplb_prefix import reference as ref
from dplb_prefix import token_keys, word_block_keys
from dplb_protocol.wire import parse_request
from epp.events import EventsFeed, EventsIndex, WordTokenizer
from router.kv_events import BlockSet, KVEventSubscriber
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


def body_of(tokens: int, prompt_bytes: int) -> bytes:
    """The request's JSON body (module docstring)."""
    if prompt_bytes:
        from bench.rawclient import long_prompt_requests

        return long_prompt_requests(prompt_bytes, pool=1)[0].partition(b"\r\n\r\n")[2]
    words = [f"w{i % 5000}x{i}" for i in range(tokens)]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": " ".join(words)}]})


def hf_steps(text: str, vocab: int) -> list[tuple[str, Callable[[], object]]]:
    """Hugging Face ``tokenizers`` encodes of ``text`` (module docstring); none without the library."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        print("(tokenizers not installed: no real-model tokenizer measured)")
        return []
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    wl = Tokenizer(models.WordLevel({w: i for i, w in enumerate(dict.fromkeys(text.split()))}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    n_bpe = len(bpe.encode(text, add_special_tokens=False).ids)
    return [
        (f"HF tokenizers byte-level BPE ({bpe.get_vocab_size()} tokens; {n_bpe} tokens here)",
         lambda: bpe.encode(text, add_special_tokens=False).ids),
        (f"the same + block keys (native, {n_bpe // 16} blocks)",
         lambda: token_keys(bpe.encode(text, add_special_tokens=False).ids, 16)),
        ("HF tokenizers whitespace word-level", lambda: wl.encode(text, add_special_tokens=False).ids),
    ]


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, build the prompt and the block sets, print one line per step."""
    p = argparse.ArgumentParser(prog="python -m bench.events_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=50_000, help="prompt length in tokens (words)")
    p.add_argument("--prompt-bytes", type=int, default=0,
                   help="instead: bench.router_overhead's long prompt of about this many bytes")
    p.add_argument("--engines", type=int, default=4, help="engines' block sets to match against")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20, help="calls per step (the median is printed)")
    p.add_argument("--bpe-vocab", type=int, default=8192, help="merges of the trained BPE (with tokenizers)")
    a = p.parse_args(argv)
    text = parse_request(CHAT, body_of(a.tokens, a.prompt_bytes)).text
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
    hits, n = feed.match(CHAT, text)
    assert n == len(ids) and hits == {0: (n - 1) // a.block_size * a.block_size}, hits
    print(f"prompt: {len(ids)} tokens, {len(text) / 1024:.0f} KB of text; {a.engines} engines")
    steps: list[tuple[str, Callable[[], object]]] = [
        ("tokenize, the Python definition (dplb_prefix.reference.word_ids)",
         lambda: ref.word_ids(text, True, tok.vocab_size)),
        ("block keys, the Python definition (dplb_prefix.reference.token_keys)",
         lambda: ref.token_keys(ids, a.block_size)),
        ("tokenize, native (WordTokenizer: ids as a list)", lambda: tok(CHAT, text)),
        ("block keys, native, from the ids", lambda: token_keys(ids, a.block_size)),
        ("tokenize + block keys in one native pass (what the match runs)",
         lambda: word_block_keys(text, True, tok.vocab_size, a.block_size)),
        ("match every engine (tokenize + keys + lookups)", lambda: feed.match(CHAT, text)),
        ("the policy's view through EventsIndex (its text hashes + the match)", lambda: idx.match(idx.hashes(text))),
        ("the policy's own text index (hashes + match)", lambda: inner.match(inner.hashes(text))),
        *hf_steps(text, a.bpe_vocab),
    ]
    for name, f in steps:
        print(f"{name}: {cpu_ms(f, a.repeats):.3f} ms CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
