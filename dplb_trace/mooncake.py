"""Mooncake trace loading and deterministic prompt text that keeps prefix sharing.

Format (``dplb_trace/data/mooncake/README.md``, from the Mooncake FAST'25 release,
kvcache-ai/Mooncake ``FAST25-release/traces``): one JSON object per line with ``timestamp`` (ms
from the start of the trace), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``
(ids of the prompt's 512-token blocks; equal leading ids = shared prefix).

Prompt text: every block id becomes a fixed run of 512 words drawn by a PRNG seeded with the id
(same id → same text, in every process and run), the blocks are joined and the last one is cut
so the prompt has exactly ``input_length`` words. With whitespace-word tokenization (the
simulated engine's) the prompt is ``input_length`` tokens and two requests that share ``k``
leading block ids share exactly their first ``k × 512`` tokens. With a real BPE tokenizer the
token count differs but shared prefixes are still shared.

Usage::

    from dplb_trace.mooncake import load_trace, prompt_for
    reqs = load_trace("conversation_trace.jsonl", limit=1000)
    text = prompt_for(reqs[0])        # str with reqs[0].input_length words
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import orjson

from dplb_trace.errors import TraceFormatError

#: tokens per hash block in the Mooncake traces (README of the trace; Mooncake FAST'25 §3).
BLOCK_TOKENS = 512

#: the Mooncake conversation trace shipped with DPLB (``dplb_trace/data/mooncake/``, Apache-2.0; its README
#: gives the source and the fields). Installed as package data, so it is there in a wheel as well.
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake" / "conversation_trace.jsonl"


def _make_vocab() -> tuple[str, ...]:
    """4,096 distinct lowercase pseudo-words (consonant-vowel syllable pairs), fixed forever."""
    cons = "bcdfghjklmnprstv"  # 16
    vows = "aeiou"
    sylls = [c + v for c in cons for v in vows]  # 80
    words = [a + b for a in sylls for b in sylls]  # 6,400
    return tuple(words[:4096])


VOCAB = _make_vocab()


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One trace line.

    ``index``: 0-based line number among the loaded requests; ``timestamp_ms``: arrival time in
    ms from the trace start; ``input_length``/``output_length``: tokens; ``hash_ids``: 512-token
    block ids of the prompt, in order.
    """

    index: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path = DEFAULT_TRACE, limit: int | None = None, start: int = 0) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace; ``limit`` requests (all when None) from the ``start``-th on.

    ``index`` counts from the start of the file, so a window keeps the trace's own numbering.

    Blank lines are skipped. Raises :class:`dplb_trace.errors.TraceFormatError` (naming the file and
    line) for invalid JSON, a missing or mistyped field, a negative length, or timestamps that go
    backwards; ``FileNotFoundError`` when ``path`` does not exist.
    """
    if (limit is not None and limit < 0) or start < 0:
        raise ValueError(f"limit and start must be >= 0 (got {limit}, {start})")
    out: list[TraceRequest] = []
    last_ts = 0.0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= start + limit:
                break
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise TraceFormatError(str(path), lineno, f"invalid JSON ({e})") from None
            out.append(_parse(obj, str(path), lineno, len(out)))
            if out[-1].timestamp_ms < last_ts:
                raise TraceFormatError(str(path), lineno, "timestamp goes backwards")
            last_ts = out[-1].timestamp_ms
    return out[start:]


def _parse(obj: object, path: str, lineno: int, index: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(path, lineno, "a line must be a JSON object")
    for key, kind in (("timestamp", (int, float)), ("input_length", int), ("output_length", int), ("hash_ids", list)):
        if key not in obj:
            raise TraceFormatError(path, lineno, f"missing field {key!r}")
        v = obj[key]
        if not isinstance(v, kind) or isinstance(v, bool):
            raise TraceFormatError(path, lineno, f"field {key!r} has the wrong type ({type(v).__name__})")
    hash_ids = obj["hash_ids"]
    if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids):
        raise TraceFormatError(path, lineno, "hash_ids must be non-negative integers")
    if obj["input_length"] < 1 or obj["output_length"] < 1 or obj["timestamp"] < 0:
        raise TraceFormatError(path, lineno, "timestamp must be >= 0 and lengths >= 1")
    if obj["input_length"] > len(hash_ids) * BLOCK_TOKENS:
        raise TraceFormatError(path, lineno, f"input_length {obj['input_length']} exceeds "
                                             f"{len(hash_ids)} blocks of {BLOCK_TOKENS} tokens")
    return TraceRequest(index=index, timestamp_ms=float(obj["timestamp"]), input_length=obj["input_length"],
                        output_length=obj["output_length"], hash_ids=tuple(hash_ids))


@lru_cache(maxsize=32768)
def block_text(block_id: int) -> str:
    """The fixed text of block ``block_id``: 512 space-separated words, same for the same id.

    Words come from :data:`VOCAB` via ``random.Random(block_id)`` (Mersenne Twister seeded by an
    int is stable across processes and Python versions). Cached (32,768 blocks ≈ 90 MB max).
    """
    return " ".join(random.Random(block_id).choices(VOCAB, k=BLOCK_TOKENS))


def prompt_for(req: TraceRequest) -> str:
    """The prompt text of ``req``: its blocks' texts joined, cut to ``input_length`` words."""
    full, rest = divmod(req.input_length, BLOCK_TOKENS)
    parts = [block_text(b) for b in req.hash_ids[:full]]
    if rest:
        parts.append(" ".join(block_text(req.hash_ids[full]).split(" ", rest)[:rest]))
    return " ".join(parts)


def shared_prefix_blocks(a: TraceRequest, b: TraceRequest) -> int:
    """Number of leading block ids ``a`` and ``b`` have in common (their shared prefix, in blocks)."""
    n = 0
    for x, y in zip(a.hash_ids, b.hash_ids):
        if x != y:
            break
        n += 1
    return n


def sessions(reqs: list[TraceRequest], min_blocks: int = 2) -> list[int]:
    """Conversation id of each request of ``reqs`` (same order), derived from shared block prefixes.

    A request continues the conversation of the latest earlier request with which it shares the
    longest prefix of at least ``min_blocks`` block ids (a chat turn resends the whole history, so
    its blocks start with the previous turn's full blocks; the last, partial block of the previous
    prompt changes when the answer is appended, hence "longest shared prefix", not "previous prompt
    is a prefix"). Requests with no such predecessor start a new conversation. The default of two
    blocks skips the conversation trace's first block, which every request carries (a shared
    system prompt, not a conversation). Ids are 0, 1, 2, ... in order of first appearance.
    """
    latest: dict[tuple[int, ...], int] = {}
    out: list[int] = []
    nxt = 0
    for i, r in enumerate(reqs):
        h = r.hash_ids
        sid = None
        for k in range(len(h), min_blocks - 1, -1):
            j = latest.get(h[:k])
            if j is not None:
                sid = out[j]
                break
        if sid is None:
            sid, nxt = nxt, nxt + 1
        for k in range(min_blocks, len(h) + 1):
            latest[h[:k]] = i
        out.append(sid)
    return out
