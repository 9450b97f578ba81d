"""Workload for the simulator: trace loading (Mooncake JSONL, Azure CSV) and the request each
component of the live system would see for a trace line.

Inputs
------
* **Mooncake** JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids`` of
  512-token blocks; equal leading ids share those tokens): read by :func:`dplb_trace.mooncake.load_trace`,
  the loader ``dplb-replay`` uses.
* **Azure LLM inference trace** CSV (Azure/AzurePublicDataset, ``AzureLLMInferenceTrace_*.csv``):
  header ``TIMESTAMP,ContextTokens,GeneratedTokens``, TIMESTAMP a date-time such as
  ``2023-11-16 18:15:46.6805900`` (read as UTC, 100 ns resolution kept). No prefix information:
  every request gets block ids of its own, so nothing is shared.

A malformed line raises :class:`dplb_trace.errors.TraceFormatError` naming the file and the line.

What each component sees (the live path: ``dplb-replay`` → router → agent → ``dplb-sim-engine``)
---------------------------------------------------------------------------------------------
``dplb-replay`` sends ``prompt = dplb_trace.mooncake.prompt_for(req)`` (``input_length`` words; each block
id a fixed run of 512 words) as one user message of a streamed chat completion with
``max_tokens = output_length`` (``--api completions``: as ``prompt``). Then:

* the router (:func:`dplb_protocol.wire.parse_request`) reads text ``"user:" + prompt`` (chat; the
  prompt itself for completions) and ``prompt_len`` = its whitespace words = ``input_length``;
* the engine renders ``<|user|> w1 … wL <|eot|> <|assistant|>`` (chat: ``L + 3`` tokens; for
  completions the ``L`` words) and hashes its full 16-token blocks, chained.

:func:`router_text` builds the router's text exactly (the policies hash it themselves).
:func:`EngineHasher` gives the engine's chained block hashes without materialising the words: a
block's content is identified by the trace block ids it covers, its word offset and the template
tokens it contains, so two blocks get equal hashes exactly when their tokens are equal (which is
what the engine's prefix cache compares; the hash values themselves are per process anyway). The
per-trace-block segments of the chain are cached by prefix, so a conversation's shared turns are
hashed once. ``tests/simulate/test_workload.py`` checks both against the real code on the trace.
"""
from __future__ import annotations

import calendar
import csv
import random
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from dplb_trace.errors import TraceFormatError
from dplb_trace.mooncake import (
    BLOCK_TOKENS,
    VOCAB,
    TraceRequest,
    block_text,
    load_trace,
    prompt_for,
)
from sim_engine.kv_cache import ROOT_HASH

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
#: characters per word of dplb_trace.mooncake's vocabulary (every word has 4), or -1
WORD_CHARS = len(VOCAB[0]) if all(len(w) == len(VOCAB[0]) for w in VOCAB) else -1
#: block ids given to Azure requests (no prefix information): unique per request and position,
#: far above any Mooncake id
AZURE_BLOCK_BASE = 1 << 40
APIS = ("chat", "completions")


# ---- loading -------------------------------------------------------------------------------------

def detect_format(path: str | Path) -> str:
    """``"mooncake"`` or ``"azure"`` from the first non-blank line (``{`` or the CSV header)."""
    with open(path, "rb") as f:
        for line in f:
            s = line.strip()
            if not s:
                continue
            if s.startswith(b"{"):
                return "mooncake"
            if s.split(b",")[0].strip().lstrip(b"\xef\xbb\xbf").upper() == b"TIMESTAMP":
                return "azure"
            raise TraceFormatError(str(path), 1, "neither a Mooncake JSON line nor the Azure CSV header "
                                                 "TIMESTAMP,ContextTokens,GeneratedTokens")
    return "mooncake"


def parse_azure_timestamp(s: str) -> int:
    """Nanoseconds since the epoch (UTC) of ``YYYY-MM-DD HH:MM:SS[.fffffffff]`` (exact integer
    arithmetic: a float of seconds since 1970 keeps only ~0.2 µs); ValueError if malformed."""
    s = s.strip()
    date, _, clock = s.replace("T", " ").partition(" ")
    if not clock:
        raise ValueError(f"no time of day in {s!r}")
    hms, _, frac = clock.partition(".")
    y, mo, d = (int(x) for x in date.split("-"))
    h, mi, sec = (int(x) for x in hms.split(":"))
    if not (1 <= mo <= 12 and 1 <= d <= 31 and 0 <= h < 24 and 0 <= mi < 60 and 0 <= sec <= 60):
        raise ValueError(f"date or time out of range in {s!r}")
    if frac and not frac.isdigit():
        raise ValueError(f"bad fraction of a second in {s!r}")
    if len(frac) > 9:
        raise ValueError(f"more than 9 digits of a second in {s!r}")
    base = calendar.timegm((y, mo, d, h, mi, sec, 0, 0, 0))
    return base * 1_000_000_000 + (int(frac) * 10 ** (9 - len(frac)) if frac else 0)


def load_azure(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read an Azure LLM inference trace CSV; the first ``limit`` requests (all when None).

    Each row becomes a :class:`TraceRequest` with ``timestamp_ms`` relative to the first row,
    ``input_length = ContextTokens`` (>= 1), ``output_length = GeneratedTokens`` (>= 0; 0 is kept:
    the engine rejects ``max_tokens = 0`` as the live one does) and block ids of its own.
    Raises :class:`TraceFormatError` naming the line for a bad header, a missing or non-integer
    field, a negative length, an unparsable timestamp or timestamps that go backwards.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 (got {limit})")
    p = str(path)
    out: list[TraceRequest] = []
    t0: int | None = None
    last = -(1 << 80)
    with open(path, encoding="utf-8-sig", newline="") as f:
        rows = csv.reader(f)
        header = None
        for lineno, row in enumerate(rows, 1):
            if not row or all(not c.strip() for c in row):
                continue
            if header is None:
                header = tuple(c.strip() for c in row)
                if header[:3] != AZURE_HEADER:
                    raise TraceFormatError(p, lineno, f"expected the header {','.join(AZURE_HEADER)}, "
                                                      f"got {','.join(header)}")
                continue
            if limit is not None and len(out) >= limit:
                break
            if len(row) < 3:
                raise TraceFormatError(p, lineno, f"expected 3 fields, got {len(row)}")
            try:
                ts = parse_azure_timestamp(row[0])
            except ValueError as e:
                raise TraceFormatError(p, lineno, f"bad TIMESTAMP {row[0]!r} ({e})") from None
            try:
                ctx, gen = int(row[1]), int(row[2])
            except ValueError:
                raise TraceFormatError(p, lineno, f"ContextTokens and GeneratedTokens must be integers, "
                                                  f"got {row[1]!r}, {row[2]!r}") from None
            if ctx < 1 or gen < 0:
                raise TraceFormatError(p, lineno, "ContextTokens must be >= 1 and GeneratedTokens >= 0")
            if ts < last:
                raise TraceFormatError(p, lineno, "timestamp goes backwards")
            last = ts
            if t0 is None:
                t0 = ts
            i = len(out)
            n_blocks = -(-ctx // BLOCK_TOKENS)
            base = AZURE_BLOCK_BASE + (i << 12) if n_blocks < 4096 else AZURE_BLOCK_BASE + i * n_blocks
            out.append(TraceRequest(index=i, timestamp_ms=(ts - t0) / 1e6, input_length=ctx,
                                    output_length=gen, hash_ids=tuple(range(base, base + n_blocks))))
        if header is None:
            raise TraceFormatError(p, 1, "empty file: expected the header " + ",".join(AZURE_HEADER))
    return out


def load_workload(path: str | Path, fmt: str = "auto", start: int = 0,
                  requests: int | None = None, max_tokens_cap: int | None = None) -> list[TraceRequest]:
    """Requests ``start .. start + requests`` of the trace at ``path`` (``fmt``: auto, mooncake,
    azure), re-indexed from 0 with timestamps relative to the window's first request;
    ``max_tokens_cap`` caps output lengths as ``dplb-replay --max-tokens-cap`` does.
    Raises :class:`TraceFormatError` / ``FileNotFoundError`` / ``ValueError``."""
    if max_tokens_cap is not None and max_tokens_cap < 1:
        raise ValueError(f"--max-tokens-cap must be >= 1 (got {max_tokens_cap})")
    if start < 0:
        raise ValueError(f"--start must be >= 0 (got {start})")
    if requests is not None and requests < 1:
        raise ValueError(f"--requests must be >= 1 (got {requests})")
    if fmt == "auto":
        fmt = detect_format(path)
    limit = None if requests is None else start + requests
    if fmt == "mooncake":
        reqs = load_trace(path, limit=limit)
    elif fmt == "azure":
        reqs = load_azure(path, limit=limit)
    else:
        raise ValueError(f"unknown trace format {fmt!r}; one of auto, mooncake, azure")
    return window_of(reqs, start, requests, max_tokens_cap)


def window_of(reqs: Sequence[TraceRequest], start: int = 0, requests: int | None = None,
              max_tokens_cap: int | None = None) -> list[TraceRequest]:
    """Requests ``start .. start + requests`` of ``reqs``, re-indexed from 0 with timestamps
    relative to the window's first request, output lengths capped at ``max_tokens_cap``.
    Raises ValueError for an empty window."""
    window = list(reqs[start:None if requests is None else start + requests])
    if not window:
        raise ValueError(f"the window --start {start} holds no request (the trace has {len(reqs)})")
    t0 = window[0].timestamp_ms
    cap = max_tokens_cap
    return [TraceRequest(index=i, timestamp_ms=r.timestamp_ms - t0, input_length=r.input_length,
                         output_length=r.output_length if cap is None else min(r.output_length, cap),
                         hash_ids=r.hash_ids) for i, r in enumerate(window)]


def spread_arrivals(reqs: Sequence[TraceRequest], width_ms: float, seed: int = 0) -> list[TraceRequest]:
    """``reqs`` with each arrival moved later by an independent uniform draw in ``[0, width_ms)``
    (seeded), then sorted by the new time (ties: the old order) and re-indexed from 0.

    Why: the bundled conversation trace's timestamps lie on a 3-second grid (1,180 distinct
    instants for 12,031 requests, 6-28 requests at each), so ``--rate-scale`` stretches the gaps
    between groups but never the groups themselves: at any rate, about ten requests arrive at the
    same instant. Spreading each over its 3 s slot (``width_ms = 3000``) gives arrivals at the
    trace's rate and mix with no simultaneous groups; a per-request SLO at a low rate is then
    decided by the engines, not by the grid. Raises ValueError for ``width_ms < 0``."""
    if width_ms < 0:
        raise ValueError(f"spread width must be >= 0 ms (got {width_ms})")
    if width_ms == 0:
        return list(reqs)
    rng = random.Random(f"spread:{seed}")
    moved = [(r.timestamp_ms + rng.random() * width_ms, k) for k, r in enumerate(reqs)]
    moved.sort()
    t0 = moved[0][0]
    return [TraceRequest(index=i, timestamp_ms=round(t - t0, 3), input_length=reqs[k].input_length,
                         output_length=reqs[k].output_length, hash_ids=reqs[k].hash_ids)
            for i, (t, k) in enumerate(moved)]


# ---- what each component sees ----------------------------------------------------------------------

def _fast_block_text():
    """A 2-3× faster :func:`dplb_trace.mooncake.block_text`, or None when it cannot be used here.

    ``random.Random(b).choices(VOCAB, k=512)`` draws ``floor(random() · 4096)`` per word, and
    ``random()`` is ``((w1 >> 5) · 2^26 + (w2 >> 6)) / 2^53`` from two successive 32-bit Mersenne
    Twister outputs, so the index is exactly ``w1 >> 20``: the top 12 bits of every other output.
    ``getrandbits(32 · 1024)`` returns those outputs as little-endian 32-bit words, and every word
    of VOCAB has 4 characters, so numpy can assemble the text. Checked against the original on a
    few ids (any difference: None, the original is used); tests check many more.
    """
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with matplotlib (bench extra)
        return None
    if WORD_CHARS != 4 or len(VOCAB) != 4096 or BLOCK_TOKENS != 512:
        return None
    words = np.frombuffer("".join(VOCAB).encode("ascii"), dtype="<u4")
    out = np.empty(BLOCK_TOKENS, dtype=[("w", "<u4"), ("s", "u1")])
    out["s"] = 32
    rng = random.Random()

    def make(block_id: int) -> str:
        rng.seed(block_id)
        raw = np.frombuffer(rng.getrandbits(32 * 2 * BLOCK_TOKENS).to_bytes(8 * BLOCK_TOKENS, "little"), dtype="<u4")
        out["w"] = words[raw[0::2] >> 20]
        return out.tobytes()[:-1].decode("ascii")

    slow = getattr(block_text, "__wrapped__", block_text)
    if all(make(b) == slow(b) for b in (0, 1, 12345, (1 << 40) + 77)):
        return make
    return None  # pragma: no cover


class BlockTexts:
    """Process-wide cache of :func:`dplb_trace.mooncake.block_text` (one 512-word text per block id), larger
    than dplb_trace.mooncake's own LRU so that several runs in one process (policies, capacity search)
    generate each block once. At most ``max_blocks`` texts (about 2.6 kB each), oldest out."""

    def __init__(self, max_blocks: int = 131072) -> None:
        self.max_blocks = max_blocks
        self._texts: OrderedDict[int, str] = OrderedDict()
        self._make = _fast_block_text() or getattr(block_text, "__wrapped__", block_text)

    def get(self, block_id: int) -> str:
        t = self._texts.get(block_id)
        if t is None:
            t = self._texts[block_id] = self._make(block_id)
            if len(self._texts) > self.max_blocks:
                self._texts.popitem(last=False)
        return t

    def prompt(self, req: TraceRequest) -> str:
        """Exactly :func:`dplb_trace.mooncake.prompt_for` (the blocks' texts joined, cut to input_length words)."""
        full, rest = divmod(req.input_length, BLOCK_TOKENS)
        get = self.get
        parts = [get(b) for b in req.hash_ids[:full]]
        if rest:
            # every word is 4 characters (dplb_trace.mooncake.VOCAB): the first `rest` words are 5·rest − 1 chars
            t = get(req.hash_ids[full])
            parts.append(t[:5 * rest - 1] if WORD_CHARS == 4 else " ".join(t.split(" ", rest)[:rest]))
        return " ".join(parts)


TEXTS = BlockTexts()


def router_text(req: TraceRequest, api: str = "chat") -> str:
    """The prompt text the router's parser extracts from ``dplb-replay``'s request body."""
    prompt = TEXTS.prompt(req)
    return "user:" + prompt if api == "chat" else prompt


def router_prompt_len(req: TraceRequest, api: str = "chat") -> int:
    """The prompt length the router's one definition (:func:`dplb_protocol.wire.prompt_tokens`) gives
    ``dplb-replay``'s body: the words, plus for chat one message's framing and the generation
    prompt (``CHAT_TOKENS_PER_MESSAGE + CHAT_GENERATION_PROMPT_TOKENS``)."""
    from dplb_protocol.wire import (
        CHAT_GENERATION_PROMPT_TOKENS,
        CHAT_TOKENS_PER_MESSAGE,
    )

    extra = CHAT_TOKENS_PER_MESSAGE + CHAT_GENERATION_PROMPT_TOKENS if api == "chat" else 0
    return req.input_length + extra


def template(api: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Tokens the engine puts before and after the prompt's words for ``api``
    (:func:`sim_engine.tokenizer.render_chat` for chat)."""
    if api == "chat":
        return ("<|user|>",), ("<|eot|>", "<|assistant|>")
    if api == "completions":
        return (), ()
    raise ValueError(f"unknown api {api!r}; one of {', '.join(APIS)}")


def engine_tokens(req: TraceRequest, api: str = "chat") -> list[str]:
    """The engine's prompt tokens, materialised (tests and small cases; the simulator hashes
    without them, see :class:`EngineHasher`)."""
    head, tail = template(api)
    return [*head, *prompt_for(req).split(), *tail]


class RenderedPrompt(Sequence):
    """The engine's prompt tokens of ``req`` as a lazy sequence (``len`` and indexing/slicing),
    so a long prompt is never held as a word list. Words come from :func:`dplb_trace.mooncake.block_text`."""

    __slots__ = ("hash_ids", "head", "n", "tail", "words")

    def __init__(self, req: TraceRequest, api: str = "chat") -> None:
        self.head, self.tail = template(api)
        self.hash_ids = req.hash_ids
        self.words = req.input_length
        self.n = len(self.head) + self.words + len(self.tail)

    def __len__(self) -> int:
        return self.n

    def _token(self, p: int) -> str:
        h = len(self.head)
        if p < h:
            return self.head[p]
        w = p - h
        if w < self.words:
            return TEXTS.get(self.hash_ids[w // BLOCK_TOKENS]).split(" ")[w % BLOCK_TOKENS]
        return self.tail[w - self.words]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self._token(p) for p in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self._token(i)


class EngineHasher:
    """Chained hashes of the engine's full prompt blocks for trace requests (see the module
    docstring). ``block_size``: the engine's tokens per KV block; ``api``: the chat template or none.

    Block ``j`` covers rendered tokens ``[j·bs, (j+1)·bs)``, i.e. prompt words ``[a, a+bs)`` with
    ``a = j·bs − len(head)``; its content key is ``(ids of the 512-word trace blocks its words fall in,
    offset of its first word in the first of them, number of words, number of head tokens, number
    of tail tokens)`` and ``hash_j = hash((hash_{j−1}, *key_j))``, ``hash_{−1} = ROOT_HASH``; a block
    that lies inside one trace block and holds only words (the common case) has the shorter key
    ``(id, offset)`` (which case applies depends only on the block's content, so equal contents
    still get equal hashes). Segments are cached per prefix, at most ``max_segments`` (oldest out;
    about 1.3 kB each).
    """

    def __init__(self, block_size: int, api: str = "chat", max_segments: int = 65536) -> None:
        self.bs = block_size
        self.max_segments = max_segments
        head, tail = template(api)
        self.nh, self.nt = len(head), len(tail)
        # chained key of a prefix of trace block ids -> (hashes of the engine blocks that end in its
        # last trace block, the chain's last hash)
        self._segments: OrderedDict[int, tuple[list[int], int]] = OrderedDict()

    def _key(self, ids: Sequence[int], n_words: int, j: int) -> tuple:
        bs = self.bs
        a = j * bs - self.nh
        b = a + bs
        wa = max(0, a)
        wb = min(n_words, b)
        n_head = -a if a < 0 else 0
        n_tail = b - n_words if b > n_words else 0
        if wa >= wb:
            return ((), 0, 0, n_head, n_tail)
        k1, k2 = wa // BLOCK_TOKENS, (wb - 1) // BLOCK_TOKENS
        return (ids[k1] if k1 == k2 else tuple(ids[k1:k2 + 1]), wa % BLOCK_TOKENS, wb - wa, n_head, n_tail)

    def hashes(self, req: TraceRequest) -> list[int]:
        """The chained hashes of ``req``'s full engine blocks (a new list the caller may extend)."""
        bs, nh = self.bs, self.nh
        ids, n_words = req.hash_ids, req.input_length
        n_full = (nh + n_words + self.nt) // bs
        out: list[int] = []
        h = ROOT_HASH
        pk = ROOT_HASH
        segs = self._segments
        j = 0
        # trace blocks wholly inside the prompt: the blocks ending in them depend on the prefix only
        # (they end before the prompt's last word, so they hold no tail token)
        for m in range(n_words // BLOCK_TOKENS):
            pk = hash((pk, ids[m]))
            # engine blocks whose last word lies in trace block m: (j+1)·bs − nh <= 512·(m+1) <= n_words,
            # so they hold no tail token and their keys do not depend on the prompt's length
            j_end = (BLOCK_TOKENS * (m + 1) + nh) // bs
            seg = segs.get(pk)
            if seg is None:
                part = []
                lo = BLOCK_TOKENS * m
                hi = lo + BLOCK_TOKENS - bs
                idm = ids[m]
                for jj in range(j, j_end):
                    a = jj * bs - nh
                    if lo <= a <= hi:   # the common case: the block lies inside trace block m
                        h = hash((h, idm, a - lo))
                    else:
                        h = hash((h, *self._key(ids, n_words, jj)))
                    part.append(h)
                segs[pk] = (part, h)
                if len(segs) > self.max_segments:
                    segs.popitem(last=False)   # oldest first: conversations reuse recent prefixes
            else:
                part, h = seg
            out += part
            j = j_end
        for jj in range(j, n_full):
            a = jj * bs - nh
            if 0 <= a and a + bs <= n_words and a // BLOCK_TOKENS == (a + bs - 1) // BLOCK_TOKENS:
                lo = a - a % BLOCK_TOKENS
                h = hash((h, ids[lo // BLOCK_TOKENS], a - lo))
            else:
                h = hash((h, *self._key(ids, n_words, jj)))
            out.append(h)
        return out

    def clear(self) -> None:
        """Forget the cached segments (memory: about 300 bytes per distinct trace-block prefix)."""
        self._segments.clear()
