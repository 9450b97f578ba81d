# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""dplb_shm._native: the segment (csrc/dplb_shm.h) and scoring kernel (csrc/dplb_kernel.h) for Python.

Import it through :mod:`dplb_shm`, which checks that this build matches the sources on disk.
Layout, seqlock protocol and the scoring formula are documented in the two headers.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset, memcpy
from libc.stdlib cimport malloc, free
from libc.math cimport isfinite
from cpython.list cimport PyList_GET_SIZE, PyList_GET_ITEM
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

from dplb_native cimport *

import operator
import os

import posix_ipc

from dplb_shm.errors import (LayoutMismatchError, SegmentClosedError, SegmentError,
                             SegmentExistsError, SegmentNotFoundError, SlotFieldError,
                             SlotIndexError)
from dplb_shm.types import ScoreTerms, ScoringParams, WorkerSnapshot, WorkerState

cdef extern from *:
    """
    #ifndef DPLB_SOURCE_SHA256
    #define DPLB_SOURCE_SHA256 "unknown"
    #endif
    """
    const char *DPLB_SOURCE_SHA256

cdef extern from "<string.h>" nogil:
    size_t strnlen(const char *s, size_t maxlen)

MAGIC = DPLB_MAGIC
LAYOUT_VERSION = DPLB_LAYOUT_VERSION
HEADER_SIZE = DPLB_HEADER_SIZE
SLOT_SIZE = DPLB_SLOT_SIZE
MAX_SLOTS = DPLB_MAX_SLOTS
WINDOW = DPLB_WINDOW
HIST_BINS = DPLB_HIST_BINS
MAX_GPUS = DPLB_MAX_GPUS
UNIX_PATH_MAX = DPLB_UNIX_PATH_MAX
ENDPOINT_MAX = DPLB_ENDPOINT_LEN - 1
MODEL_MAX = DPLB_MODEL_LEN - 1
HOT_END = DPLB_HOT_END
DATA_END = DPLB_DATA_END
SOURCE_SHA256 = DPLB_SOURCE_SHA256.decode("ascii")


cdef uint64_t _fork_gen = 0


def _after_fork_in_child():
    global _fork_gen
    _fork_gen += 1


# A router that attaches and then forks its workers must not hand every child the same
# tie-breaking sequence (they would pile onto the same worker): reseed after a fork.
os.register_at_fork(after_in_child=_after_fork_in_child)


cdef uint64_t _urandom64():
    return <uint64_t>int.from_bytes(os.urandom(8), "little")


cdef dict _table(const dplb_field_t *t):
    cdef dict out = {}
    cdef int i = 0
    while t[i].name != NULL:
        out[t[i].name.decode("ascii")] = (t[i].offset, t[i].size)
        i += 1
    return out


def offsets():
    """``offsetof``/``sizeof`` of every field as compiled from csrc/dplb_shm.h.

    Returns ``{"header": {field: (offset, size)}, "slot": {...}, "router": {...}}`` (bytes).
    """
    return {"header": _table(dplb_header_fields), "slot": _table(dplb_slot_fields),
            "router": _table(dplb_router_fields)}


def now_ns():
    """CLOCK_MONOTONIC in ns, the clock of ``heartbeat_ns`` (same as ``time.monotonic_ns()``)."""
    return dplb_now_ns()


def len_bin(int64_t n):
    """Histogram bin of a prompt length: floor(log2 n) clipped to [0, 31]; 0 for n <= 1."""
    return dplb_len_bin(n)


def length_compat(hist, int b):
    """The kernel's length compatibility of a prompt in bin ``b`` with histogram ``hist`` (32 counts)."""
    cdef uint32_t h[32]
    cdef int k
    vals = list(hist)
    if len(vals) != DPLB_HIST_BINS or not 0 <= b < DPLB_HIST_BINS:
        raise SlotFieldError("length_compat wants 32 counts and a bin in 0..31", field="prompt_len_hist")
    for k in range(DPLB_HIST_BINS):
        h[k] = <uint32_t>_i(vals[k], "prompt_len_hist", 0, 2**32 - 1)
    return dplb_length_compat(h, b)


cdef str _posix_name(name):
    if not isinstance(name, str) or not name:
        raise SegmentError(f"segment name must be a non-empty string, got {name!r}", name=None)
    n = name[1:] if name.startswith("/") else name
    if not n or "/" in n or len(n) > 250 or "\0" in n:
        raise SegmentError(f"bad segment name {name!r}: want a POSIX shm name like 'dplb-30000'",
                           name=str(name))
    return n


cdef inline double _f(v, str field) except? -1.0:
    cdef double d
    if isinstance(v, (str, bytes, bool)):
        raise SlotFieldError(f"{field} must be a number, got {v!r}", field=field)
    try:
        d = float(v)
    except (TypeError, ValueError):
        raise SlotFieldError(f"{field} must be a number, got {v!r}", field=field)
    if not isfinite(d):
        raise SlotFieldError(f"{field} must be finite, got {v!r}", field=field)
    return d


cdef inline int64_t _i(v, str field, int64_t lo, int64_t hi) except? -1:
    if isinstance(v, bool):
        raise SlotFieldError(f"{field} must be an integer, got {v!r}", field=field)
    if isinstance(v, float):
        if not v.is_integer():
            raise SlotFieldError(f"{field} must be an integer, got {v!r}", field=field)
        v = int(v)
    else:
        try:
            v = operator.index(v)
        except TypeError:
            raise SlotFieldError(f"{field} must be an integer, got {v!r}", field=field) from None
    if v < lo or v > hi:
        raise SlotFieldError(f"{field} must be in [{lo}, {hi}], got {v}", field=field)
    return <int64_t>v


cdef void _set_str(char *dst, size_t cap, s, str field) except *:
    if not isinstance(s, str):
        raise SlotFieldError(f"{field} must be a string, got {s!r}", field=field)
    b = (<str>s).encode("utf-8")
    if len(b) >= cap:
        raise SlotFieldError(f"{field} is {len(b)} bytes, at most {cap - 1} fit", field=field)
    if b"\0" in b:
        raise SlotFieldError(f"{field} must not contain NUL", field=field)
    memset(dst, 0, cap)
    memcpy(dst, <const char *>b, len(b))


cdef str _get_str(const char *src, size_t cap):
    cdef size_t n = strnlen(src, cap)
    return src[:n].decode("utf-8", "replace")


cdef void _empty_slot(dplb_slot_t *s, int32_t worker_id) noexcept nogil:
    """Fields of an EMPTY slot: zeros, with 'unknown' (-1) where 0 would be a real value."""
    memset(<char *>s + 8, 0, DPLB_DATA_END - 8)
    s.worker_id = worker_id
    s.state = DPLB_STATE_EMPTY
    s.weight = 1.0
    s.kv_cache_usage = -1.0
    s.gpu_mem_used_bytes = -1
    s.gpu_mem_total_bytes = -1
    s.ttft_ms = -1.0
    s.tpot_ms = -1.0
    s.e2e_ms = -1.0
    s.ttft_p99_ms = -1.0
    s.tpot_p99_ms = -1.0
    s.e2e_p99_ms = -1.0
    dplb_refresh_compat(s)


cdef object _snapshot(const dplb_slot_t *s, int64_t rinfl, uint64_t disp, int32_t circuit, int64_t now):
    cdef int ng = s.num_gpus
    if ng < 0:
        ng = 0
    if ng > DPLB_MAX_GPUS:
        ng = DPLB_MAX_GPUS
    try:
        state = WorkerState(s.state)
    except ValueError:
        state = WorkerState.DEAD
    return WorkerSnapshot(
        worker_id=s.worker_id, state=state, pid=s.pid,
        endpoint=_get_str(s.endpoint, DPLB_ENDPOINT_LEN), model=_get_str(s.model, DPLB_MODEL_LEN),
        gpu_ids=[s.gpu_ids[k] for k in range(ng)], weight=s.weight,
        heartbeat_ns=s.heartbeat_ns,
        heartbeat_age_ms=(now - s.heartbeat_ns) / 1e6 if s.heartbeat_ns > 0 else -1.0,
        num_running=s.num_running, num_waiting=s.num_waiting, inflight=s.inflight,
        router_inflight=rinfl, dispatched=disp,
        queued_prompt_tokens=s.queued_prompt_tokens, max_num_seqs=s.max_num_seqs,
        kv_cache_usage=s.kv_cache_usage, gpu_mem_used_bytes=s.gpu_mem_used_bytes,
        gpu_mem_total_bytes=s.gpu_mem_total_bytes, ttft_ms=s.ttft_ms, tpot_ms=s.tpot_ms,
        e2e_ms=s.e2e_ms, ttft_p99_ms=s.ttft_p99_ms, tpot_p99_ms=s.tpot_p99_ms,
        e2e_p99_ms=s.e2e_p99_ms, prompt_len_hist=[s.prompt_len_hist[k] for k in range(DPLB_HIST_BINS)],
        completed=s.completed, failed=s.failed, circuit=circuit, seq=s.seq)


cdef class Segment:
    """A mapped DPLB segment. Build with :meth:`create` or :meth:`attach`, never directly.

    Every method raises :class:`SegmentClosedError` after :meth:`close`, and
    :class:`SlotIndexError` for a slot outside ``0..num_slots-1``.
    """

    cdef char *base
    cdef size_t size
    cdef readonly uint32_t num_slots
    cdef readonly str name
    cdef readonly bint readonly
    cdef uint64_t rng
    cdef uint64_t rng_fork_gen
    cdef double *scores
    cdef double *aff
    cdef dplb_terms_t *terms
    cdef object params_obj
    cdef dplb_params_t params

    def __cinit__(self):
        self.base = NULL
        self.scores = NULL
        self.aff = NULL
        self.terms = NULL
        self.params_obj = None
        self.rng = _urandom64()
        self.rng_fork_gen = _fork_gen

    def __dealloc__(self):
        self._unmap()

    cdef void _unmap(self) noexcept:
        if self.base != NULL:
            munmap(self.base, self.size)
            self.base = NULL
        free(self.scores)
        free(self.aff)
        free(self.terms)
        self.scores = NULL
        self.aff = NULL
        self.terms = NULL

    cdef int _map(self, int fd, size_t size, bint readonly) except -1:
        cdef int prot = PROT_READ if readonly else PROT_READ | PROT_WRITE
        cdef void *p = mmap(NULL, size, prot, MAP_SHARED, fd, 0)
        if p == MAP_FAILED:
            raise SegmentError(f"mmap of segment {self.name} failed", name=self.name)
        self.base = <char *>p
        self.size = size
        self.readonly = readonly
        return 0

    cdef int _alloc(self) except -1:
        cdef size_t n = self.num_slots if self.num_slots > 0 else 1
        self.scores = <double *>malloc(n * sizeof(double))
        self.aff = <double *>malloc(n * sizeof(double))
        self.terms = <dplb_terms_t *>malloc(n * sizeof(dplb_terms_t))
        if self.scores == NULL or self.aff == NULL or self.terms == NULL:
            raise MemoryError()
        return 0

    @staticmethod
    def create(name, int num_slots=64, bint replace=False):
        """Create the segment ``/dev/shm/<name>`` (mode 0600) with ``num_slots`` EMPTY slots.

        ``name``: POSIX shm name with or without the leading slash. Raises
        :class:`SegmentExistsError` if it exists and ``replace`` is false (with ``replace`` the old
        one is unlinked first; processes still attached to it keep the old mapping), and
        :class:`SlotFieldError` for ``num_slots`` outside 1..4096.
        """
        cdef Segment seg = Segment.__new__(Segment)
        cdef dplb_header_t *h
        cdef dplb_slot_t tmp
        cdef uint32_t i
        seg.name = _posix_name(name)
        if num_slots < 1 or num_slots > DPLB_MAX_SLOTS:
            raise SlotFieldError(f"num_slots must be in 1..{DPLB_MAX_SLOTS}, got {num_slots}",
                                 field="num_slots", name=seg.name)
        size = DPLB_HEADER_SIZE + <size_t>num_slots * DPLB_SLOT_SIZE
        if replace:
            try:
                posix_ipc.unlink_shared_memory("/" + seg.name)
            except posix_ipc.ExistentialError:
                pass
        try:
            shm = posix_ipc.SharedMemory("/" + seg.name, posix_ipc.O_CREX, mode=0o600, size=size)
        except posix_ipc.ExistentialError:
            raise SegmentExistsError(f"segment {seg.name} already exists (use replace=True / --replace)",
                                     name=seg.name, reason="exists") from None
        except (posix_ipc.PermissionsError, OSError, ValueError) as e:
            raise SegmentError(f"cannot create segment {seg.name}: {e}", name=seg.name) from e
        try:
            os.fchmod(shm.fd, 0o600)
            seg._map(shm.fd, size, False)
        finally:
            shm.close_fd()
        seg.num_slots = num_slots
        seg._alloc()
        h = <dplb_header_t *>seg.base
        h.version = DPLB_LAYOUT_VERSION
        h.num_slots = num_slots
        h.slot_size = DPLB_SLOT_SIZE
        h.header_size = DPLB_HEADER_SIZE
        h.created_ns = dplb_realtime_ns()
        h.generation = 0
        h.creator_pid = os.getpid()
        for i in range(<uint32_t>num_slots):
            _empty_slot(&tmp, <int32_t>i)
            tmp.seq = 0
            dplb_seqlock_write(dplb_slot_at(seg.base, i), &tmp)
        dplb_magic_set(h, DPLB_MAGIC)   # last, with release: a reader seeing it sees the rest
        return seg

    @staticmethod
    def attach(name, bint readonly=False):
        """Map an existing segment. ``readonly`` maps it PROT_READ (no writers, no router atomics).

        Raises :class:`SegmentNotFoundError` if there is none, :class:`LayoutMismatchError`
        (message names the segment's and this build's layout versions) on wrong magic, version,
        slot size or a truncated file.
        """
        cdef Segment seg = Segment.__new__(Segment)
        cdef dplb_header_t *h
        seg.name = _posix_name(name)
        try:
            shm = posix_ipc.SharedMemory("/" + seg.name, 0, read_only=readonly)
        except posix_ipc.ExistentialError:
            raise SegmentNotFoundError(f"no segment {seg.name} in /dev/shm", name=seg.name,
                                       reason="not found") from None
        except (posix_ipc.PermissionsError, OSError) as e:
            raise SegmentError(f"cannot open segment {seg.name}: {e}", name=seg.name) from e
        try:
            size = os.fstat(shm.fd).st_size
            if size < DPLB_HEADER_SIZE:
                raw = os.pread(shm.fd, 12, 0) if size else b""
                magic = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else 0
                version = int.from_bytes(raw[8:12], "little") if len(raw) >= 12 else 0
                raise _mismatch(seg.name, magic, version, f"file is {size} bytes")
            seg._map(shm.fd, size, readonly)
        finally:
            shm.close_fd()
        h = <dplb_header_t *>seg.base
        magic = dplb_magic_get(h)
        if magic != DPLB_MAGIC or h.version != DPLB_LAYOUT_VERSION:
            version = h.version
            seg._unmap()
            raise _mismatch(seg.name, magic, version, None)
        if (h.slot_size != DPLB_SLOT_SIZE or h.header_size != DPLB_HEADER_SIZE
                or h.num_slots > DPLB_MAX_SLOTS
                or size < DPLB_HEADER_SIZE + <size_t>h.num_slots * DPLB_SLOT_SIZE):
            detail = f"slot_size {h.slot_size}, {h.num_slots} slots in {size} bytes"
            seg._unmap()
            raise _mismatch(seg.name, magic, DPLB_LAYOUT_VERSION, detail)
        seg.num_slots = h.num_slots
        seg._alloc()
        return seg

    cdef inline int _check(self, int slot) except -1:
        if self.base == NULL:
            raise SegmentClosedError(f"segment {self.name} is closed", name=self.name)
        if slot < 0 or <uint32_t>slot >= self.num_slots:
            raise SlotIndexError(f"slot {slot} outside 0..{self.num_slots - 1} of segment {self.name}",
                                 name=self.name, slot=slot)
        return 0

    cdef inline int _check_open(self) except -1:
        if self.base == NULL:
            raise SegmentClosedError(f"segment {self.name} is closed", name=self.name)
        return 0

    cdef inline int _check_writable(self) except -1:
        if self.readonly:
            raise SegmentError(f"segment {self.name} is attached read-only", name=self.name)
        return 0

    @property
    def closed(self):
        """True after :meth:`close`."""
        return self.base == NULL

    @property
    def generation(self):
        """Membership counter: bumped by every claim and release."""
        self._check_open()
        return dplb_generation_get(<dplb_header_t *>self.base)

    @property
    def version(self):
        """Layout version stored in the header."""
        self._check_open()
        return (<dplb_header_t *>self.base).version

    @property
    def created_ns(self):
        """CLOCK_REALTIME ns when the segment was created."""
        self._check_open()
        return (<dplb_header_t *>self.base).created_ns

    @property
    def creator_pid(self):
        """pid of the process that created the segment."""
        self._check_open()
        return (<dplb_header_t *>self.base).creator_pid

    def close(self):
        """Unmap the segment (idempotent). Writers made from it stop working."""
        self._unmap()

    def unlink(self):
        """Remove ``/dev/shm/<name>``; mappings stay valid until closed.

        Raises :class:`SegmentNotFoundError` if it is already gone.
        """
        try:
            posix_ipc.unlink_shared_memory("/" + self.name)
        except posix_ipc.ExistentialError:
            raise SegmentNotFoundError(f"no segment {self.name} in /dev/shm", name=self.name,
                                       reason="not found") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.base == NULL else f"{self.num_slots} slots"
        return f"<dplb_shm.Segment {self.name!r} {state}>"

    def seed(self, uint64_t seed):
        """Seed the kernel's tie-breaking generator (splitmix64); for reproducible tests.

        Each mapping starts from ``os.urandom`` and a forked child reseeds itself from it.
        """
        self.rng = seed
        self.rng_fork_gen = _fork_gen

    cdef inline double _draw(self, rng_u) except? -1.0:
        if rng_u is not None:
            return <double>rng_u
        if self.rng_fork_gen != _fork_gen:
            self.rng = _urandom64()
            self.rng_fork_gen = _fork_gen
        return dplb_rng_u(&self.rng)

    def read_slot(self, int slot):
        """One slot as a :class:`WorkerSnapshot`, consistent under the seqlock.

        A slot whose writer died inside a write (sequence odd for 10^6 spins) reads as EMPTY.
        """
        cdef dplb_slot_t s
        cdef const dplb_slot_t *src
        self._check(slot)
        src = dplb_slot_at(self.base, slot)
        if dplb_seqlock_read(src, &s, DPLB_DATA_END, DPLB_READ_MAX_SPINS) < 0:
            _empty_slot(&s, slot)
        return _snapshot(&s, dplb_router_inflight_get(src), dplb_dispatched_get(src),
                         dplb_circuit_get(src), dplb_now_ns())

    def snapshot(self):
        """Every slot (EMPTY ones included) as a list of :class:`WorkerSnapshot`, index == slot."""
        self._check_open()
        return [self.read_slot(i) for i in range(self.num_slots)]

    def writer(self, int slot, double latency_window_s=10.0):
        """The :class:`SlotWriter` of ``slot``, starting from the slot's current content.

        ``latency_window_s``: latency samples older than this leave the window summaries
        (default 10 s: DESIGN.md ``routing_policy.latency_window_sec``); 0 keeps the last 32
        samples whatever their age. Exactly one writer per slot may exist across all processes
        (its agent, or the router for a remote mirror); the seqlock does not protect writers
        from each other.
        """
        self._check(slot)
        self._check_writable()
        if not latency_window_s >= 0 or not isfinite(latency_window_s):
            raise SlotFieldError(f"latency_window_s must be >= 0, got {latency_window_s}",
                                 field="latency_window_s", name=self.name)
        return SlotWriter._new(self, slot, <int64_t>(latency_window_s * 1e9))

    # ---- router-side atomics (outside the seqlock) ----------------------------------------

    def router_inflight_add(self, int slot, int64_t delta):
        """Atomically add ``delta`` to the slot's router in-flight count; returns the new value."""
        self._check(slot)
        self._check_writable()
        return dplb_router_inflight_add(dplb_slot_at(self.base, slot), delta)

    def dispatched_add(self, int slot, int64_t n=1):
        """Atomically add ``n`` (>= 0) to the slot's dispatched total; returns the new value."""
        self._check(slot)
        self._check_writable()
        if n < 0:
            raise SlotFieldError("dispatched_add: n must be >= 0", field="n", name=self.name)
        return dplb_dispatched_add(dplb_slot_at(self.base, slot), <uint64_t>n)

    def circuit_set(self, int slot, int state):
        """Store the slot's circuit state: 0 closed, 1 open, 2 half-open."""
        self._check(slot)
        self._check_writable()
        if state < 0 or state > 2:
            raise SlotFieldError(f"circuit must be 0, 1 or 2, got {state}", field="circuit", name=self.name)
        dplb_circuit_set(dplb_slot_at(self.base, slot), state)

    def circuit_get(self, int slot):
        """The slot's circuit state (0 closed, 1 open, 2 half-open)."""
        self._check(slot)
        return dplb_circuit_get(dplb_slot_at(self.base, slot))

    def router_inflight_get(self, int slot):
        """The slot's router in-flight count."""
        self._check(slot)
        return dplb_router_inflight_get(dplb_slot_at(self.base, slot))

    # ---- kernel ----------------------------------------------------------------------------

    cdef int _load(self, params, affinity, uint32_t *n_aff) except -1:
        cdef Py_ssize_t n, j
        if params is not self.params_obj:
            if not isinstance(params, ScoringParams):
                raise SlotFieldError(f"params must be a ScoringParams, got {type(params).__name__}",
                                     field="params")
            self.params.w_pending = params.w_pending
            self.params.w_kv = params.w_kv
            self.params.w_latency = params.w_latency
            self.params.w_length = params.w_length
            self.params.max_queue = params.max_queue
            self.params.kv_cache_threshold = params.kv_cache_threshold
            self.params.heartbeat_timeout_ms = params.heartbeat_timeout_ms
            self.params.latency_scale_ms = params.latency_scale_ms
            self.params_obj = params
        if affinity is None:
            n_aff[0] = 0
            return 0
        if not isinstance(affinity, list):
            affinity = list(affinity)
        n = PyList_GET_SIZE(affinity)
        if n > self.num_slots:
            raise SlotFieldError(f"affinity has {n} entries, segment has {self.num_slots} slots",
                                 field="affinity", name=self.name)
        for j in range(n):
            self.aff[j] = <double>(<object>PyList_GET_ITEM(affinity, j))
            if not isfinite(self.aff[j]):
                raise SlotFieldError(f"affinity[{j}] must be finite", field="affinity", name=self.name)
        n_aff[0] = <uint32_t>n
        return 0

    def pick(self, params, int64_t prompt_len=0, affinity=None, now_ns=None, rng_u=None):
        """Choose a worker: read every slot once, score the eligible ones, break ties at random.

        ``params``: :class:`ScoringParams`; ``prompt_len``: prompt tokens (for the length term);
        ``affinity``: per-slot bonus added to the score (sequence of finite floats, at most
        num_slots long, missing entries 0); ``now_ns``/``rng_u``: override the clock and the
        tie-breaking draw in [0, 1) (tests). Returns the slot index, or -1 when none is eligible.
        Formula: csrc/dplb_kernel.h.
        """
        cdef uint32_t n_aff
        cdef int64_t now
        cdef double u
        self._check_open()
        self._load(params, affinity, &n_aff)
        now = dplb_now_ns() if now_ns is None else <int64_t>now_ns
        u = self._draw(rng_u)
        return dplb_pick(self.base, self.num_slots, &self.params, prompt_len,
                         self.aff if n_aff else NULL, n_aff, now, u, self.scores, NULL, NULL)

    def pick_explain(self, params, int64_t prompt_len=0, affinity=None, now_ns=None, rng_u=None):
        """Like :meth:`pick`, also returning the :class:`ScoreTerms` of every eligible worker.

        Returns ``(chosen, terms)``; ``terms`` is in slot order, empty when none is eligible.
        """
        cdef uint32_t n_aff
        cdef int64_t now
        cdef double u
        cdef int nt = 0, k, chosen
        cdef dplb_terms_t *t
        self._check_open()
        self._load(params, affinity, &n_aff)
        now = dplb_now_ns() if now_ns is None else <int64_t>now_ns
        u = self._draw(rng_u)
        chosen = dplb_pick(self.base, self.num_slots, &self.params, prompt_len,
                           self.aff if n_aff else NULL, n_aff, now, u, self.scores, self.terms, &nt)
        out = []
        for k in range(nt):
            t = &self.terms[k]
            out.append(ScoreTerms(worker_id=t.worker_id, score=t.score, pending=t.pending,
                                  pending_term=t.pending_term, kv_term=t.kv_term,
                                  latency_term=t.latency_term, length_term=t.length_term,
                                  affinity=t.affinity, weight=t.weight))
        return chosen, out

    # ---- diagnostics ---------------------------------------------------------------------------

    def check_reads(self, int slot, long n_reads, bint locked=True):
        """Self-test of the seqlock: read ``slot`` ``n_reads`` times (full data, native loop) and
        check that every read carries one value in all fields, as written by
        :meth:`SlotWriter.fill_pattern`. Returns ``(torn, retries, distinct_values)``.
        ``locked=False`` copies without the seqlock (the control that shows tears are detected).
        """
        cdef dplb_slot_t s
        cdef const dplb_slot_t *src
        cdef long i, torn = 0, retries = 0, distinct = 0
        cdef int r, k
        cdef int64_t v, last = -1
        cdef bint bad
        self._check(slot)
        src = dplb_slot_at(self.base, slot)
        with nogil:
            for i in range(n_reads):
                if locked:
                    r = dplb_seqlock_read(src, &s, DPLB_DATA_END, DPLB_READ_MAX_SPINS)
                else:
                    memcpy(&s, src, DPLB_DATA_END)
                    r = 0
                if r < 0:
                    torn += 1
                    continue
                retries += r
                v = s.num_running
                bad = (s.num_waiting != v or s.inflight != v or s.max_num_seqs != v
                       or s.pid != v or s.queued_prompt_tokens != v or s.heartbeat_ns != v
                       or s.gpu_mem_used_bytes != v or s.gpu_mem_total_bytes != v
                       or s.weight != <double>v or s.kv_cache_usage != <double>v
                       or s.ttft_ms != <double>v or s.tpot_ms != <double>v or s.e2e_ms != <double>v
                       or s.ttft_p99_ms != <double>v or s.tpot_p99_ms != <double>v
                       or s.e2e_p99_ms != <double>v or s.completed != <uint64_t>v
                       or s.failed != <uint64_t>v or s.ttft_n != <uint32_t>v
                       or s.tpot_n != <uint32_t>v or s.e2e_n != <uint32_t>v
                       or s.num_gpus != (v & 15) or s.state != (v & 3))
                for k in range(DPLB_HIST_BINS):
                    bad = bad or s.prompt_len_hist[k] != <uint32_t>v or s.length_compat[k] != <double>v
                for k in range(DPLB_WINDOW):
                    bad = bad or s.ttft_ring[k] != <float>(v & 0xFFFFFF)
                    bad = bad or s.tpot_ring[k] != <float>(v & 0xFFFFFF)
                    bad = bad or s.e2e_ring[k] != <float>(v & 0xFFFFFF)
                for k in range(DPLB_MAX_GPUS):
                    bad = bad or s.gpu_ids[k] != <int16_t>(v & 0x7FFF)
                for k in range(DPLB_ENDPOINT_LEN):
                    bad = bad or s.endpoint[k] != <char>(65 + (v % 26))
                for k in range(DPLB_MODEL_LEN):
                    bad = bad or s.model[k] != <char>(65 + (v % 26))
                if bad:
                    torn += 1
                if v != last:
                    distinct += 1
                    last = v
        return torn, retries, distinct


cdef object _mismatch(str name, uint64_t magic, uint32_t version, detail):
    if magic != DPLB_MAGIC:
        msg = (f"segment {name}: not a DPLB layout (magic 0x{magic:016x}, version {version}); "
               f"this build expects magic 0x{DPLB_MAGIC:016x}, layout version {DPLB_LAYOUT_VERSION}")
    else:
        msg = (f"segment {name}: layout version {version}, this build expects layout version "
               f"{DPLB_LAYOUT_VERSION}")
    if detail:
        msg += f" ({detail})"
    return LayoutMismatchError(msg, name=name, found_magic=magic, found_version=version,
                               expected_version=DPLB_LAYOUT_VERSION)


cdef extern from "<stdint.h>" nogil:
    const int64_t INT64_MAX_ "INT64_MAX"


cdef int64_t _summarize(const float *ring, const int64_t *ts, uint32_t n, int64_t now, int64_t window_ns,
                        double *mean, double *p99) noexcept:
    """Mean and nearest-rank p99 of the samples of a DPLB_WINDOW ring that are at most
    ``window_ns`` old (all of them when ``window_ns`` is 0); -1 for both when none is left.
    Returns the CLOCK_MONOTONIC ns at which the oldest counted sample expires (INT64_MAX if never).
    """
    cdef float buf[32]
    cdef int cnt = 0, total, i, j, rank
    cdef float x
    cdef double acc = 0.0
    cdef int64_t expiry = INT64_MAX_
    total = n if n < <uint32_t>DPLB_WINDOW else DPLB_WINDOW
    for i in range(total):
        if window_ns > 0:
            if ts[i] <= 0 or now - ts[i] > window_ns:
                continue
            if ts[i] + window_ns < expiry:
                expiry = ts[i] + window_ns
        buf[cnt] = ring[i]
        acc += ring[i]
        cnt += 1
    if cnt == 0:
        mean[0] = -1.0
        p99[0] = -1.0
        return INT64_MAX_
    mean[0] = acc / cnt
    for i in range(1, cnt):          # insertion sort: at most 32 samples
        x = buf[i]
        j = i - 1
        while j >= 0 and buf[j] > x:
            buf[j + 1] = buf[j]
            j -= 1
        buf[j + 1] = x
    rank = (99 * cnt + 99) // 100    # nearest rank: ceil(0.99 * cnt)
    p99[0] = buf[rank - 1]
    return expiry


cdef class SlotWriter:
    """The single writer of one slot. Keeps a private copy and publishes it whole under the seqlock.

    Every write refreshes ``heartbeat_ns`` unless told otherwise. Not thread-safe: use it from one
    thread (the agent's event loop). Field errors raise :class:`SlotFieldError` and leave the
    slot unchanged; a closed segment raises :class:`SegmentClosedError`.
    """

    cdef Segment seg
    cdef dplb_slot_t *slot
    cdef dplb_slot_t st
    cdef readonly int slot_index
    # private (not in the segment): when each ring sample was pushed, for the time window
    cdef int64_t ts_ttft[32]
    cdef int64_t ts_tpot[32]
    cdef int64_t ts_e2e[32]
    cdef bint fed[3]              # ring fed by record_latency (its summary is ours to expire)
    cdef int64_t window_ns
    cdef int64_t next_expiry

    @staticmethod
    cdef SlotWriter _new(Segment seg, int slot, int64_t window_ns):
        cdef SlotWriter w = SlotWriter.__new__(SlotWriter)
        w.seg = seg
        w.slot_index = slot
        w.window_ns = window_ns
        w._forget_samples()
        w.slot = dplb_slot_at(seg.base, slot)
        if dplb_seqlock_read(w.slot, &w.st, DPLB_DATA_END, DPLB_READ_MAX_SPINS) < 0:
            _empty_slot(&w.st, slot)
        w.st.worker_id = slot
        return w

    cdef inline int _live(self) except -1:
        if self.seg.base == NULL:
            raise SegmentClosedError(f"segment {self.seg.name} is closed", name=self.seg.name)
        return 0

    cdef inline void _write(self) noexcept:
        dplb_seqlock_write(self.slot, &self.st)

    cdef inline void _write_now(self) noexcept:
        cdef int64_t now = dplb_now_ns()
        self.st.heartbeat_ns = now
        if now >= self.next_expiry:
            self._resummarize(now)
        dplb_seqlock_write(self.slot, &self.st)

    cdef void _forget_samples(self) noexcept:
        memset(self.ts_ttft, 0, sizeof(self.ts_ttft))
        memset(self.ts_tpot, 0, sizeof(self.ts_tpot))
        memset(self.ts_e2e, 0, sizeof(self.ts_e2e))
        self.fed[0] = self.fed[1] = self.fed[2] = False
        self.next_expiry = INT64_MAX_

    cdef void _resummarize(self, int64_t now) noexcept:
        """Recompute the summaries of the rings this writer feeds, dropping expired samples."""
        cdef int64_t e, nxt = INT64_MAX_
        if self.fed[0]:
            e = _summarize(self.st.ttft_ring, self.ts_ttft, self.st.ttft_n, now, self.window_ns,
                           &self.st.ttft_ms, &self.st.ttft_p99_ms)
            nxt = e if e < nxt else nxt
        if self.fed[1]:
            e = _summarize(self.st.tpot_ring, self.ts_tpot, self.st.tpot_n, now, self.window_ns,
                           &self.st.tpot_ms, &self.st.tpot_p99_ms)
            nxt = e if e < nxt else nxt
        if self.fed[2]:
            e = _summarize(self.st.e2e_ring, self.ts_e2e, self.st.e2e_n, now, self.window_ns,
                           &self.st.e2e_ms, &self.st.e2e_p99_ms)
            nxt = e if e < nxt else nxt
        self.next_expiry = nxt

    @property
    def latency_window_s(self):
        """Age (s) after which a latency sample leaves the window summaries; 0 = count-only."""
        return self.window_ns / 1e9

    def claim(self, int worker_id, pid=None, endpoint="", gpu_ids=(), weight=1.0, model="",
              max_num_seqs=0):
        """Take the slot for a (re)started worker: all fields reset, state STARTING, generation bumped.

        ``worker_id`` must equal the slot index. ``endpoint``: Unix socket path (absolute, at
        most 107 bytes) or ``host:port``; ``gpu_ids``: at most 16; ``model``: at most 119 bytes
        UTF-8. Router atomics (router_inflight, dispatched, circuit) are left as they are.
        """
        cdef dplb_slot_t tmp
        self._live()
        if worker_id != self.slot_index:
            raise SlotFieldError(f"worker_id {worker_id} must equal the slot index {self.slot_index}",
                                 field="worker_id", name=self.seg.name)
        _empty_slot(&tmp, self.slot_index)
        tmp.seq = self.st.seq
        _apply(&tmp, {"pid": os.getpid() if pid is None else pid, "endpoint": endpoint,
                      "gpu_ids": gpu_ids, "weight": weight, "model": model,
                      "max_num_seqs": max_num_seqs, "state": WorkerState.STARTING})
        memcpy(&self.st, &tmp, sizeof(dplb_slot_t))
        self._forget_samples()
        self._write_now()
        dplb_generation_bump(<dplb_header_t *>self.seg.base)

    def publish(self, **fields):
        """Set the given fields and publish them in one seqlock write (heartbeat refreshed unless
        ``heartbeat_ns`` is among them).

        Fields: state, pid, endpoint, model, gpu_ids, weight, num_running, num_waiting, inflight,
        queued_prompt_tokens, max_num_seqs, kv_cache_usage (0..1, above 1 stored as 1, or -1), gpu_mem_used_bytes,
        gpu_mem_total_bytes, ttft_ms, tpot_ms, e2e_ms, ttft_p99_ms, tpot_p99_ms, e2e_p99_ms
        (set the window summaries directly, e.g. a router mirroring a remote agent),
        prompt_len_hist (32 counts), completed, failed, heartbeat_ns. Unknown names raise
        :class:`SlotFieldError`.
        """
        cdef dplb_slot_t tmp
        self._live()
        memcpy(&tmp, &self.st, sizeof(dplb_slot_t))
        _apply(&tmp, fields)
        memcpy(&self.st, &tmp, sizeof(dplb_slot_t))
        # summaries set directly (a mirror of a remote agent) are no longer ours to expire
        if "ttft_ms" in fields or "ttft_p99_ms" in fields:
            self.fed[0] = False
        if "tpot_ms" in fields or "tpot_p99_ms" in fields:
            self.fed[1] = False
        if "e2e_ms" in fields or "e2e_p99_ms" in fields:
            self.fed[2] = False
        if "heartbeat_ns" in fields:
            self._write()
        else:
            self._write_now()

    def heartbeat(self):
        """Refresh ``heartbeat_ns`` to now (CLOCK_MONOTONIC) and publish."""
        self._live()
        self._write_now()

    def set_state(self, state):
        """Set the worker state (a :class:`WorkerState` or its int) and publish."""
        self.publish(state=state)

    def inflight_add(self, int delta):
        """Add ``delta`` to the agent's in-flight count (floored at 0), publish, return the count."""
        cdef int64_t v
        self._live()
        v = <int64_t>self.st.inflight + delta
        self.st.inflight = <int32_t>(v if v > 0 else 0)
        self._write_now()
        return self.st.inflight

    def record_request(self, int64_t prompt_tokens, int delta=1):
        """Account a queued prompt (``delta=+1`` on arrival, ``-1`` when it leaves the queue):
        adds ``delta * prompt_tokens`` to queued_prompt_tokens and ``delta`` to its
        prompt-length histogram bin (both floored at 0). Returns queued_prompt_tokens.
        """
        cdef int b
        cdef int64_t q, c
        self._live()
        if prompt_tokens < 0:
            raise SlotFieldError("prompt_tokens must be >= 0", field="prompt_tokens", name=self.seg.name)
        if delta not in (-1, 1):
            raise SlotFieldError("delta must be +1 or -1", field="delta", name=self.seg.name)
        b = dplb_len_bin(prompt_tokens)
        q = self.st.queued_prompt_tokens + delta * prompt_tokens
        self.st.queued_prompt_tokens = q if q > 0 else 0
        c = <int64_t>self.st.prompt_len_hist[b] + delta
        self.st.prompt_len_hist[b] = <uint32_t>(c if c > 0 else 0)
        dplb_refresh_compat(&self.st)
        self._write_now()
        return self.st.queued_prompt_tokens

    def record_latency(self, ttft_ms=None, tpot_ms=None, e2e_ms=None):
        """Push latency samples (ms, finite, >= 0) into the windows: the last 32 samples that
        are at most ``latency_window_s`` old. The writer recomputes each window's mean and
        nearest-rank p99 now and whenever a sample expires (on any later write, e.g. the
        heartbeat); a window with no sample left reads -1 ("no sample": latency term 1.0), so
        one slow request does not keep an idle worker penalised. One publish for all three.
        """
        cdef double a = -1.0, b = -1.0, c = -1.0
        cdef int64_t now
        self._live()
        if ttft_ms is not None:
            a = _f(ttft_ms, "ttft_ms")
        if tpot_ms is not None:
            b = _f(tpot_ms, "tpot_ms")
        if e2e_ms is not None:
            c = _f(e2e_ms, "e2e_ms")
        if (ttft_ms is not None and a < 0) or (tpot_ms is not None and b < 0) or (e2e_ms is not None and c < 0):
            raise SlotFieldError("latency samples must be >= 0", field="latency", name=self.seg.name)
        now = dplb_now_ns()
        if ttft_ms is not None:
            self.st.ttft_ring[self.st.ttft_n % DPLB_WINDOW] = <float>a
            self.ts_ttft[self.st.ttft_n % DPLB_WINDOW] = now
            self.st.ttft_n += 1
            self.fed[0] = True
        if tpot_ms is not None:
            self.st.tpot_ring[self.st.tpot_n % DPLB_WINDOW] = <float>b
            self.ts_tpot[self.st.tpot_n % DPLB_WINDOW] = now
            self.st.tpot_n += 1
            self.fed[1] = True
        if e2e_ms is not None:
            self.st.e2e_ring[self.st.e2e_n % DPLB_WINDOW] = <float>c
            self.ts_e2e[self.st.e2e_n % DPLB_WINDOW] = now
            self.st.e2e_n += 1
            self.fed[2] = True
        self._resummarize(now)
        self.st.heartbeat_ns = now
        self._write()

    def count(self, int64_t completed=0, int64_t failed=0):
        """Add to the completed/failed counters (each >= 0) and publish."""
        self._live()
        if completed < 0 or failed < 0:
            raise SlotFieldError("counts must be >= 0", field="count", name=self.seg.name)
        self.st.completed += <uint64_t>completed
        self.st.failed += <uint64_t>failed
        self._write_now()

    def release(self):
        """Give the slot back: every field reset, state EMPTY, generation bumped."""
        cdef uint64_t seq
        self._live()
        seq = self.st.seq
        _empty_slot(&self.st, self.slot_index)
        self.st.seq = seq
        self._forget_samples()
        self._write()
        dplb_generation_bump(<dplb_header_t *>self.seg.base)

    def fill_pattern(self, int64_t v):
        """Diagnostics (seqlock self-test): set every field of the slot from one counter ``v``
        and publish; :meth:`Segment.check_reads` verifies reads of this pattern.
        """
        cdef int k
        self._live()
        self.st.num_running = self.st.num_waiting = self.st.inflight = self.st.max_num_seqs = <int32_t>v
        self.st.pid = <int32_t>v
        self.st.queued_prompt_tokens = self.st.heartbeat_ns = v
        self.st.gpu_mem_used_bytes = self.st.gpu_mem_total_bytes = v
        self.st.weight = self.st.kv_cache_usage = self.st.ttft_ms = self.st.tpot_ms = <double>v
        self.st.e2e_ms = self.st.ttft_p99_ms = self.st.tpot_p99_ms = self.st.e2e_p99_ms = <double>v
        self.st.completed = self.st.failed = <uint64_t>v
        self.st.ttft_n = self.st.tpot_n = self.st.e2e_n = <uint32_t>v
        self.st.num_gpus = <int32_t>(v & 15)
        self.st.state = <int32_t>(v & 3)
        for k in range(DPLB_HIST_BINS):
            self.st.prompt_len_hist[k] = <uint32_t>v
            self.st.length_compat[k] = <double>v
        for k in range(DPLB_WINDOW):
            self.st.ttft_ring[k] = self.st.tpot_ring[k] = self.st.e2e_ring[k] = <float>(v & 0xFFFFFF)
        for k in range(DPLB_MAX_GPUS):
            self.st.gpu_ids[k] = <int16_t>(v & 0x7FFF)
        memset(self.st.endpoint, 65 + (v % 26), DPLB_ENDPOINT_LEN)
        memset(self.st.model, 65 + (v % 26), DPLB_MODEL_LEN)
        self._write()


cdef int _apply(dplb_slot_t *s, dict fields) except -1:
    """Validate and store ``fields`` into the private copy ``s``."""
    cdef int k
    for key, v in fields.items():
        if key == "state":
            try:
                st = WorkerState(v)
            except ValueError:
                raise SlotFieldError(f"unknown worker state {v!r}", field="state")
            s.state = <int32_t>int(st)
        elif key == "pid":
            s.pid = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "endpoint":
            _set_endpoint(s, v)
        elif key == "model":
            _set_str(s.model, DPLB_MODEL_LEN, v, key)
        elif key == "gpu_ids":
            ids = list(v)
            if len(ids) > DPLB_MAX_GPUS:
                raise SlotFieldError(f"at most {DPLB_MAX_GPUS} gpu_ids, got {len(ids)}", field=key)
            for k in range(DPLB_MAX_GPUS):
                s.gpu_ids[k] = <int16_t>_i(ids[k], key, 0, 32767) if k < len(ids) else 0
            s.num_gpus = len(ids)
        elif key == "weight":
            s.weight = _f(v, key)
            if s.weight < 0:
                raise SlotFieldError("weight must be >= 0", field=key)
        elif key == "num_running":
            s.num_running = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "num_waiting":
            s.num_waiting = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "inflight":
            s.inflight = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "max_num_seqs":
            s.max_num_seqs = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "queued_prompt_tokens":
            s.queued_prompt_tokens = _i(v, key, 0, 2**62)
        elif key == "kv_cache_usage":
            d = _f(v, key)
            if d != -1.0 and d < 0.0:
                raise SlotFieldError(f"kv_cache_usage must be in [0, 1] or -1, got {v!r}", field=key)
            s.kv_cache_usage = d if d <= 1.0 else 1.0   # engines may round a full cache above 1
        elif key == "gpu_mem_used_bytes":
            s.gpu_mem_used_bytes = _i(v, key, -1, 2**62)
        elif key == "gpu_mem_total_bytes":
            s.gpu_mem_total_bytes = _i(v, key, -1, 2**62)
        elif key in ("ttft_ms", "tpot_ms", "e2e_ms", "ttft_p99_ms", "tpot_p99_ms", "e2e_p99_ms"):
            d = _f(v, key)
            if d < 0 and d != -1.0:
                raise SlotFieldError(f"{key} must be >= 0 or -1, got {v!r}", field=key)
            if key == "ttft_ms":
                s.ttft_ms = d
            elif key == "tpot_ms":
                s.tpot_ms = d
            elif key == "e2e_ms":
                s.e2e_ms = d
            elif key == "ttft_p99_ms":
                s.ttft_p99_ms = d
            elif key == "tpot_p99_ms":
                s.tpot_p99_ms = d
            else:
                s.e2e_p99_ms = d
        elif key == "prompt_len_hist":
            h = list(v)
            if len(h) > DPLB_HIST_BINS:
                raise SlotFieldError(f"prompt_len_hist has at most {DPLB_HIST_BINS} bins", field=key)
            for k in range(DPLB_HIST_BINS):
                s.prompt_len_hist[k] = <uint32_t>_i(h[k], key, 0, 2**32 - 1) if k < len(h) else 0
            dplb_refresh_compat(s)
        elif key == "completed":
            s.completed = <uint64_t>_i(v, key, 0, 2**63 - 1)
        elif key == "failed":
            s.failed = <uint64_t>_i(v, key, 0, 2**63 - 1)
        elif key == "heartbeat_ns":
            s.heartbeat_ns = _i(v, key, 0, 2**63 - 1)
        else:
            raise SlotFieldError(f"unknown slot field {key!r}", field=str(key))
    return 0


cdef int _set_endpoint(dplb_slot_t *s, v) except -1:
    if not isinstance(v, str):
        raise SlotFieldError(f"endpoint must be a string, got {v!r}", field="endpoint")
    if v.startswith("/"):
        if len(v.encode("utf-8")) > DPLB_UNIX_PATH_MAX:
            raise SlotFieldError(f"endpoint socket path is {len(v.encode())} bytes; a Unix socket path "
                                 f"holds at most {DPLB_UNIX_PATH_MAX}", field="endpoint")
    elif v:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise SlotFieldError(f"endpoint must be an absolute socket path or host:port, got {v!r}",
                                 field="endpoint")
    _set_str(s.endpoint, DPLB_ENDPOINT_LEN, v, "endpoint")
    return 0
