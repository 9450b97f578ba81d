# Included by dplb_native.pyx: the single writer of one slot (seqlock writes, latency windows).

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
    cdef int64_t fixed_now        # > 0: the writer's clock (virtual time); 0: CLOCK_MONOTONIC

    @staticmethod
    cdef SlotWriter _new(Segment seg, int slot, int64_t window_ns):
        cdef SlotWriter w = SlotWriter.__new__(SlotWriter)
        w.seg = seg
        w.slot_index = slot
        w.window_ns = window_ns
        w.fixed_now = 0
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

    cdef inline int64_t _now(self) noexcept:
        return self.fixed_now if self.fixed_now > 0 else dplb_now_ns()

    cdef inline void _write_now(self) noexcept:
        cdef int64_t now = self._now()
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
    def now_override_ns(self):
        """The writer's clock: 0 (default) = CLOCK_MONOTONIC; a value > 0 = every later write
        (heartbeat, latency sample times and their expiry) uses this time instead, in the same ns
        domain. A simulator in virtual time (``simulate/``) sets it before each write, so the
        heartbeat and the latency window follow simulated time; readers must then pass the same
        clock to the kernel (``pick(..., now_ns=)``)."""
        return self.fixed_now

    @now_override_ns.setter
    def now_override_ns(self, int64_t v):
        if v < 0:
            raise SlotFieldError("now_override_ns must be >= 0", field="now_override_ns", name=self.seg.name)
        self.fixed_now = v

    @property
    def latency_window_s(self):
        """Age (s) after which a latency sample leaves the window summaries; 0 = count-only."""
        return self.window_ns / 1e9

    def claim(self, int worker_id, pid=None, endpoint="", gpu_ids=(), weight=1.0, model="",
              max_num_seqs=0, control=""):
        """Take the slot for a (re)started worker: all fields reset, state STARTING, generation bumped.

        ``worker_id`` must equal the slot index. ``endpoint``: the engine's data address, Unix
        socket path (absolute, at most 107 bytes) or ``host:port``; ``control``: the agent's
        control address in the same forms ("" = the endpoint serves the control API too); ``gpu_ids``: at most 16; ``model``: at most 119 bytes
        UTF-8. Router atomics (router_inflight, dispatched, circuit) are left as they are.
        """
        cdef dplb_slot_t tmp
        self._live()
        if worker_id != self.slot_index:
            raise SlotFieldError(f"worker_id {worker_id} must equal the slot index {self.slot_index}",
                                 field="worker_id", name=self.seg.name)
        _empty_slot(&tmp, self.slot_index)
        tmp.seq = self.st.seq
        _apply(&tmp, {"pid": os.getpid() if pid is None else pid, "endpoint": endpoint, "control": control,
                      "gpu_ids": gpu_ids, "weight": weight, "model": model,
                      "max_num_seqs": max_num_seqs, "state": WorkerState.STARTING})
        memcpy(&self.st, &tmp, sizeof(dplb_slot_t))
        self._forget_samples()
        self._write_now()
        dplb_generation_bump(<dplb_header_t *>self.seg.base)

    def publish(self, **fields):
        """Set the given fields and publish them in one seqlock write (heartbeat refreshed unless
        ``heartbeat_ns`` is among them).

        Fields: state, pid, endpoint, control, model, gpu_ids, weight, num_running, num_waiting, inflight,
        queued_prompt_tokens, max_num_seqs, kv_cache_usage (0..1, above 1 stored as 1, or -1), gpu_mem_used_bytes,
        gpu_mem_total_bytes, ttft_ms, tpot_ms, e2e_ms, ttft_p99_ms, tpot_p99_ms, e2e_p99_ms
        (set the window summaries directly, e.g. a router mirroring a remote agent),
        prompt_len_hist (32 counts), completed, failed, heartbeat_ns, restarts, agent_restarts, last_exit_code,
        state_reason (a ``StateReason``), next_restart_ns (CLOCK_MONOTONIC ns, 0 = none),
        engine_pid (the engine process the agent spawned, 0 = none). Unknown names raise :class:`SlotFieldError`.
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
        now = self._now()
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
        and publish; :meth:`Segment.check_reads` verifies reads of this pattern. ``v`` is taken
        modulo 2**30 so that the 32-bit fields hold it whole (a hammer writing ~10 million times a
        second passes 2**31 within minutes; the check would then read a wrapped ``num_running``
        against the 64-bit fields and call every read torn). The heartbeat is ``2**62 + v``, in the
        future: a reader that finds the hammer preempted inside a write keeps waiting for it instead
        of taking it for a writer that stopped (``WorkerSnapshot.stale``).
        """
        cdef int k
        self._live()
        v &= 0x3FFFFFFF
        self.st.num_running = self.st.num_waiting = self.st.inflight = self.st.max_num_seqs = <int32_t>v
        self.st.pid = self.st.engine_pid = <int32_t>v
        self.st.queued_prompt_tokens = v
        self.st.heartbeat_ns = DPLB_PATTERN_HEARTBEAT + v
        self.st.gpu_mem_used_bytes = self.st.gpu_mem_total_bytes = v
        self.st.weight = self.st.kv_cache_usage = self.st.ttft_ms = self.st.tpot_ms = <double>v
        self.st.e2e_ms = self.st.ttft_p99_ms = self.st.tpot_p99_ms = self.st.e2e_p99_ms = <double>v
        self.st.completed = self.st.failed = <uint64_t>v
        self.st.restarts = <uint32_t>v
        self.st.next_restart_ns = v
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
