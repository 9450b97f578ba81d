"""The approximate prefix index (router/policies/prefix_index.py): match depths, LRU bound."""
from __future__ import annotations

from router.policies.prefix_index import PrefixIndex


def test_prefix_index_match_depths_and_lru_bound():
    idx = PrefixIndex(chunk_chars=4, max_chunks=100, max_entries=6)
    a = idx.hashes("aaaabbbbcccc")
    b = idx.hashes("aaaabbbbdddd")
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    idx.insert(a, 0)
    idx.insert(b[:2], 1)
    assert idx.match(a) == {0: 3, 1: 2}
    assert idx.match(idx.hashes("zzzz")) == {}
    assert idx.match(idx.hashes("aaa")) == {}      # shorter than one chunk
    assert idx.size(0) == 3 and idx.size(1) == 2
    idx.insert(idx.hashes("qqqqrrrrsssstttt"), 2)  # 4 new entries, bound 6: 1 evicted (LRU)
    assert len(idx) == 6
    idx.remove_worker(2)
    assert idx.size(2) == 0 and len(idx) == 2


def test_prefix_index_same_chunk_at_different_depth_differs():
    idx = PrefixIndex(chunk_chars=4)
    assert idx.hashes("abcdabcd")[0] != idx.hashes("abcdabcd")[1]
