"""The native token ids and block keys of a prompt (dplb_prefix._tokens, csrc/dplb_tokens.h) equal
the pure-Python reference (dplb_prefix.reference) bit for bit: the simulated engine's word
tokenizer over the router's text (plain and chat), the chained keys of token blocks (CPython's
own tuple hash), and both fused; on generated texts and token ids, and on what the simulated
engine itself computes for a chat request."""
from __future__ import annotations

from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dplb_prefix import (
    leading_run,
    remove_blocks,
    store_blocks,
    token_keys,
    word_block_keys,
    word_block_state,
    word_ids,
)
from dplb_prefix import reference as ref
from dplb_prefix._tokens import fast_path
from dplb_protocol.wire import parse_request
from sim_engine.tokenizer import render_chat
from sim_engine.tokenizer import token_ids as engine_token_ids

# pieces that exercise the chat rendering (roles, near-roles, colons, lines) and every storage
# width and whitespace kind Python's str.split() knows (\x1c-\x1f, \x85, \xa0, \u2028, \u3000)
PIECES = ["user:", "system:", "assistant:", "tool:", "developer:", "function:", "users:", "User:",
          "user :", ":", "::", "user:user:", "a", "bc", "déf", "ü", "\u4e2d", "\U0001f600", "<|eot|>",
          " ", "  ", "\n", "\t", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x85", "\xa0", "\u2028",
          "\u3000", "\x00", "x" * 9 + ":", "assistantx:", "w1", "w2"]
texts = st.lists(st.sampled_from(PIECES), max_size=60).map("".join) | st.text(max_size=120).filter(
    lambda s: not any(0xD800 <= ord(c) <= 0xDFFF for c in s))
vocabs = st.sampled_from([1, 2, 7, 1000, 128_256, 2**31 + 11, 2**32 - 1])
# ints whose hashes take every branch of int hashing: small, -1 (hashes to -2), around 2**61 - 1,
# beyond 64 bits, negative
ints = st.integers(-10, 300) | st.sampled_from([-1, -2, 2**61 - 2, 2**61 - 1, 2**61, 2**63 - 1, -2**63, 2**64 + 5,
                                                -(2**61) + 1, -(2**70), 2**32 - 1])


@contextmanager
def native_path(fast: bool) -> Iterator[None]:
    """One of the native paths for ASCII texts: the one for CPUs with carry-less multiplication
    (where this CPU has it) or the portable one."""
    was = fast_path(fast)
    try:
        yield
    finally:
        fast_path(was)


BOTH_PATHS = pytest.mark.parametrize("fast", [True, False], ids=["fast", "portable"])


# ASCII texts whose words cross the native path's 64-byte blocks and 2,048-word batches, words of
# every length around the CRC's 8- and 16-byte steps, at the very start of the text too
ascii_words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz:", min_size=1, max_size=40)
ascii_texts = st.lists(st.tuples(ascii_words, st.sampled_from([" ", "\n", "  ", "\t\n", "\x1c", "\n\n", "\nuser:",
                                                               "\nassistant: "])), max_size=400).map(
    lambda ws: "".join(w + sep for w, sep in ws))


@BOTH_PATHS
@settings(max_examples=300, deadline=None)
@given(text=texts, chat=st.booleans(), vocab=vocabs)
def test_word_ids_equal_the_reference(fast, text, chat, vocab):
    with native_path(fast):
        got = word_ids(text, chat, vocab)
    assert got.typecode == "I"
    assert list(got) == ref.word_ids(text, chat, vocab)


@BOTH_PATHS
@settings(max_examples=200, deadline=None)
@given(text=ascii_texts, chat=st.booleans(), lead=st.sampled_from(["", " ", "user:", "x" * 17]))
def test_ascii_texts_equal_the_reference(fast, text, chat, lead):
    text = lead + text
    with native_path(fast):
        assert list(word_ids(text, chat, 128_256)) == ref.word_ids(text, chat, 128_256)
        assert word_block_keys(text, chat, 128_256, 4) == ref.word_block_keys(text, chat, 128_256, 4)


def test_many_words_cross_the_batches_alike():
    # more words than one native batch (2,048), of lengths 1-40, then a long tail word
    import random

    rnd = random.Random(7)
    words = ["".join(rnd.choice("abcxyz") for _ in range(rnd.randint(1, 40))) for _ in range(9000)]
    text = "system:" + " ".join(words) + "\nuser: " + "q" * 1000
    for fast in (True, False):
        with native_path(fast):
            assert word_block_keys(text, True, 128_256, 16) == ref.word_block_keys(text, True, 128_256, 16)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(ints, max_size=80), bs=st.integers(1, 20), parent=ints)
def test_token_keys_equal_python_tuple_hashes(ids, bs, parent):
    want = ref.token_keys(ids, bs, parent)
    assert token_keys(ids, bs, parent) == want
    assert token_keys(tuple(ids), bs, parent) == want
    # the definition, spelt out: CPython's hash of (parent key, *block ids), chained
    h, spelt = parent, []
    for i in range(len(ids) // bs):
        h = hash((h, *ids[i * bs:(i + 1) * bs]))
        spelt.append(h)
    assert want == spelt


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 2**32 - 1), max_size=80), bs=st.integers(1, 20))
def test_token_keys_of_an_ids_array_equal_those_of_the_list(ids, bs):
    assert token_keys(array("I", ids), bs) == ref.token_keys(ids, bs)


@BOTH_PATHS
@settings(max_examples=200, deadline=None)
@given(text=texts, chat=st.booleans(), vocab=vocabs, bs=st.integers(1, 20), drop_last=st.booleans())
def test_word_block_keys_equal_the_reference(fast, text, chat, vocab, bs, drop_last):
    with native_path(fast):
        assert word_block_keys(text, chat, vocab, bs, drop_last) == ref.word_block_keys(text, chat, vocab, bs, drop_last)


def pieces_keys(text: str, chat: bool, vocab: int, bs: int, cuts: list[int]) -> tuple[int, list[int]]:
    """The keys of ``text`` tokenized in pieces split at the newlines ``cuts`` (word_block_state
    for each piece but the last, word_block_keys resuming after the last cut)."""
    start, state, keys = 0, None, []
    for c in cuts:
        state, got = word_block_state(text, chat, vocab, bs, c, start, state)
        keys += got
        start = c + 1
    n, tail = word_block_keys(text, chat, vocab, bs, False, start, state)
    keys += tail
    if n and n % bs == 0:
        keys.pop()
    return n, keys


@BOTH_PATHS
@settings(max_examples=300, deadline=None)
@given(text=texts | ascii_texts, chat=st.booleans(), vocab=vocabs, bs=st.integers(1, 20), data=st.data())
def test_word_block_keys_resumed_at_newlines_equal_one_pass(fast, text, chat, vocab, bs, data):
    # a prompt read in pieces that end at newlines (a kept prefix's state, then the rest) gives
    # the tokens and keys of one pass, whichever newlines it is cut at
    nls = [i for i, c in enumerate(text) if c == "\n"]
    cuts = sorted(data.draw(st.sets(st.sampled_from(nls), max_size=4))) if nls else []
    with native_path(fast):
        assert pieces_keys(text, chat, vocab, bs, cuts) == word_block_keys(text, chat, vocab, bs)


def test_resuming_checks_where_and_from_what():
    text = "system: a b c\nuser: d e"
    with pytest.raises(ValueError):
        word_block_state(text, True, 10, 4, 3)            # text[3] is not a newline
    with pytest.raises(ValueError):
        word_block_state(text, True, 10, 4, len(text))    # past the end
    state, _ = word_block_state(text, True, 10, 4, 13)
    with pytest.raises(ValueError):
        word_block_keys(text, True, 10, 4, True, 5, state)   # not a line's start
    with pytest.raises(ValueError):
        word_block_keys(text, True, 10, 8, True, 14, state)  # a state of another block size
    with pytest.raises(ValueError):
        word_block_keys(text, True, 10, 4, True, 0, state)   # a state where the prompt starts


@settings(max_examples=200, deadline=None)
@given(keys=st.lists(st.integers(0, 30), max_size=30), present=st.sets(st.integers(0, 30)),
       until=st.dictionaries(st.integers(0, 30), st.floats(0, 10)), now=st.floats(0, 10))
def test_leading_run_equals_the_reference(keys, present, until, now):
    p = dict.fromkeys(present, 1)
    assert leading_run(keys, p) == ref.leading_run(keys, p)
    assert leading_run(keys, p, until, now) == ref.leading_run(keys, p, until, now)
    assert leading_run(tuple(keys), p, until, now) == ref.leading_run(keys, p, until, now)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 12), st.none() | st.integers(0, 8)),
                                                      max_size=6),
                              st.none() | st.integers(0, 8)), max_size=25))
def test_storing_and_removing_blocks_equal_the_reference(ops):
    # stores (a hash stored again with another key or None, unknown parents) and removals in any
    # order leave the same four maps and orphan count in C as in the reference
    native: tuple[dict, dict, dict, dict] = ({}, {}, {}, {})
    python: tuple[dict, dict, dict, dict] = ({}, {}, {}, {})
    orphans = [0, 0]
    for store, pairs, pk in ops:
        hashes, keys = [h for h, _ in pairs], [k for _, k in pairs]
        if store:
            orphans[0] += store_blocks(*native, hashes, keys, pk)
            orphans[1] += ref.store_blocks(*python, hashes, keys, pk)
        else:
            orphans[0] += remove_blocks(*native, iter(hashes))
            orphans[1] += ref.remove_blocks(*python, hashes)
        assert native == python and orphans[0] == orphans[1]
    with pytest.raises(ValueError):
        store_blocks({}, {}, {}, {}, [1, 2], [3], None)


def test_a_chat_request_tokenizes_as_the_simulated_engine_renders_it():
    msgs = [{"role": "system", "content": "You are terse. ü \u4e2d\u3000x"},
            {"role": "user", "content": "first line\nsecond line " + "w " * 50},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "and a follow up\U0001f600"}]
    text = parse_request("/v1/chat/completions", orjson.dumps({"model": "m", "messages": msgs})).text
    want = engine_token_ids(render_chat(msgs), 128_256)
    assert list(word_ids(text, True, 128_256)) == want
    n, keys = word_block_keys(text, True, 128_256, 16)
    assert n == len(want) and keys == ref.token_keys(want[:-1], 16)


def test_bad_arguments_and_surrogates_raise_like_the_reference():
    for vocab in (0, 2**32):
        with pytest.raises(ValueError):
            word_ids("a b", False, vocab)
        with pytest.raises(ValueError):
            ref.word_ids("a b", False, vocab)
    with pytest.raises(ValueError):
        token_keys([1, 2], 0)
    with pytest.raises(ValueError):
        word_block_keys("a b", False, 10, 0)
    for chat in (False, True):
        with pytest.raises(UnicodeEncodeError):
            word_ids("user: a b\ud800c", chat, 10)
        with pytest.raises(UnicodeEncodeError):
            ref.word_ids("user: a b\ud800c", chat, 10)
