"""Approximate prefix index: which worker was recently sent which prompt prefix.

The router has no tokenizer, so, like llm-d's approximate prefix-cache scorer and SGLang's
character radix tree, it works on text: the prompt is cut into chunks of ``chunk_chars``
characters (64 characters ≈ 16 tokens, one vLLM KV block) and each full chunk gets a rolling hash
chained on its predecessor (vLLM's block hash scheme: hash(parent, block)), so equal hashes mean
equal prefixes. The chain starts from the model's name, so the same text sent for two models (two
different KV caches) never matches across them: the index is per model. It maps hash → set of
worker ids, with one global LRU bound of ``max_entries`` hashes; memory is about ``max_entries`` ×
~250 bytes (a set per entry).

    match(hashes)  -> {worker_id: number of leading chunks it holds}
    insert(hashes, worker_id)
"""
from __future__ import annotations

from collections import OrderedDict

from pydantic import Field

from router.policies.registry import PolicyParams


class PrefixIndex:
    """Bounded LRU map from chained chunk hashes to the workers that were sent that prefix.

    ``chunk_chars``: characters per chunk (≥ 1); ``max_chunks``: only the first ``max_chunks``
    chunks of a prompt are hashed (bounds the cost per request); ``max_entries``: LRU bound.
    """

    def __init__(self, chunk_chars: int = 64, max_chunks: int = 8192, max_entries: int = 200_000) -> None:
        if chunk_chars < 1 or max_chunks < 1 or max_entries < 1:
            raise ValueError("chunk_chars, max_chunks and max_entries must be >= 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_entries = max_entries
        self._entries: OrderedDict[int, set[int]] = OrderedDict()
        self._sizes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self, text: str, model: str | None = None) -> list[int]:
        """Chained hashes of the full ``chunk_chars`` chunks of ``text`` (a partial tail is ignored),
        for requests naming ``model`` (None: requests that name none)."""
        c = self.chunk_chars
        n = min(len(text) // c, self.max_chunks)
        out = []
        h = 0 if model is None else hash(model)
        for i in range(n):
            h = hash((h, text[i * c:(i + 1) * c]))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> dict[int, int]:
        """Per worker, how many leading chunks of ``hashes`` it holds (workers with 0 omitted)."""
        result: dict[int, int] = {}
        cands: set[int] | None = None
        depth = 0
        entries = self._entries
        for depth, h in enumerate(hashes):
            ws = entries.get(h)
            if not ws:
                break
            entries.move_to_end(h)
            if cands is None:
                cands = set(ws)
            else:
                kept = cands & ws
                for w in cands - kept:
                    result[w] = depth
                cands = kept
            if not cands:
                break
        else:
            depth = len(hashes)
        for w in cands or ():
            result[w] = depth
        return result

    def insert(self, hashes: list[int], worker_id: int) -> None:
        """Record that ``worker_id`` now holds every prefix in ``hashes``; evicts LRU entries."""
        entries = self._entries
        sizes = self._sizes
        for h in hashes:
            ws = entries.get(h)
            if ws is None:
                entries[h] = {worker_id}
                sizes[worker_id] = sizes.get(worker_id, 0) + 1
            else:
                entries.move_to_end(h)
                if worker_id not in ws:
                    ws.add(worker_id)
                    sizes[worker_id] = sizes.get(worker_id, 0) + 1
        while len(entries) > self.max_entries:
            _, ws = entries.popitem(last=False)
            for w in ws:
                sizes[w] -= 1

    def size(self, worker_id: int) -> int:
        """How many prefix chunks ``worker_id`` holds (SGLang's "tenant size")."""
        return self._sizes.get(worker_id, 0)

    def remove_worker(self, worker_id: int) -> None:
        """Forget everything about ``worker_id`` (it left or restarted with an empty cache)."""
        if not self._sizes.pop(worker_id, 0):
            return
        dead = []
        for h, ws in self._entries.items():
            ws.discard(worker_id)
            if not ws:
                dead.append(h)
        for h in dead:
            del self._entries[h]


class PrefixParams(PolicyParams):
    """The approximate prefix index's size (``dplb``, ``weighted``, ``cache_aware``, ``lmetric``,
    ``kv_cost``): prompt text cut in chunks of ``prefix_chunk_chars`` characters (~16 tokens), the
    first ``prefix_max_chunks`` of a prompt hashed, ``prefix_index_max_entries`` hashes kept (LRU;
    200,000 is ~50 MB, 12.8M characters of prompt history). The horizon, 8,192 chunks = 524k
    characters (~105k tokens at 5 characters a token), covers a 128k-context model's prompts: past
    it a cached prefix is credited only up to the horizon and the rest priced as a recompute
    (2,048, the old default, credited a 54k-token document half its cache; docs/DESIGN.md
    "Pricing the cluster")."""

    prefix_chunk_chars: int = Field(default=64, ge=4)
    prefix_max_chunks: int = Field(default=8192, ge=1)
    prefix_index_max_entries: int = Field(default=200_000, ge=16)

    def prefix_index(self) -> PrefixIndex:
        """A fresh, empty index of this size."""
        return PrefixIndex(self.prefix_chunk_chars, self.prefix_max_chunks, self.prefix_index_max_entries)


def uncached_tokens(index: PrefixIndex, matches: dict[int, int], text: str, prompt_len: int, worker_id: int) -> int:
    """Prompt tokens worker ``worker_id`` is expected to compute: ``prompt_len`` minus the part its
    matched prefix covers (``matches[worker_id]`` chunks of ``index.chunk_chars`` characters out of
    ``len(text)``; tokens are assumed spread evenly over the characters)."""
    n = matches.get(worker_id, 0)
    if not n or not text:
        return prompt_len
    frac = min(1.0, n * index.chunk_chars / len(text))
    return max(0, round(prompt_len * (1.0 - frac)))


class PrefixIndexedPolicy:
    """Mixin for policies that keep a :class:`PrefixIndex` in ``self.index``: indexes each
    dispatched request's prefix under its worker and forgets workers that leave.

    ``choose`` stores ``(id(req), hashes)`` in ``self._pending_hashes`` so the hashes of the prompt
    are computed once per request, not again at dispatch (:meth:`matches` does both)."""

    index: PrefixIndex
    _pending_hashes: tuple[int, list[int]] | None

    def matches(self, req) -> dict[int, int]:
        """Hash ``req.text`` (kept for :meth:`on_dispatch`) and match it: ``{worker_id: chunks}``."""
        hashes = self.index.hashes(req.text, req.model)
        self._pending_hashes = (id(req), hashes)
        return self.index.match(hashes) if hashes else {}

    def on_dispatch(self, worker_id: int, req) -> None:
        """Index the request's prefix under ``worker_id`` (reuses the hashes computed in choose)."""
        ph = self._pending_hashes
        hashes = ph[1] if ph is not None and ph[0] == id(req) else self.index.hashes(req.text, req.model)
        self._pending_hashes = None
        if hashes:
            self.index.insert(hashes, worker_id)

    def forget(self, worker_id: int) -> None:
        """Drop every prefix indexed under ``worker_id`` (it left the pool)."""
        self.index.remove_worker(worker_id)
