"""The native prompt work and prefix index (dplb_prefix) equal the pure-Python reference
(dplb_prefix.reference) bit for bit: word counts, chained chunk hashes and every index operation,
on generated texts and operation sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dplb_prefix import (
    MAX_WORKER_ID,
    PrefixIndex,
    chain_hashes,
    count_words,
    model_seed,
)
from dplb_prefix import reference as ref

# every storage width CPython picks (1, 2 and 4 bytes a code point) and Python's odd whitespace
# (\x1c-\x1f, \x85, \xa0, \u2028, \u3000), so word boundaries and hashes are tried on all of them
ALPHABET = st.sampled_from(list("ab \n\t\r\x0b\x0c\x1c\x1f\x85\xa0éü\u2028\u3000\u4e2d\U0001f600\x00"))
texts = st.text(alphabet=ALPHABET, max_size=300) | st.text(max_size=200)
models = st.none() | st.sampled_from(["", "m", "llama-3-8b", "ü\U0001f600"])


@settings(max_examples=300, deadline=None)
@given(s=texts)
def test_count_words_is_len_split(s):
    assert count_words(s) == ref.count_words(s) == len(s.split())


@settings(max_examples=300, deadline=None)
@given(text=texts, model=models, chunk_chars=st.integers(1, 70), max_chunks=st.integers(1, 40))
def test_chain_hashes_equal_the_reference(text, model, chunk_chars, max_chunks):
    got = chain_hashes(text, model, chunk_chars, max_chunks)
    assert got.typecode == "Q"
    assert list(got) == ref.chain_hashes(text, model, chunk_chars, max_chunks)
    assert model_seed(model) == ref.model_seed(model)


def test_a_chunk_hashes_alike_whatever_width_its_string_is_stored_in():
    # the same 8 ASCII characters, in a 1-byte string and in strings widened by a later character
    head = "abcdefgh"
    a = chain_hashes(head + "x" * 8, "m", 8, 10)
    b = chain_hashes(head + "\u4e2d" * 8, "m", 8, 10)
    c = chain_hashes(head + "\U0001f600" * 8, "m", 8, 10)
    assert a[0] == b[0] == c[0] and len({a[1], b[1], c[1]}) == 3


def test_the_chain_depends_on_model_and_position():
    assert chain_hashes("abcd" * 4, "a", 4, 10)[0] != chain_hashes("abcd" * 4, "b", 4, 10)[0]
    assert chain_hashes("abcd" * 4, None, 4, 10)[0] != chain_hashes("abcd" * 4, "", 4, 10)[0]
    h = chain_hashes("abcd" * 4, None, 4, 10)
    assert len(set(h)) == 4   # the same chunk at four depths: four hashes


def test_bad_bounds_raise_like_the_reference():
    for args in ((0, 1, 1), (1, 0, 1), (1, 1, 0)):
        with pytest.raises(ValueError):
            PrefixIndex(*args)
        with pytest.raises(ValueError):
            ref.ReferencePrefixIndex(*args)
    with pytest.raises(ValueError):
        chain_hashes("abc", None, 0, 1)
    with pytest.raises(ValueError):
        PrefixIndex().insert([1], -1)
    with pytest.raises(ValueError):
        PrefixIndex().insert([1], MAX_WORKER_ID + 1)


# one operation on both indexes: ("match"|"insert"|"remove", text, model, worker)
ops = st.lists(st.tuples(st.sampled_from(["match", "match", "insert", "insert", "insert", "remove"]),
                         st.text(alphabet="ab", max_size=40), st.sampled_from([None, "m"]),
                         st.integers(0, 9)), max_size=120)


def _check_same(native, reference, operations):
    for op, text, model, w in operations:
        hs = reference.hashes(text, model)
        assert list(native.hashes(text, model)) == hs
        if op == "match":
            got, want = native.match(hs), reference.match(hs)
            assert list(got.items()) == list(want.items())   # same depths, same (ascending) order
        elif op == "insert":
            native.insert(hs, w)
            reference.insert(hs, w)
        else:
            native.remove_worker(w)
            reference.remove_worker(w)
        assert len(native) == len(reference)
        assert [native.size(k) for k in range(11)] == [reference.size(k) for k in range(11)]


@settings(max_examples=200, deadline=None)
@given(operations=ops, chunk_chars=st.integers(1, 6), max_entries=st.integers(1, 30))
def test_index_operations_equal_the_reference(operations, chunk_chars, max_entries):
    # small bounds: eviction (LRU order, matched entries made recent) runs all the time
    _check_same(PrefixIndex(chunk_chars, 8, max_entries), ref.ReferencePrefixIndex(chunk_chars, 8, max_entries),
                operations)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_index_grows_and_shrinks_like_the_reference(seed):
    # past the native pool's and table's first sizes (256 entries, 1,024 slots), with deletions
    # (removal and eviction) in between, and raw integer hashes colliding in the table's low bits
    import random

    rnd = random.Random(seed)
    native, reference = PrefixIndex(4, 10_000, 3_000), ref.ReferencePrefixIndex(4, 10_000, 3_000)
    for _ in range(40):
        hs = [rnd.choice([rnd.getrandbits(64), rnd.getrandbits(12) << 52, rnd.randrange(5000)])
              for _ in range(rnd.randrange(1, 400))]
        w = rnd.randrange(40)
        r = rnd.random()
        if r < 0.6:
            native.insert(hs, w)
            reference.insert(hs, w)
        elif r < 0.9:
            assert list(native.match(hs).items()) == list(reference.match(hs).items())
        else:
            native.remove_worker(w)
            reference.remove_worker(w)
        assert len(native) == len(reference)
    assert [native.size(k) for k in range(40)] == [reference.size(k) for k in range(40)]
    everything = list(reference._entries)
    for h in everything[:50] + everything[-50:]:
        assert native.match([h]) == reference.match([h])
