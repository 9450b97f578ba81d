# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""dplb_prefix._tokens: a prompt's token ids and its blocks' chained keys, native.

The engines' KV-cache events carry token ids; matching a request against them needs its prompt
tokenized the engine's way and cut into blocks whose keys chain as the events' do
(:func:`router.kv_events.token_keys`: ``hash((parent key, *ids))`` per block).

- :func:`word_ids`: the simulated engine's word tokenizer over the router's prompt text
  (csrc/dplb_tokens.h), as ``array('I')``.
- :func:`word_block_keys`: the same text's token count and its full blocks' keys in one pass,
  without the ids.
- :func:`token_keys`: the chained keys of the full blocks of any token ids.

Behaviour is defined by the pure-Python reference, dplb_prefix/reference.py (``words``,
``word_ids``, ``token_keys``), which this module matches bit for bit
(tests/csrc/test_tokens_equiv.py).
"""
from libc.stdint cimport uint32_t, uint64_t, int64_t
from libc.stdlib cimport free
from libc.string cimport memcpy
from cpython cimport array
from cpython.unicode cimport PyUnicode_KIND, PyUnicode_DATA, PyUnicode_GET_LENGTH, PyUnicode_READ_CHAR
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_FromLongLong
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Fast_GET_ITEM

import array as _array

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object)
    bint PyLong_CheckExact(object)
    Py_ssize_t PyObject_Hash(object) except? -1

cdef extern from "dplb_tokens.h" nogil:
    ctypedef struct dplb_tok:
        uint32_t vocab
        uint64_t fastmod
        Py_ssize_t block_size
        uint64_t acc
        Py_ssize_t in_block
        int64_t parent
        Py_ssize_t n
        int keep_ids
        uint32_t *ids
        Py_ssize_t ids_cap
        int64_t *keys
        Py_ssize_t keys_n
        Py_ssize_t keys_cap
        int oom
        int open_end
    void dplb_crc_init()
    uint64_t dplb_int_hash(int64_t v)
    uint64_t dplb_tuple_lane(uint64_t acc, uint64_t lane)
    int64_t dplb_tuple_finish(uint64_t acc, Py_ssize_t length)
    int dplb_tokenize(dplb_tok *t, int chat, int ascii, int kind, const void *data, Py_ssize_t n)
    uint64_t DPLB_XXPRIME_5
    int dplb_has_fast
    int dplb_fast_off

dplb_crc_init()

cdef array.array _IDS = _array.array("I")


def fast_path(object on=None):
    """Whether ASCII texts take the path compiled for x86-64 CPUs with POPCNT, BMI1, PCLMULQDQ and
    SSE4.1 (the words' CRC-32s by carry-less multiplication) rather than the portable one
    (table-driven); ``on`` False forces the portable path, True allows the other again (both give
    the same ids: tests/csrc/test_tokens_equiv.py)."""
    global dplb_fast_off
    if on is not None:
        dplb_fast_off = 0 if on else 1
    return bool(dplb_has_fast and not dplb_fast_off)


cdef int _run(dplb_tok *t, str text, bint chat, Py_ssize_t vocab_size, Py_ssize_t block_size, bint keep_ids,
              Py_ssize_t start=0, Py_ssize_t end=-1, object state=None) except -1:
    """Tokenize ``text[start:end]`` (``end`` -1: to the end, closed with the chat literals; else an
    open prefix) from ``state`` (:func:`word_block_state`'s; None: the prompt's start)."""
    if vocab_size < 1 or vocab_size > 0xFFFFFFFF:
        raise ValueError(f"vocab_size must be in [1, 2**32) (got {vocab_size})")
    if block_size < 0:
        raise ValueError(f"block_size must be >= 0 (got {block_size})")
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text)
    if end < 0:
        end = n
    if start < 0 or start > end or end > n:
        raise ValueError(f"[start, end) = [{start}, {end}) is not within the text (length {n})")
    if start > 0 and PyUnicode_READ_CHAR(text, start - 1) != 10:
        raise ValueError(f"start {start} is not a line's start (text[start - 1] must be a newline)")
    t.vocab = <uint32_t>vocab_size
    t.fastmod = <uint64_t>0xFFFFFFFFFFFFFFFF // t.vocab + 1
    t.block_size = block_size
    t.acc = 0
    t.in_block = 0
    t.parent = 0
    t.n = 0
    if state is not None:
        st_n, st_acc, st_in, st_parent, st_bs = state
        if st_bs != block_size or (start == 0 and st_n):
            raise ValueError("state is not one of this block size at a line's start")
        t.n = st_n
        t.acc = st_acc
        t.in_block = st_in
        t.parent = st_parent
    t.keep_ids = keep_ids
    t.ids = NULL
    t.ids_cap = 0
    t.keys = NULL
    t.keys_n = 0
    t.keys_cap = 0
    t.oom = 0
    t.open_end = end != n
    cdef int ascii = PyUnicode_IS_ASCII(text)
    cdef int kind = PyUnicode_KIND(text)
    cdef const char *data = <const char *>PyUnicode_DATA(text) + start * kind
    cdef int rc
    with nogil:
        rc = dplb_tokenize(t, chat, ascii, kind, data, end - start)
    if rc < 0:
        free(t.ids)
        free(t.keys)
        if t.oom:
            raise MemoryError()
        text.encode()   # a surrogate in a word: raises UnicodeEncodeError as str.encode does
        raise ValueError("text cannot be encoded as UTF-8")
    return 0


def word_ids(str text, bint chat, Py_ssize_t vocab_size):
    """The token ids (``array('I')``) of the router's prompt ``text`` for the simulated engine:
    one per whitespace-separated word, ``crc32(UTF-8 word) % vocab_size``; with ``chat`` the text
    (``role:content`` per line) rendered as its chat template (csrc/dplb_tokens.h). Raises
    ValueError for a ``vocab_size`` outside [1, 2**32), UnicodeEncodeError for a surrogate."""
    cdef dplb_tok t
    _run(&t, text, chat, vocab_size, 0, True)
    cdef array.array out = array.clone(_IDS, t.n, zero=False)
    if t.n:
        memcpy(out.data.as_uints, t.ids, t.n * sizeof(uint32_t))
    free(t.ids)
    free(t.keys)
    return out


cdef list _keys_list(const int64_t *keys, Py_ssize_t n):
    cdef list out = PyList_New(n)
    cdef Py_ssize_t i
    cdef object k
    for i in range(n):
        k = PyLong_FromLongLong(keys[i])
        Py_INCREF(k)
        PyList_SET_ITEM(out, i, k)
    return out


def word_block_keys(str text, bint chat, Py_ssize_t vocab_size, Py_ssize_t block_size, bint drop_last=True,
                    Py_ssize_t start=0, object state=None):
    """``(tokens, keys)`` of the router's prompt ``text``: its token count (:func:`word_ids`) and the
    chained keys (list of int, :func:`token_keys` from key 0) of the full blocks of its ids; with
    ``drop_last`` of all ids but the last (vLLM always computes a prompt's last token, so the
    block holding it is never a hit). From ``start`` (a line's start) with ``state``, what
    :func:`word_block_state` answered for ``text[:start - 1]``: the tokens counted from the
    state's and the keys of the blocks completed after it only (with ``drop_last`` the last of
    them left out when the prompt's last token completes a block). Raises ValueError for a
    ``block_size`` below 1, a ``start`` that is not a line's start or a state of another block
    size, and as :func:`word_ids`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    cdef dplb_tok t
    _run(&t, text, chat, vocab_size, block_size, False, start, -1, state)
    cdef Py_ssize_t nk = t.keys_n
    if drop_last and nk > 0 and t.n > 0 and t.n % block_size == 0:
        nk -= 1
    try:
        return t.n, _keys_list(t.keys, nk)
    finally:
        free(t.keys)


def word_block_state(str text, bint chat, Py_ssize_t vocab_size, Py_ssize_t block_size, Py_ssize_t end,
                     Py_ssize_t start=0, object state=None):
    """``(state, keys)`` of the open prefix ``text[start:end]`` (``text[end]`` a newline; from
    ``state`` as :func:`word_block_keys`'s): the keys (list of int) of the blocks completed in it
    and the tokenizer's state after it (an opaque tuple), from which :func:`word_block_keys`
    resumes at ``end + 1`` as if the text had been read in one pass (no chat literal closes the
    prefix). Raises ValueError when ``text[end]`` is not a newline and as :func:`word_block_keys`."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    if not 0 <= end < PyUnicode_GET_LENGTH(text) or PyUnicode_READ_CHAR(text, end) != 10:
        raise ValueError(f"end {end} is not a newline of the text")
    cdef dplb_tok t
    _run(&t, text, chat, vocab_size, block_size, False, start, end, state)
    try:
        return (t.n, t.acc, t.in_block, t.parent, block_size), _keys_list(t.keys, t.keys_n)
    finally:
        free(t.keys)


cdef inline uint64_t _lane(object x) except? 0:
    """hash(x) as a tuple item's lane (ints natively, anything else through its own hash)."""
    cdef int overflow = 0
    cdef long long v
    if PyLong_CheckExact(x):
        v = PyLong_AsLongLongAndOverflow(x, &overflow)
        if not overflow:
            return dplb_int_hash(v)
    return <uint64_t>PyObject_Hash(x)


def token_keys(object token_ids, Py_ssize_t block_size, object parent=0):
    """The chained keys (list of int) of the full blocks of ``token_ids`` (a sequence of ints; a
    partial tail is ignored): ``hash((parent key, *ids))`` per block, bit for bit as CPython
    computes it, the first block chained on ``parent``. Raises ValueError for a ``block_size``
    below 1."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    cdef bint is_u32 = isinstance(token_ids, array.array) and (<array.array>token_ids).ob_descr.typecode == b'I'
    if not is_u32 and type(token_ids) is not list and type(token_ids) is not tuple:
        token_ids = list(token_ids)
    cdef Py_ssize_t nb = len(token_ids) // block_size
    cdef list out = PyList_New(nb)
    cdef Py_ssize_t b, j
    cdef uint64_t acc = 0
    cdef uint64_t plane = _lane(parent)
    cdef int64_t key
    cdef object k
    cdef const uint32_t[:] view
    if is_u32:
        view = token_ids
    for b in range(nb):
        acc = dplb_tuple_lane(DPLB_XXPRIME_5, plane)
        if is_u32:
            for j in range(b * block_size, (b + 1) * block_size):
                acc = dplb_tuple_lane(acc, view[j])
        else:
            for j in range(b * block_size, (b + 1) * block_size):
                acc = dplb_tuple_lane(acc, _lane(<object>PySequence_Fast_GET_ITEM(token_ids, j)))
        key = dplb_tuple_finish(acc, block_size + 1)
        plane = dplb_int_hash(key)
        k = PyLong_FromLongLong(key)
        Py_INCREF(k)
        PyList_SET_ITEM(out, b, k)
    return out


def leading_run(object keys, object present, object until=None, double now=0.0):
    """How many leading ``keys`` (a sequence) are in ``present`` (a mapping; dicts take the fast
    path) or, with ``until`` (a mapping of keys to times), map there to a time after ``now`` (a
    placement not yet expired): the loop of :meth:`router.kv_events.BlockSet.match_keys` and
    :meth:`router.kv_events.PendingBlocks.match` in C (one dict lookup per key)."""
    if type(keys) is not list and type(keys) is not tuple:
        keys = list(keys)
    cdef Py_ssize_t i, n = len(keys)
    cdef object k
    cdef dict pd = present if type(present) is dict else None
    cdef bint hit
    for i in range(n):
        k = <object>PySequence_Fast_GET_ITEM(keys, i)
        hit = k in pd if pd is not None else k in present
        if hit:
            continue
        if until is not None and until.get(k, 0.0) > now:
            continue
        return i
    return n


cdef object _NONE_YET = object()


cdef long long _drop_key(dict present, dict parent_of, dict kids, object k, object root) except? -1:
    if k is None:
        return 0
    cdef object got = present.get(k)
    cdef Py_ssize_t n = (<Py_ssize_t>got if got is not None else 0) - 1
    if n > 0:
        present[k] = n
        return 0
    present.pop(k, None)
    cdef object pk = parent_of.pop(k, None)
    if pk is None:
        return 0
    got = kids.get(pk)
    cdef Py_ssize_t left = (<Py_ssize_t>got if got is not None else 0) - 1
    if left > 0:
        kids[pk] = left
    else:
        kids.pop(pk, None)
    got = kids.get(k)
    cdef bint orphaned_by_it = pk != root and pk not in present
    return (<Py_ssize_t>got if got is not None else 0) - orphaned_by_it


def store_blocks(dict blocks, dict present, dict parent_of, dict kids, list hashes, list keys, object pk,
                 object root=0):
    """:func:`dplb_prefix.reference.store_blocks` (the definition) in C: an engine's blocks stored
    into its block set's maps (router.kv_events.BlockSet.store); returns the change in the count of
    orphans. ``hashes`` and ``keys`` are lists of one length (ValueError otherwise)."""
    cdef Py_ssize_t i, n = len(hashes), c
    if len(keys) != n:
        raise ValueError(f"{n} hashes but {len(keys)} keys")
    cdef long long d = 0
    cdef bint orphan
    cdef object h, k, old, got
    for i in range(n):
        h = hashes[i]
        k = keys[i]
        old = blocks.get(h, _NONE_YET)
        if old is not _NONE_YET and old == k:
            pk = k
            continue
        if old is not _NONE_YET:
            d += _drop_key(present, parent_of, kids, old, root)
        blocks[h] = k
        if k is not None:
            got = present.get(k)
            c = <Py_ssize_t>got if got is not None else 0
            present[k] = c + 1
            if not c and pk is not None:
                parent_of[k] = pk
                got = kids.get(pk)
                kids[pk] = (<Py_ssize_t>got if got is not None else 0) + 1
                got = kids.get(k)
                orphan = pk != root and pk not in present
                d += orphan - (<Py_ssize_t>got if got is not None else 0)
        pk = k
    return d


def remove_blocks(dict blocks, dict present, dict parent_of, dict kids, object hashes, object root=0):
    """:func:`dplb_prefix.reference.remove_blocks` in C: an engine's blocks ``hashes`` (an
    iterable) evicted from its block set's maps; returns the change in the count of orphans."""
    cdef long long d = 0
    cdef object h, k
    for h in hashes:
        k = blocks.pop(h, _NONE_YET)
        if k is not _NONE_YET:
            d += _drop_key(present, parent_of, kids, k, root)
    return d
