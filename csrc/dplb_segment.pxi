# Included by dplb_native.pyx: the mapped segment, snapshot reads, router atomics, kernel calls.

cdef extern from *:
    """
    static inline int32_t dplb_state_relaxed(const dplb_slot_t *s) {
        return __atomic_load_n(&s->state, __ATOMIC_RELAXED);
    }
    """
    int32_t dplb_state_relaxed(const dplb_slot_t *s) nogil


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
    cdef dplb_ttft_terms_t *tterms
    cdef object params_obj
    cdef dplb_params_t params
    cdef object tparams_obj
    cdef dplb_ttft_params_t tparams
    #: the parameters loaded before ``tparams_obj`` (a policy alternates two: its own and the
    #: chosen worker's own-TTFT set, ``DplbPolicy.own_ttft``), kept so that switching back costs
    #: a struct swap instead of 14 attribute reads (TtftParams is frozen: identity is enough)
    cdef object tparams_obj2
    cdef dplb_ttft_params_t tparams2
    #: spins (retries) made by this mapping's :meth:`read_slot` calls in all: how long readers
    #: waited for writers (a diagnostic; a slot whose writer stopped mid-write adds at most
    #: ``DPLB_YIELD_EVERY`` (1024) per read once its heartbeat is 1 s old)
    cdef readonly long long read_spins

    def __cinit__(self):
        self.base = NULL
        self.scores = NULL
        self.aff = NULL
        self.terms = NULL
        self.tterms = NULL
        self.params_obj = None
        self.tparams_obj = None
        self.tparams_obj2 = None
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
        free(self.tterms)
        self.scores = NULL
        self.aff = NULL
        self.terms = NULL
        self.tterms = NULL

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
        self.tterms = <dplb_ttft_terms_t *>malloc(n * sizeof(dplb_ttft_terms_t))
        if self.scores == NULL or self.aff == NULL or self.terms == NULL or self.tterms == NULL:
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

        The read spins while the slot's writer is inside a write. A slot whose sequence is still
        odd at a yield point (every 1024 spins) while its heartbeat is over 1 s old
        (``DPLB_STALE_WRITE_NS``, csrc/dplb_shm.h: its writer was killed between its two stores, or
        a stray write) reads at once with ``stale=True``, its other fields copied without the
        seqlock (they may be torn); so does one that stays odd for 10^6 spins. A stale worker is
        out of routing (:meth:`router.scheduling.Scheduler.live`) until its writer (its restarted
        agent) publishes again. :attr:`read_spins` counts the spins.
        """
        cdef dplb_slot_t s
        cdef dplb_slot_t *src
        cdef int res
        cdef int64_t now
        self._check(slot)
        src = dplb_slot_at(self.base, slot)
        now = dplb_now_ns()
        self.read_spins += dplb_seqlock_read_ex(src, &s, DPLB_DATA_END, DPLB_READ_MAX_SPINS,
                                                now - DPLB_STALE_WRITE_NS, &res)
        if res == 0:
            return _snapshot(&s, src, now)
        memcpy(<char *>&s + 8, <const char *>src + 8, DPLB_DATA_END - 8)
        s.seq = src.seq
        return _snapshot(&s, src, now, True)

    def snapshot(self):
        """Every slot (EMPTY ones included) as a list of :class:`WorkerSnapshot`, index == slot."""
        self._check_open()
        return [self.read_slot(i) for i in range(self.num_slots)]

    def occupied(self):
        """Indexes of the slots whose state is not EMPTY, from one relaxed load of each slot's
        state (no seqlock: a hint for which slots to :meth:`read_slot`; a slot claimed or
        released during the scan may be missed or included once)."""
        cdef uint32_t i
        cdef list out = []
        self._check_open()
        for i in range(self.num_slots):
            if dplb_state_relaxed(dplb_slot_at(self.base, i)) != DPLB_STATE_EMPTY:
                out.append(i)
        return out

    def state_get(self, int slot):
        """The slot's lifecycle state (an int, :class:`WorkerState`) from one relaxed load of its
        ``state`` field, no seqlock: the same first check the kernel makes of every slot. The
        scheduler reads it to confirm, at the pick, that a worker chosen without the kernel is still
        READY (a slot turns DRAINING between two synced snapshots)."""
        self._check(slot)
        return dplb_state_relaxed(dplb_slot_at(self.base, slot))

    def writer(self, int slot, double latency_window_s=10.0):
        """The :class:`SlotWriter` of ``slot``, starting from the slot's current content.

        ``latency_window_s``: latency samples older than this leave the window summaries
        (default 10 s: docs/DESIGN.md ``routing_policy.latency_window_sec``); 0 keeps the last 32
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

    def prefill_add(self, int slot, int64_t delta):
        """Atomically add ``delta`` (tokens) to the slot's outstanding prefill tokens (uncached
        prompt tokens dispatched whose first token has not come back); returns the new value."""
        self._check(slot)
        self._check_writable()
        return dplb_i64_add(&dplb_slot_at(self.base, slot).router.prefill_tokens, delta)

    def decode_add(self, int slot, int64_t reqs, int64_t ctx_tokens):
        """Atomically add ``reqs`` requests and ``ctx_tokens`` context tokens to the slot's
        decoding counters (requests past their first token, not finished); returns
        ``(decode_reqs, decode_ctx_tokens)`` after the change (two atomics, not one snapshot)."""
        cdef dplb_slot_t *s
        self._check(slot)
        self._check_writable()
        s = dplb_slot_at(self.base, slot)
        return (dplb_i64_add(&s.router.decode_reqs, reqs), dplb_i64_add(&s.router.decode_ctx_tokens, ctx_tokens))

    def prefill_rate_observe(self, int slot, double sample, double alpha=0.1, double clip=4.0):
        """Learn the slot's prefill rate (tokens/s) from one observation: a lock-free EWMA shared by
        every router process (``dplb_ewma_observe`` in csrc/dplb_shm.h: sample clipped to
        [cur/clip, cur*clip], then cur += alpha*(sample - cur); the first sample is taken whole).
        Returns the new rate. Raises :class:`SlotFieldError` for a sample that is not > 0 or an
        alpha outside (0, 1]."""
        cdef dplb_slot_t *s
        self._check(slot)
        self._check_writable()
        if not (sample > 0.0) or not isfinite(sample):
            raise SlotFieldError(f"prefill rate sample must be a finite number > 0, got {sample}",
                                 field="sample", name=self.name)
        if not (0.0 < alpha <= 1.0):
            raise SlotFieldError(f"alpha must be in (0, 1], got {alpha}", field="alpha", name=self.name)
        s = dplb_slot_at(self.base, slot)
        return dplb_ewma_observe(&s.router.prefill_rate, &s.router.prefill_rate_n, sample, alpha, clip)

    def latency_observe(self, int slot, ttft_s=None, tpot_s=None, double alpha=0.1):
        """Fold a TTFT and/or TPOT sample (seconds, > 0) into the slot's router-side EWMAs (the
        routers' own view of each worker's latency, shared by every router process)."""
        cdef dplb_slot_t *s
        self._check(slot)
        self._check_writable()
        if not (0.0 < alpha <= 1.0):
            raise SlotFieldError(f"alpha must be in (0, 1], got {alpha}", field="alpha", name=self.name)
        s = dplb_slot_at(self.base, slot)
        if ttft_s is not None and ttft_s > 0 and isfinite(ttft_s):
            dplb_ewma_observe(&s.rstats.ttft_s, &s.rstats.ttft_n, <double>ttft_s, alpha, 0.0)
        if tpot_s is not None and tpot_s > 0 and isfinite(tpot_s):
            dplb_ewma_observe(&s.rstats.tpot_s, &s.rstats.tpot_n, <double>tpot_s, alpha, 0.0)

    def outcome_add(self, int slot, int64_t completed=0, int64_t failed=0):
        """Atomically add to the slot's router-side request outcomes (router stats line): attempts
        the routers saw answered (``completed``) and failed (``failed``), each >= 0; the one
        count of requests per worker that the dump, ``/dplb/status`` and ``/metrics`` show, kept
        by every router process's leases. Returns ``(completed, failed)`` after the change."""
        cdef dplb_slot_t *s
        self._check(slot)
        self._check_writable()
        if completed < 0 or failed < 0:
            raise SlotFieldError("outcome_add: counts must be >= 0", field="completed", name=self.name)
        s = dplb_slot_at(self.base, slot)
        return (dplb_u64_add(&s.rstats.completed, <uint64_t>completed),
                dplb_u64_add(&s.rstats.failed, <uint64_t>failed))

    def router_reset(self, int slot):
        """Zero the slot's request accounting, learned averages and request outcomes (``completed``,
        ``failed`` of the router stats line): a new worker in the slot (a mirror slot reused for
        another endpoint) starts with fresh counters, its cache and speed are not the old one's.
        Circuit and dispatched total are kept. Only safe when no router holds a lease on the slot
        (the slot was just claimed or released)."""
        cdef dplb_slot_t *s
        self._check(slot)
        self._check_writable()
        s = dplb_slot_at(self.base, slot)
        dplb_i64_set(&s.router.prefill_tokens, 0)
        dplb_i64_set(&s.router.decode_reqs, 0)
        dplb_i64_set(&s.router.decode_ctx_tokens, 0)
        dplb_f64_set(&s.router.prefill_rate, 0.0)
        dplb_f64_set(&s.rstats.ttft_s, 0.0)
        dplb_f64_set(&s.rstats.tpot_s, 0.0)
        dplb_i64_set(<int64_t *>&s.router.prefill_rate_n, 0)
        dplb_i64_set(<int64_t *>&s.rstats.ttft_n, 0)
        dplb_i64_set(<int64_t *>&s.rstats.tpot_n, 0)
        dplb_i64_set(<int64_t *>&s.rstats.completed, 0)
        dplb_i64_set(<int64_t *>&s.rstats.failed, 0)

    def router_line(self, int slot):
        """The slot's router-side accounting as a dict: ``router_inflight``, ``dispatched``,
        ``circuit``, ``prefill_tokens``, ``decode_reqs``, ``decode_ctx_tokens``, ``prefill_rate``
        (tokens/s, 0 = none learned), ``prefill_rate_n``, ``router_ttft_s``, ``router_tpot_s``
        (EWMAs, 0 = no sample), ``completed``, ``failed`` (request outcomes, :meth:`outcome_add`). Each field is one atomic load; together they are not a snapshot."""
        cdef dplb_slot_t *s
        self._check(slot)
        s = dplb_slot_at(self.base, slot)
        return _router_dict(s)

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

    cdef int _load_ttft(self, params, uncached, uint32_t *n_unc) except -1:
        cdef Py_ssize_t n, j
        cdef dplb_ttft_params_t held
        if params is not self.tparams_obj and params is self.tparams_obj2:
            held = self.tparams
            self.tparams = self.tparams2
            self.tparams2 = held
            self.tparams_obj2 = self.tparams_obj
            self.tparams_obj = params
        elif params is not self.tparams_obj:
            if not isinstance(params, TtftParams):
                raise SlotFieldError(f"params must be a TtftParams, got {type(params).__name__}", field="params")
            if self.tparams_obj is not None:
                self.tparams2 = self.tparams
                self.tparams_obj2 = self.tparams_obj
            self.tparams_obj = None   # until every field is in (a read that raises leaves no stale match)
            self.tparams.prefill_rate = params.prefill_rate
            self.tparams.waiting_tokens = params.waiting_tokens
            self.tparams.step_tokens = params.step_tokens
            self.tparams.step_base_s = params.step_base_s
            self.tparams.decode_seq_s = params.decode_seq_s
            self.tparams.decode_ctx_s = params.decode_ctx_s
            self.tparams.kv_barrier_s = params.kv_barrier_s
            self.tparams.w_decode = params.w_decode
            self.tparams.kv_cache_threshold = params.kv_cache_threshold
            self.tparams.heartbeat_timeout_ms = params.heartbeat_timeout_ms
            self.tparams.rate_band = params.rate_band
            self.tparams.w_interf = params.w_interf
            self.tparams.w_miss = params.w_miss
            self.tparams.interf_batch_cap = params.interf_batch_cap
            self.tparams_obj = params
        if uncached is None:
            n_unc[0] = 0
            return 0
        if not isinstance(uncached, list):
            uncached = list(uncached)
        n = PyList_GET_SIZE(uncached)
        if n > self.num_slots:
            raise SlotFieldError(f"uncached has {n} entries, segment has {self.num_slots} slots",
                                 field="uncached", name=self.name)
        for j in range(n):
            self.aff[j] = <double>(<object>PyList_GET_ITEM(uncached, j))
            if not isfinite(self.aff[j]):
                raise SlotFieldError(f"uncached[{j}] must be finite", field="uncached", name=self.name)
        n_unc[0] = <uint32_t>n
        return 0

    def pick_ttft(self, params, int64_t prompt_len=0, uncached=None, now_ns=None, rng_u=None,
                  double out_tokens=0.0):
        """Choose the worker with the smallest estimated time to first token (csrc/dplb_kernel.h,
        ``dplb_pick_ttft``).

        ``params``: :class:`TtftParams`; ``prompt_len``: prompt tokens; ``uncached``: per slot, the
        prompt tokens not cached there (missing entries: ``prompt_len``; a negative entry rules the
        slot out); ``now_ns``/``rng_u``: override the clock and the tie-breaking draw (tests,
        virtual time); ``out_tokens``: the request's expected output tokens (the batch term). Returns ``(slot, estimated TTFT in s)``, or ``(-1, inf)`` when none is eligible.
        """
        cdef uint32_t n_unc
        cdef int64_t now
        cdef double u
        cdef int chosen
        self._check_open()
        self._load_ttft(params, uncached, &n_unc)
        now = dplb_now_ns() if now_ns is None else <int64_t>now_ns
        u = self._draw(rng_u)
        chosen = dplb_pick_ttft(self.base, self.num_slots, &self.tparams, prompt_len, out_tokens,
                                self.aff if n_unc else NULL, n_unc, now, u, self.scores, self.tterms, NULL)
        return chosen, (self.scores[chosen] if chosen >= 0 else float("inf"))

    def pick_ttft_explain(self, params, int64_t prompt_len=0, uncached=None, now_ns=None, rng_u=None,
                          double out_tokens=0.0):
        """Like :meth:`pick_ttft`, also returning the :class:`TtftTerms` of every eligible worker
        (slot order). Returns ``(chosen, terms)``."""
        cdef uint32_t n_unc
        cdef int64_t now
        cdef double u
        cdef int nt = 0, k, chosen
        cdef dplb_ttft_terms_t *t
        self._check_open()
        self._load_ttft(params, uncached, &n_unc)
        now = dplb_now_ns() if now_ns is None else <int64_t>now_ns
        u = self._draw(rng_u)
        chosen = dplb_pick_ttft(self.base, self.num_slots, &self.tparams, prompt_len, out_tokens,
                                self.aff if n_unc else NULL, n_unc, now, u, self.scores, self.tterms, &nt)
        out = []
        for k in range(nt):
            t = &self.tterms[k]
            out.append(TtftTerms(worker_id=t.worker_id, est_s=t.est_s, queue_tokens=t.queue_tokens,
                                 uncached_tokens=t.uncached_tokens, rate=t.rate, own_rate=t.own_rate,
                                 steps=t.steps,
                                 prefill_s=t.prefill_s, decode_s=t.decode_s, kv_s=t.kv_s, batch_s=t.batch_s,
                                 interf_s=t.interf_s, miss_s=t.miss_s,
                                 decode_reqs=t.decode_reqs, batch=t.batch, outside_reqs=t.outside_reqs,
                                 weight=t.weight))
        return chosen, out

    def pick_ttft_rows(self, params, int64_t prompt_len=0, uncached=None, now_ns=None, rng_u=None,
                       double out_tokens=0.0):
        """Like :meth:`pick_ttft_explain`, with only what a policy re-ranks by per eligible worker
        (slot order): ``(chosen, [(worker_id, est_s, uncached_tokens, rate, weight), ...])``, plain
        tuples (no :class:`TtftTerms` built: the hot path of ``dplb``'s TPOT-SLO term)."""
        cdef uint32_t n_unc
        cdef int64_t now
        cdef double u
        cdef int nt = 0, k, chosen
        cdef dplb_ttft_terms_t *t
        self._check_open()
        self._load_ttft(params, uncached, &n_unc)
        now = dplb_now_ns() if now_ns is None else <int64_t>now_ns
        u = self._draw(rng_u)
        chosen = dplb_pick_ttft(self.base, self.num_slots, &self.tparams, prompt_len, out_tokens,
                                self.aff if n_unc else NULL, n_unc, now, u, self.scores, self.tterms, &nt)
        out = []
        for k in range(nt):
            t = &self.tterms[k]
            out.append((t.worker_id, t.est_s, t.uncached_tokens, t.rate, t.weight))
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
                       or s.pid != v or s.engine_pid != v or s.queued_prompt_tokens != v
                       or s.heartbeat_ns != DPLB_PATTERN_HEARTBEAT + v
                       or s.gpu_mem_used_bytes != v or s.gpu_mem_total_bytes != v
                       or s.weight != <double>v or s.kv_cache_usage != <double>v
                       or s.ttft_ms != <double>v or s.tpot_ms != <double>v or s.e2e_ms != <double>v
                       or s.ttft_p99_ms != <double>v or s.tpot_p99_ms != <double>v
                       or s.e2e_p99_ms != <double>v or s.completed != <uint64_t>v
                       or s.failed != <uint64_t>v or s.ttft_n != <uint32_t>v
                       or s.restarts != <uint32_t>v or s.next_restart_ns != v
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
