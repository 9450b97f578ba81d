# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""dplb_prefix._native: the approximate prefix index and the per-byte work of a prompt, native.

- :func:`count_words`: ``len(s.split())`` without building the words (the prompt length in
  tokens of the simulated engine's tokenizer, :mod:`dplb_protocol.wire`).
- :func:`chain_hashes`: the chained hashes of a text's full chunks (csrc/dplb_prefix.h), read
  from the str's own buffer: no slice, no copy, no Python loop over chunks.
- :class:`PrefixIndex`: the bounded LRU map hash -> workers (match, insert, eviction, removal) in
  C arrays: an open-addressing table (linear probing, backward-shift deletion) over an entry pool
  threaded on a doubly-linked LRU list.

Behaviour is defined by the pure-Python reference, dplb_prefix/reference.py, which
this module matches bit for bit (tests/csrc/test_prefix_equiv.py).
"""
from libc.stdint cimport uint64_t, int32_t, int64_t
from libc.stdlib cimport malloc, realloc, free, calloc
from libc.string cimport memcpy
from cpython cimport array
from cpython.unicode cimport PyUnicode_KIND, PyUnicode_DATA, PyUnicode_GET_LENGTH

import array as _array

cdef extern from "dplb_prefix.h" nogil:
    uint64_t dplb_chunk_hash(uint64_t parent, int kind, const void *data, Py_ssize_t start, Py_ssize_t n)
    Py_ssize_t dplb_count_words(int kind, const void *data, Py_ssize_t n)
    uint64_t DPLB_MODEL_SEED
    void dplb_prefetch(const void *p)

cdef array.array _HASHES = _array.array("Q")
#: worker ids are kept as int32 and their sizes in an array indexed by id: ids must be in [0, MAX_WORKER_ID]
MAX_WORKER_ID = (1 << 20) - 1
cdef int32_t _MAX_WID = (1 << 20) - 1


def count_words(str s):
    """``len(s.split())``: the number of whitespace-separated words of ``s`` (Python's whitespace)."""
    return dplb_count_words(PyUnicode_KIND(s), PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s))


cpdef uint64_t model_seed(object model):
    """The chain's first parent for requests naming ``model``: 0 for None, else the chunk hash of
    the whole name chained on DPLB_MODEL_SEED."""
    if model is None:
        return 0
    cdef str m = model
    return dplb_chunk_hash(DPLB_MODEL_SEED, PyUnicode_KIND(m), PyUnicode_DATA(m), 0, PyUnicode_GET_LENGTH(m))


def chain_hashes(str text, object model, Py_ssize_t chunk_chars, Py_ssize_t max_chunks):
    """Chained hashes (``array('Q')``) of the first ``max_chunks`` full ``chunk_chars``-code-point
    chunks of ``text`` (a partial tail is ignored), the chain starting at :func:`model_seed`.
    Raises ValueError if ``chunk_chars`` or ``max_chunks`` < 1."""
    if chunk_chars < 1 or max_chunks < 1:
        raise ValueError("chunk_chars and max_chunks must be >= 1")
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(text) // chunk_chars
    if n > max_chunks:
        n = max_chunks
    cdef array.array out = array.clone(_HASHES, n, zero=False)
    cdef uint64_t *o = <uint64_t *>out.data.as_ulonglongs
    cdef int kind = PyUnicode_KIND(text)
    cdef const void *data = PyUnicode_DATA(text)
    cdef uint64_t h = model_seed(model)
    cdef Py_ssize_t i
    with nogil:
        for i in range(n):
            h = dplb_chunk_hash(h, kind, data, i * chunk_chars, chunk_chars)
            o[i] = h
    return out


cdef struct Entry:
    uint64_t key
    int32_t prev       # LRU neighbours (entry indices, -1: none); the head is the least recent
    int32_t next       # (also the free list's link)
    int32_t n          # workers holding this prefix, sorted ascending
    int32_t cap        # 2: they live in inl; more: in more
    int32_t inl[2]
    int32_t *more


cdef struct Slot:
    uint64_t key       # the hash, kept in the table: a probe reads no entry
    int32_t idx1       # entry index + 1; 0: empty


cdef inline int32_t *_ws(Entry *e) noexcept nogil:
    if e.cap <= 2:
        return &e.inl[0]
    return e.more


cdef inline uint64_t _home(uint64_t key, int bits) noexcept nogil:
    return (key * <uint64_t>0x9e3779b97f4a7c15ULL) >> (64 - bits)


#: how far ahead of the lookup at chunk d the table slot of chunk d + _AHEAD is prefetched: a long
#: prompt's chunks land on random slots of a table larger than the cache, and each lookup would
#: otherwise wait for memory (match + insert of a 220 KB prompt over 81k entries: ~330 µs without,
#: ~130 µs at 24 ahead, ~170 µs at 8 or 48; prefetching the entries too made it slower)
cdef enum:
    _AHEAD = 24


cdef class PrefixIndex:
    """Bounded LRU map from chained chunk hashes to the workers that were sent that prefix
    (router/policies/prefix_index.py's docstring; the reference:
    ``dplb_prefix.reference.ReferencePrefixIndex``).

    ``chunk_chars``: code points per chunk (>= 1); ``max_chunks``: only the first ``max_chunks``
    chunks of a prompt are hashed (bounds the work per request); ``max_entries``: LRU bound.
    Memory: 40 bytes per pooled entry plus 16 per table slot (at most half full), pool and table
    doubling as they fill: 72 to 144 bytes per entry. Worker ids are
    ints in [0, MAX_WORKER_ID] (ValueError otherwise). Raises ValueError for a bound below 1.
    """

    cdef readonly Py_ssize_t chunk_chars
    cdef readonly Py_ssize_t max_chunks
    cdef readonly Py_ssize_t max_entries
    cdef Entry *ent
    cdef int32_t ent_cap
    cdef int32_t nlive
    cdef int32_t free_head
    cdef int32_t used          # pool entries ever handed out (the rest is untouched)
    cdef int32_t head, tail    # LRU: head least recent
    cdef Slot *table
    cdef int bits
    cdef int64_t *sizes
    cdef int32_t nsizes

    def __cinit__(self, Py_ssize_t chunk_chars=64, Py_ssize_t max_chunks=8192, Py_ssize_t max_entries=200_000):
        if chunk_chars < 1 or max_chunks < 1 or max_entries < 1:
            raise ValueError("chunk_chars, max_chunks and max_entries must be >= 1")
        if max_entries > (1 << 29):
            raise ValueError("max_entries must be <= 2**29")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_entries = max_entries
        self.ent_cap = 256
        self.ent = <Entry *>malloc(self.ent_cap * sizeof(Entry))
        self.bits = 10
        self.table = <Slot *>calloc(1 << self.bits, sizeof(Slot))
        self.nsizes = 64
        self.sizes = <int64_t *>calloc(self.nsizes, sizeof(int64_t))
        if self.ent == NULL or self.table == NULL or self.sizes == NULL:
            raise MemoryError()
        self.nlive = 0
        self.used = 0
        self.free_head = -1
        self.head = -1
        self.tail = -1

    def __dealloc__(self):
        cdef int32_t i
        if self.ent != NULL:
            for i in range(self.used):
                if self.ent[i].cap > 2:
                    free(self.ent[i].more)
            free(self.ent)
        free(self.table)
        free(self.sizes)

    def __len__(self):
        return self.nlive

    def hashes(self, str text, model=None):
        """Chained hashes of ``text``'s full chunks for requests naming ``model`` (:func:`chain_hashes`)."""
        return chain_hashes(text, model, self.chunk_chars, self.max_chunks)

    # ---------------------------------------------------------------- table
    cdef inline void _prefetch(self, const uint64_t *h, Py_ssize_t n, Py_ssize_t d) noexcept nogil:
        """Prefetch the home slot of chunk d + _AHEAD."""
        if d + _AHEAD < n:
            dplb_prefetch(&self.table[_home(h[d + _AHEAD], self.bits)])

    cdef inline void _prefetch_start(self, const uint64_t *h, Py_ssize_t n) noexcept nogil:
        cdef Py_ssize_t d
        for d in range(min(n, _AHEAD)):
            dplb_prefetch(&self.table[_home(h[d], self.bits)])

    cdef inline int32_t _find(self, uint64_t key) noexcept nogil:
        cdef uint64_t mask = (<uint64_t>1 << self.bits) - 1
        cdef uint64_t i = _home(key, self.bits)
        cdef Slot *t
        while True:
            t = &self.table[i]
            if t.idx1 == 0:
                return -1
            if t.key == key:
                return t.idx1 - 1
            i = (i + 1) & mask

    cdef void _place_key(self, uint64_t key, int32_t idx1) noexcept nogil:
        cdef uint64_t mask = (<uint64_t>1 << self.bits) - 1
        cdef uint64_t i = _home(key, self.bits)
        while self.table[i].idx1 != 0:
            i = (i + 1) & mask
        self.table[i].key = key
        self.table[i].idx1 = idx1

    cdef int _grow_table(self) except -1:
        cdef Slot *old = self.table
        cdef uint64_t oldn = <uint64_t>1 << self.bits
        cdef uint64_t j
        cdef Slot *t = <Slot *>calloc(oldn * 2, sizeof(Slot))
        if t == NULL:
            raise MemoryError()
        self.table = t
        self.bits += 1
        for j in range(oldn):
            if old[j].idx1 != 0:
                self._place_key(old[j].key, old[j].idx1)
        free(old)
        return 0

    cdef void _unplace(self, int32_t idx) noexcept nogil:
        cdef uint64_t mask = (<uint64_t>1 << self.bits) - 1
        cdef uint64_t i = _home(self.ent[idx].key, self.bits)
        cdef uint64_t j, k
        while self.table[i].idx1 != idx + 1:
            i = (i + 1) & mask
        self.table[i].idx1 = 0
        j = i
        while True:   # backward-shift deletion (Knuth, TAOCP vol. 3, 6.4 Algorithm R)
            j = (j + 1) & mask
            if self.table[j].idx1 == 0:
                return
            k = _home(self.table[j].key, self.bits)
            if (i <= j and (k <= i or k > j)) or (i > j and k <= i and k > j):
                self.table[i] = self.table[j]
                self.table[j].idx1 = 0
                i = j

    # ---------------------------------------------------------------- LRU list
    cdef inline void _unlink(self, int32_t e) noexcept nogil:
        cdef Entry *x = &self.ent[e]
        if x.prev >= 0:
            self.ent[x.prev].next = x.next
        else:
            self.head = x.next
        if x.next >= 0:
            self.ent[x.next].prev = x.prev
        else:
            self.tail = x.prev

    cdef inline void _append(self, int32_t e) noexcept nogil:
        self.ent[e].prev = self.tail
        self.ent[e].next = -1
        if self.tail >= 0:
            self.ent[self.tail].next = e
        else:
            self.head = e
        self.tail = e

    cdef inline void _touch(self, int32_t e) noexcept nogil:
        if self.tail != e:
            self._unlink(e)
            self._append(e)

    # ---------------------------------------------------------------- entries
    cdef int32_t _new(self, uint64_t key, int32_t wid) except -1:
        cdef int32_t e
        cdef Entry *grown
        if self.free_head >= 0:
            e = self.free_head
            self.free_head = self.ent[e].next
        else:
            if self.used == self.ent_cap:
                grown = <Entry *>realloc(self.ent, 2 * self.ent_cap * sizeof(Entry))
                if grown == NULL:
                    raise MemoryError()
                self.ent = grown
                self.ent_cap *= 2
            e = self.used
            self.used += 1
        if 2 * (self.nlive + 1) > (1 << self.bits):
            self._grow_table()
        self.ent[e].key = key
        self.ent[e].n = 1
        self.ent[e].cap = 2
        self.ent[e].inl[0] = wid
        self.ent[e].more = NULL
        self._place_key(key, e + 1)
        self._append(e)
        self.nlive += 1
        return e

    cdef void _drop(self, int32_t e) noexcept nogil:
        self._unplace(e)
        self._unlink(e)
        if self.ent[e].cap > 2:
            free(self.ent[e].more)
        self.ent[e].cap = 2
        self.ent[e].n = 0
        self.ent[e].next = self.free_head
        self.free_head = e
        self.nlive -= 1

    cdef int _add_worker(self, int32_t e, int32_t wid) except -1:
        """Add ``wid`` to entry ``e``'s sorted workers; 1 if added, 0 if it was there."""
        cdef Entry *x = &self.ent[e]
        cdef int32_t *ws = _ws(x)
        cdef int32_t i, pos = x.n
        cdef int32_t *grown
        for i in range(x.n):
            if ws[i] == wid:
                return 0
            if ws[i] > wid:
                pos = i
                break
        if x.n == x.cap:
            grown = <int32_t *>malloc(2 * x.cap * sizeof(int32_t))
            if grown == NULL:
                raise MemoryError()
            memcpy(grown, ws, x.n * sizeof(int32_t))
            if x.cap > 2:
                free(x.more)
            x.more = grown
            x.cap *= 2
            ws = grown
        i = x.n
        while i > pos:
            ws[i] = ws[i - 1]
            i -= 1
        ws[pos] = wid
        x.n += 1
        return 1

    cdef int _size_slot(self, int32_t wid) except -1:
        cdef int32_t n = self.nsizes
        cdef int64_t *grown
        if wid < n:
            return 0
        while n <= wid:
            n *= 2
        grown = <int64_t *>realloc(self.sizes, n * sizeof(int64_t))
        if grown == NULL:
            raise MemoryError()
        for i in range(self.nsizes, n):
            grown[i] = 0
        self.sizes = grown
        self.nsizes = n
        return 0

    # ---------------------------------------------------------------- the API
    def match(self, hashes):
        """Per worker, how many leading chunks of ``hashes`` it holds (workers with 0 omitted):
        ``{worker_id: chunks}``, in ascending worker id. Every matched entry becomes most recent."""
        cdef array.array arr = _as_array(hashes)
        cdef const uint64_t *h = <const uint64_t *>arr.data.as_ulonglongs
        cdef Py_ssize_t n = len(arr), d, depth = n
        cdef int32_t e, i, j, k, ncand = 0, nres = 0
        cdef int32_t *ws
        cdef int32_t *cand = NULL
        cdef int32_t *rw = NULL
        cdef int64_t *rd = NULL
        cdef dict out = {}
        if n == 0:
            return out
        self._prefetch_start(h, n)
        try:
            for d in range(n):
                self._prefetch(h, n, d)
                e = self._find(h[d])
                if e < 0:
                    depth = d
                    break
                self._touch(e)
                ws = _ws(&self.ent[e])
                if d == 0:
                    ncand = self.ent[e].n
                    cand = <int32_t *>malloc(ncand * sizeof(int32_t))
                    rw = <int32_t *>malloc(ncand * sizeof(int32_t))
                    rd = <int64_t *>malloc(ncand * sizeof(int64_t))
                    if cand == NULL or rw == NULL or rd == NULL:
                        raise MemoryError()
                    memcpy(cand, ws, ncand * sizeof(int32_t))
                else:
                    j = 0
                    k = 0
                    for i in range(ncand):   # both sorted: keep the candidates e holds too
                        while j < self.ent[e].n and ws[j] < cand[i]:
                            j += 1
                        if j < self.ent[e].n and ws[j] == cand[i]:
                            cand[k] = cand[i]
                            k += 1
                        else:
                            rw[nres] = cand[i]
                            rd[nres] = d
                            nres += 1
                    ncand = k
                if ncand == 0:
                    depth = d
                    break
            for i in range(ncand):
                rw[nres] = cand[i]
                rd[nres] = depth
                nres += 1
            _sort_pairs(rw, rd, nres)
            for i in range(nres):
                out[rw[i]] = rd[i]
            return out
        finally:
            free(cand)
            free(rw)
            free(rd)

    def insert(self, hashes, int32_t worker_id):
        """Record that ``worker_id`` now holds every prefix in ``hashes`` (each becomes most
        recent); then evicts least-recent entries down to ``max_entries``."""
        if worker_id < 0 or worker_id > _MAX_WID:
            raise ValueError(f"worker id {worker_id} out of [0, {MAX_WORKER_ID}]")
        cdef array.array arr = _as_array(hashes)
        cdef const uint64_t *h = <const uint64_t *>arr.data.as_ulonglongs
        cdef Py_ssize_t n = len(arr), d
        cdef int32_t e, i
        cdef int32_t *ws
        self._size_slot(worker_id)
        self._prefetch_start(h, n)
        for d in range(n):
            self._prefetch(h, n, d)
            e = self._find(h[d])
            if e < 0:
                self._new(h[d], worker_id)
                self.sizes[worker_id] += 1
            else:
                self._touch(e)
                self.sizes[worker_id] += self._add_worker(e, worker_id)
        while self.nlive > self.max_entries:
            e = self.head
            ws = _ws(&self.ent[e])
            for i in range(self.ent[e].n):
                self.sizes[ws[i]] -= 1
            self._drop(e)

    def size(self, int64_t worker_id):
        """How many prefix chunks ``worker_id`` holds (SGLang's "tenant size")."""
        if worker_id < 0 or worker_id >= self.nsizes:
            return 0
        return self.sizes[worker_id]

    def remove_worker(self, int64_t worker_id):
        """Forget everything about ``worker_id`` (it left or restarted with an empty cache)."""
        if worker_id < 0 or worker_id >= self.nsizes or self.sizes[worker_id] == 0:
            return
        self.sizes[worker_id] = 0
        cdef int32_t e = self.head, nxt, i, j
        cdef int32_t wid = <int32_t>worker_id
        cdef int32_t *ws
        while e >= 0:
            nxt = self.ent[e].next
            ws = _ws(&self.ent[e])
            j = 0
            for i in range(self.ent[e].n):
                if ws[i] != wid:
                    ws[j] = ws[i]
                    j += 1
            self.ent[e].n = j
            if j == 0:
                self._drop(e)
            e = nxt


cdef array.array _as_array(object hashes):
    """``hashes`` as an ``array('Q')`` (itself if it is one): what chain_hashes returns, or any
    iterable of ints in [0, 2**64)."""
    if type(hashes) is _array.array and hashes.typecode == "Q":
        return <array.array>hashes
    return _array.array("Q", hashes)


cdef void _sort_pairs(int32_t *w, int64_t *d, int32_t n) noexcept nogil:
    """Insertion sort of (w, d) pairs by w (n is the number of workers holding a prefix: small)."""
    cdef int32_t i, j, kw
    cdef int64_t kd
    for i in range(1, n):
        kw = w[i]
        kd = d[i]
        j = i - 1
        while j >= 0 and w[j] > kw:
            w[j + 1] = w[j]
            d[j + 1] = d[j]
            j -= 1
        w[j + 1] = kw
        d[j + 1] = kd
