"""Approximate prefix index: which worker was recently sent which prompt prefix.

The router has no tokenizer, so, like llm-d's approximate prefix-cache scorer and SGLang's
character radix tree, it works on text: the prompt is cut into chunks of ``chunk_chars``
characters (code points; 64 characters ≈ 16 tokens, one vLLM KV block) and each full chunk gets a
64-bit hash chained on its predecessor (vLLM's block hash scheme: hash(parent, block)), so equal
hashes mean equal prefixes. The chain starts from the model's name, so the same text sent for two
models (two different KV caches) never matches across them: the index is per model. It maps hash →
workers, with one global LRU bound of ``max_entries`` hashes.

    hashes(text, model) -> array('Q') of chained chunk hashes (at most max_chunks)
    match(hashes)       -> {worker_id: number of leading chunks it holds}, ascending worker id
    insert(hashes, worker_id)

:class:`PrefixIndex` is native (:mod:`dplb_prefix`: csrc/dplb_prefix.pyx, the hash in
csrc/dplb_prefix.h): hashing reads the prompt string's own buffer (no slices) and the index lives in
C arrays, 48 to 96 bytes per entry; it needs the build (``make build``). Its bit-identical
pure-Python reference is :mod:`dplb_prefix.reference`.
"""
from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from dplb_prefix import PrefixIndex
from router.policies.registry import PolicyParams


class PrefixParams(PolicyParams):
    """The approximate prefix index's size (``dplb``, ``weighted``, ``cache_aware``, ``lmetric``,
    ``kv_cost``): prompt text cut in chunks of ``prefix_chunk_chars`` characters (~16 tokens), the
    first ``prefix_max_chunks`` of a prompt hashed, ``prefix_index_max_entries`` hashes kept (LRU;
    200,000 is at most ~16 MB native, 12.8M characters of prompt history). The horizon, 8,192 chunks = 524k
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
    _pending_hashes: tuple[int, Sequence[int]] | None

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
