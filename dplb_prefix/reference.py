"""The pure-Python reference of :mod:`dplb_prefix` (csrc/dplb_prefix.pyx, csrc/dplb_prefix.h).

Slow and simple, and the definition: the native :class:`dplb_prefix.PrefixIndex`,
:func:`dplb_prefix.chain_hashes` and :func:`dplb_prefix.count_words` give bit-identical
answers (tests/csrc/test_prefix_equiv.py checks it on generated texts and operation sequences),
and so do :func:`dplb_prefix.word_ids`, :func:`dplb_prefix.word_block_keys` and
:func:`dplb_prefix.token_keys` (csrc/dplb_tokens.pyx; tests/csrc/test_tokens_equiv.py).
Nothing on the request path uses this module.

The chunk hash, over code points (so a chunk hashes alike whatever width its string is stored
in): four FNV-1a lanes (64-bit prime ``0x100000001b3``, Fowler/Noll/Vo) take the code points at
positions 0, 1, 2, 3 mod 4, each seeded with the parent hash xor a lane constant; the lanes are
folded with rotations and finished with MurmurHash3's ``fmix64`` (Appleby, SMHasher). A prompt's
chain starts at :func:`model_seed` (0 for requests naming no model).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Mapping, Sequence
from typing import TypeVar

#: a block's key (an engine's block hash or a token key)
K = TypeVar("K")

MASK = (1 << 64) - 1
FNV_PRIME = 0x100000001B3
#: the seed of a model name's hash (FNV-1a's 64-bit offset basis)
MODEL_SEED = 0xCBF29CE484222325
LANES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)


def fmix64(k: int) -> int:
    """MurmurHash3's 64-bit finaliser (Appleby, SMHasher)."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK
    return k ^ (k >> 33)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & MASK


def chunk_hash(parent: int, chunk: str) -> int:
    """The hash (uint64) of the code points of ``chunk`` chained on ``parent`` (module docstring)."""
    lanes = [parent ^ c for c in LANES]
    for i, ch in enumerate(chunk):
        k = i & 3
        lanes[k] = ((lanes[k] ^ ord(ch)) * FNV_PRIME) & MASK
    return fmix64(lanes[0] ^ _rotl(lanes[1], 16) ^ _rotl(lanes[2], 32) ^ _rotl(lanes[3], 48))


def model_seed(model: str | None) -> int:
    """The chain's first parent for requests naming ``model``: 0 for None."""
    return 0 if model is None else chunk_hash(MODEL_SEED, model)


def chain_hashes(text: str, model: str | None, chunk_chars: int, max_chunks: int) -> list[int]:
    """Chained hashes of the first ``max_chunks`` full ``chunk_chars`` chunks of ``text`` (a
    partial tail is ignored). Raises ValueError if either bound is below 1."""
    if chunk_chars < 1 or max_chunks < 1:
        raise ValueError("chunk_chars and max_chunks must be >= 1")
    h = model_seed(model)
    out = []
    for i in range(min(len(text) // chunk_chars, max_chunks)):
        h = chunk_hash(h, text[i * chunk_chars:(i + 1) * chunk_chars])
        out.append(h)
    return out


def count_words(s: str) -> int:
    """Whitespace-separated words of ``s``."""
    return len(s.split())


class ReferencePrefixIndex:
    """Bounded LRU map from chained chunk hashes to the workers that were sent that prefix: the
    reference of :class:`dplb_prefix.PrefixIndex` (same constructor, methods,
    errors and answers)."""

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
        """Chained hashes of ``text``'s full chunks for requests naming ``model`` (:func:`chain_hashes`)."""
        return chain_hashes(text, model, self.chunk_chars, self.max_chunks)

    def match(self, hashes: list[int]) -> dict[int, int]:
        """Per worker, how many leading chunks of ``hashes`` it holds (workers with 0 omitted), in
        ascending worker id; every matched entry becomes most recent."""
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
        return dict(sorted(result.items()))

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
        """How many prefix chunks ``worker_id`` holds."""
        return self._sizes.get(worker_id, 0)

    def remove_worker(self, worker_id: int) -> None:
        """Forget everything about ``worker_id``."""
        if not self._sizes.pop(worker_id, 0):
            return
        dead = []
        for h, ws in self._entries.items():
            ws.discard(worker_id)
            if not ws:
                dead.append(h)
        for h in dead:
            del self._entries[h]


# ---- the engines' KV-events path: a prompt's token ids and its blocks' keys (dplb_prefix._tokens) ----

#: chat roles that start a message in the router's prompt text (``role:content``, one per line)
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def words(text: str, chat: bool) -> list[str]:
    """The simulated engine's prompt words (sim_engine/tokenizer.py) of the router's prompt text:
    ``text.split()``; with ``chat`` each line ``role:content`` (a known role) starts a message,
    rendered ``<|role|> words <|eot|>``, a line without a role continues the message before it,
    and ``<|assistant|>`` ends the prompt (the engine's chat template)."""
    if not chat:
        return text.split()
    out: list[str] = []
    for line in text.split("\n"):
        role, sep, content = line.partition(":")
        if sep and role in ROLES:
            if out:
                out.append("<|eot|>")
            out.append(f"<|{role}|>")
            out.extend(content.split())
        else:   # a message's content went on over a newline
            out.extend(line.split())
    if out:
        out.append("<|eot|>")
    out.append("<|assistant|>")
    return out


def word_ids(text: str, chat: bool, vocab_size: int) -> list[int]:
    """The engine's token ids of :func:`words`: ``crc32(UTF-8 word) % vocab_size`` (zlib's CRC-32).
    Raises ValueError for a ``vocab_size`` outside [1, 2**32), UnicodeEncodeError for a surrogate."""
    import zlib

    if not 1 <= vocab_size < 1 << 32:
        raise ValueError(f"vocab_size must be in [1, 2**32) (got {vocab_size})")
    return [zlib.crc32(w.encode()) % vocab_size for w in words(text, chat)]


def token_keys(token_ids: Sequence[object], block_size: int, parent: object = 0) -> list[int]:
    """The chained keys of the full blocks of ``token_ids``: ``hash((parent key, *ids))`` per block
    (Python's tuple hash: the same in every process for ints), the first block chained on
    ``parent``. Raises ValueError for a ``block_size`` below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    out: list[int] = []
    h = parent
    for i in range(len(token_ids) // block_size):
        h = hash((h, *token_ids[i * block_size:(i + 1) * block_size]))
        out.append(h)
    return out


def word_block_keys(text: str, chat: bool, vocab_size: int, block_size: int,
                    drop_last: bool = True) -> tuple[int, list[int]]:
    """``(tokens, keys)``: the number of :func:`word_ids` of ``text`` and the :func:`token_keys` of
    their full blocks (with ``drop_last``, of all ids but the last)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    ids = word_ids(text, chat, vocab_size)
    return len(ids), token_keys(ids[:len(ids) - 1] if drop_last else ids, block_size)


def leading_run(keys: Sequence[K], present: Container[object], until: Mapping[K, float] | None = None,
                now: float = 0.0) -> int:
    """How many leading ``keys`` are in ``present`` or, with ``until``, map there to a time after
    ``now``."""
    n = 0
    for k in keys:
        if k not in present and (until is None or until.get(k, 0.0) <= now):
            break
        n += 1
    return n


def store_blocks(blocks: dict[object, int | None], present: dict[int, int], parent_of: dict[int, int],
                 kids: dict[int, int], hashes: Sequence[object], keys: Sequence[int | None], pk: int | None,
                 root: int = 0) -> int:
    """An engine's blocks ``hashes`` stored with their keys ``keys`` (None: unknown), the first
    chained on key ``pk`` (None: unknown), into one engine's block set
    (:class:`router.kv_events.BlockSet`): ``blocks`` (hash -> key), ``present`` (key -> how many
    blocks carry it), ``parent_of`` (key present -> its parent key) and ``kids`` (key -> how many
    keys present have it as parent). Returns the change in the count of orphans (keys present
    whose parent key, other than ``root``, is not)."""
    d = 0
    for h, k in zip(hashes, keys):
        old = blocks.get(h, -1)
        if old != k:
            if old != -1:
                d += drop_key(present, parent_of, kids, old, root)
            blocks[h] = k
            if k is not None:
                n = present.get(k, 0)
                present[k] = n + 1
                if not n and pk is not None:
                    parent_of[k] = pk
                    kids[pk] = kids.get(pk, 0) + 1
                    d += (pk != root and pk not in present) - kids.get(k, 0)
        pk = k
    return d


def drop_key(present: dict[int, int], parent_of: dict[int, int], kids: dict[int, int], k: int | None,
             root: int = 0) -> int:
    """One block carrying key ``k`` (None: none) left the set (:func:`store_blocks`' maps);
    returns the change in the count of orphans."""
    if k is None:
        return 0
    n = present.get(k, 0) - 1
    if n > 0:
        present[k] = n
        return 0
    present.pop(k, None)
    pk = parent_of.pop(k, None)
    if pk is None:
        return 0
    left = kids.get(pk, 0) - 1
    if left > 0:
        kids[pk] = left
    else:
        kids.pop(pk, None)
    return kids.get(k, 0) - (pk != root and pk not in present)


def remove_blocks(blocks: dict[object, int | None], present: dict[int, int], parent_of: dict[int, int],
                  kids: dict[int, int], hashes: Sequence[object], root: int = 0) -> int:
    """An engine's blocks ``hashes`` evicted (unknown ones ignored; :func:`store_blocks`' maps);
    returns the change in the count of orphans."""
    d = 0
    for h in hashes:
        if h in blocks:
            d += drop_key(present, parent_of, kids, blocks.pop(h), root)
    return d
