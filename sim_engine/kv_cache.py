"""Paged KV cache with automatic prefix caching, after vLLM V1's ``KVCacheManager``/``BlockPool``.

A fixed budget of ``num_blocks`` blocks of ``block_size`` tokens. Every block is in exactly one of
three states::

    free      ref_cnt == 0, no hash       in the free queue (used first)
    cached    ref_cnt == 0, has a hash    in the free queue, evictable, reusable on a prefix hit
    used      ref_cnt >= 1                held by one or more running requests (hash or not)

    free queue (OrderedDict, left = next to allocate)
    ┌────────────┬──────────────────────────────────────────┐
    │ free …     │ cached, least recently freed → most      │
    └────────────┴──────────────────────────────────────────┘

* A full block's hash chains the previous block's hash with the block's tokens
  (``hash((parent, tokens))``), so equal hashes mean equal *prefixes*, not just equal blocks
  (vLLM: ``hash_block_tokens``). Python's built-in hash is used (vLLM's default ``builtin``
  prefix-caching hash); it is per process, which is fine since the cache is.
* ``allocate`` takes blocks from the left; taking a cached block evicts its hash (LRU eviction of
  unreferenced blocks).
* ``free`` walks a request's blocks from last to first, so its tail (least likely to be shared) is
  evicted before its head (vLLM does the same). One deviation from vLLM: blocks without a hash go to
  the *left* of the queue, so plain free blocks are used before any cached block is evicted.

KV-cache events (vLLM's ``--kv-events-config``, off by default): with :attr:`KVCacheManager.events`
set to a list, every change of the prefix cache is appended to it as it happens, in order::

    ("stored", hash, parent hash, tokens)   a block's hash entered the cache (cache_block)
    ("removed", block hash)     a hash left it (evicted by allocate, withdrawn by uncache_block)
    ("cleared",)                every unreferenced hash left it (reset_prefix_cache)

:mod:`sim_engine.kv_events` turns them into vLLM's wire format (it also needs the request's
tokens, which the engine attaches to stored hashes).

Invariants (checked by :meth:`check`): ``0 <= used <= num_blocks``; ``free + used == num_blocks``;
every hash in the map names a block carrying that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Literal

#: one raw KV-cache event of :attr:`KVCacheManager.events`: ``("stored", hash, parent hash or None,
#: the block's tokens or None)``, ``("removed", hash)`` or ``("cleared",)``
RawEvent = (tuple[Literal["stored"], int, int | None, Sequence[str] | None] | tuple[Literal["removed"], int]
            | tuple[Literal["cleared"]])

ROOT_HASH = 0x5EED  # parent hash of a sequence's first block


def chain_hashes(
    tokens: Sequence[str],
    block_size: int,
    start: int = 0,
    parent: int = ROOT_HASH,
    out: list[int] | None = None,
) -> list[int]:
    """Append the chained hashes of the full blocks of ``tokens`` from block index ``start``.

    ``parent`` is the hash of block ``start - 1`` (``ROOT_HASH`` for the first block). Returns ``out``
    (a new list when None). Cost: one tuple hash per block, O(len(tokens)).
    """
    out = [] if out is None else out
    n_full = len(tokens) // block_size
    h = parent
    for i in range(start, n_full):
        h = hash((h, *tokens[i * block_size : (i + 1) * block_size]))
        out.append(h)
    return out


class KVCacheManager:
    """Block accounting and prefix cache. Pure: no I/O, no clock.

    ``num_blocks``: total budget (>= 1); ``block_size``: tokens per block (>= 1).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.evictions = 0
        #: KV-cache events since the consumer last took them (see the module docstring); None: off
        self.events: list[RawEvent] | None = None
        #: whether stored events carry the block's tokens (the wire format needs them; the
        #: simulator, which matches by the engine's hashes, does not)
        self.event_tokens = True

    # ---- views -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks not held by any request (free + cached-unreferenced)."""
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a prefix hash (referenced or not)."""
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's ``vllm:kv_cache_usage_perc``: 1 - free/total)."""
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    # ---- prefix cache ------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Longest run of leading ``hashes`` present in the cache, at most ``max_blocks`` blocks.

        Returns the block ids (not yet referenced: call :meth:`touch`)."""
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        cached = self.cached
        for h in hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            hit.append(b)
        return hit

    def count_unreferenced(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them shrinks the free pool)."""
        rc = self.ref_cnt
        return sum(1 for b in blocks if rc[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on prefix-hit ``blocks`` (removing unreferenced ones from the free queue)."""
        rc, fq = self.ref_cnt, self.free_queue
        for b in blocks:
            if rc[b] == 0:
                del fq[b]
            rc[b] += 1

    def cache_block(self, block: int, h: int, parent: int | None = None,
                    tokens: Sequence[str] | None = None) -> bool:
        """Register full ``block`` under hash ``h`` (no-op when caching is off or ``h`` is known).
        Returns True when ``h`` entered the cache. ``parent`` (the previous block's hash, None for
        a first block) and ``tokens`` (the block's tokens) only go into the stored event."""
        if self.enable_prefix_caching and h not in self.cached and self.block_hash[block] is None:
            self.cached[h] = block
            self.block_hash[block] = h
            if self.events is not None:
                self.events.append(("stored", h, parent, tokens))
            return True
        return False

    def uncache_block(self, block: int) -> None:
        """Withdraw ``block``'s hash from the prefix cache (its KV was never computed)."""
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.events is not None:
                    self.events.append(("removed", h))
            self.block_hash[block] = None
            if self.ref_cnt[block] == 0:  # pragma: no cover - callers withdraw before freeing
                self.free_queue.move_to_end(block, last=False)

    # ---- allocation --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks (ref_cnt 1 each) from the left of the free queue, evicting their hashes.

        Returns None, changing nothing, when fewer than ``n`` blocks are free."""
        if n > len(self.free_queue):
            return None
        fq, rc, bh, cached = self.free_queue, self.ref_cnt, self.block_hash, self.cached
        out = []
        for _ in range(n):
            b, _ = fq.popitem(last=False)
            h = bh[b]
            if h is not None:
                del cached[h]
                bh[b] = None
                self.evictions += 1
                if self.events is not None:
                    self.events.append(("removed", h))
            rc[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each of ``blocks``; blocks reaching 0 return to the free queue."""
        rc, fq, bh = self.ref_cnt, self.free_queue, self.block_hash
        for b in reversed(blocks):
            rc[b] -= 1
            if rc[b] == 0:
                fq[b] = None
                if bh[b] is None:
                    fq.move_to_end(b, last=False)
            elif rc[b] < 0:  # pragma: no cover - a bug, caught by the property test
                raise AssertionError(f"block {b} freed twice")

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block (vLLM's /reset_prefix_cache). Returns the count."""
        n = 0
        removed: list[int] = []
        for h, b in list(self.cached.items()):
            if self.ref_cnt[b] == 0:
                removed.append(h)
                del self.cached[h]
                self.block_hash[b] = None
                self.free_queue.move_to_end(b, last=False)
                n += 1
        if self.events is not None:
            if self.cached:   # referenced blocks stay cached: say which hashes left, not "all"
                self.events.extend(("removed", h) for h in removed)
            else:
                self.events.append(("cleared",))
        return n

    def check(self, held: Iterable[Sequence[int]] = ()) -> None:
        """Assert the invariants; ``held`` = every running request's block list (for ref counts)."""
        expect = [0] * self.num_blocks
        for blocks in held:
            for b in blocks:
                expect[b] += 1
        assert expect == self.ref_cnt, "reference counts disagree with the requests' block lists"
        assert 0 <= self.num_used <= self.num_blocks
        assert all(self.ref_cnt[b] == 0 for b in self.free_queue)
        assert sum(1 for r in self.ref_cnt if r > 0) == self.num_used
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
