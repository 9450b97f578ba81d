/*
 * dplb_shm.h -- the one owner of DPLB's shared-memory segment layout and its seqlock.
 *
 * Everything else (csrc/dplb_native.pyx, dplb_shm/layout.py, the dump tool) takes offsets and
 * sizes from here; tests/dplb_shm/test_layout.py checks that Python's view equals offsetof() below.
 *
 * Segment (a POSIX shm object, /dev/shm/<name>, mode 0600), little-endian, all fields naturally
 * aligned, one cache line = 64 bytes:
 *
 *   0          128                128+S              128+2S          128+N*S
 *   +----------+------------------+------------------+-- ... --------+
 *   | header   | slot 0           | slot 1           |               |
 *   +----------+------------------+------------------+-- ... --------+
 *                S = DPLB_SLOT_SIZE = 1536 bytes (24 cache lines), N = num_slots
 *
 * Header (128 bytes, written once by the creator except `generation`):
 *
 *   off  size  field
 *     0     8  magic        "DPLBSHM\0" as little-endian u64 (DPLB_MAGIC), stored last (release)
 *     8     4  version      DPLB_LAYOUT_VERSION
 *    12     4  num_slots
 *    16     4  slot_size    DPLB_SLOT_SIZE
 *    20     4  header_size  DPLB_HEADER_SIZE
 *    24     8  created_ns   CLOCK_REALTIME ns at creation
 *    32     8  generation   membership counter, atomic; bumped on every claim/release
 *    40     4  creator_pid
 *    44    84  reserved (zero)
 *
 * Slot i (one writer: worker agent i, or a router keeping a mirror of a remote worker).
 * Bytes [0, 1408) are guarded by the seqlock `seq`; the router lines [1408, 1536) are NOT: they
 * hold atomics that every router process updates with __atomic read-modify-write operations, kept
 * on their own cache lines so router traffic never invalidates the agent's lines or makes readers
 * retry. Each router field has one meaning and is only ever changed by atomic add (counters,
 * released exactly once per request by the router's lease) or by compare-and-swap (the learned
 * averages), so k router processes keep one truth without a lock.
 *
 *   off  size  field                     unit / meaning
 *  ---- line 0: hot, copied by the kernel (DPLB_HOT_END = 64) ---------------------------------
 *     0     8  seq                       seqlock: odd while the writer is inside a write
 *     8     4  worker_id                 == slot index
 *    12     4  state                     DPLB_STATE_* (EMPTY, STARTING, READY, DRAINING, DEAD)
 *    16     8  weight                    static weight (double), score multiplier
 *    24     8  heartbeat_ns              CLOCK_MONOTONIC ns of the last write
 *    32     4  num_running               engine: requests being decoded/prefilled
 *    36     4  num_waiting               engine: requests queued in the engine
 *    40     4  inflight                  agent: routers' in-flight count when running/waiting were read
 *    44     4  max_num_seqs              engine batch limit (max_queue default)
 *    48     8  kv_cache_usage            0..1, -1 = unknown
 *    56     8  ttft_ms                   mean of the TTFT window, -1 = no sample
 *  ---- lines 1..4: the kernel reads the one entry for the prompt's bin ------------------------
 *    64   256  length_compat[32]         f64: length compatibility of a prompt in bin b with the
 *                                        queued histogram below; the writer recomputes the table
 *                                        whenever the histogram changes (dplb_kernel.h formula)
 *  ---- cold lines 5..19 ----------------------------------------------------------------------
 *   320   128  prompt_len_hist[32]       u32 counts of queued prompts, bin b holds
 *                                        lengths in [2^b, 2^(b+1)) (bin 0 also holds 0)
 *   448     4  pid                       the slot writer's pid: the worker agent's (a mirror: the router's)
 *   452     4  num_gpus                  entries used in gpu_ids
 *   456     8  queued_prompt_tokens      sum of prompt tokens of queued requests
 *   464     8  gpu_mem_used_bytes        NVML, -1 = unknown
 *   472     8  gpu_mem_total_bytes       NVML, -1 = unknown
 *   480     8  tpot_ms                   mean of the TPOT window, -1 = no sample
 *   488     8  e2e_ms                    mean of the end-to-end window, -1 = no sample
 *   496     8  ttft_p99_ms               nearest-rank p99 of the window, -1 = no sample
 *   504     8  tpot_p99_ms
 *   512     8  e2e_p99_ms
 *   520     8  completed                 requests finished OK (u64)
 *   528     8  failed                    requests failed (u64)
 *   536     4  ttft_n                    samples ever pushed; ring index = n % DPLB_WINDOW
 *   540     4  tpot_n
 *   544     4  e2e_n
 *   548     4  agent_restarts            u32: restarts of this worker's agent (a new agent took a dead
 *                                        one's place; the launcher restarts it), carried by each new agent
 *   552    32  gpu_ids[16]               i16
 *   584   128  ttft_ring[32]             f32 ms, the last DPLB_WINDOW samples
 *   712   128  tpot_ring[32]
 *   840   128  e2e_ring[32]
 *   968   128  endpoint                  NUL-terminated: Unix socket path (<= 107 bytes) or host:port
 *  1096   120  model                     NUL-terminated served model name (<= 119 bytes)
 *  1216     4  restarts                  u32: engine restarts of this worker (crash restarts and
 *                                        on-demand ones), carried by a new agent over an agent restart
 *  1220     4  last_exit_code            i32: exit status of the engine's last exit (negative: killed
 *                                        by that signal), 0 while it never exited
 *  1224     4  state_reason              DPLB_REASON_*: why the slot is in its state (DEAD/STARTING)
 *  1228     4  engine_pid                i32: pid of the engine process the agent spawned, 0 = none
 *                                        (an attached server, or no engine running)
 *  1232     8  next_restart_ns           CLOCK_MONOTONIC ns at which the agent restarts its engine
 *                                        (AGENT_EXITED: the launcher its agent), 0 when none is scheduled
 *  1240   128  control                   NUL-terminated: the agent's control address (/health,
 *                                        /dplb/state, /dplb/restart): Unix socket path (<= 107
 *                                        bytes) or host:port; empty = the endpoint serves them too.
 *                                        `endpoint` above is the data path: the ENGINE's own
 *                                        address, which routers forward requests to (one hop)
 *  1368    40  reserved (zero)           room for fields in later layout versions
 *  ---- line 22: router line (atomics, outside the seqlock) -----------------------------------
 *  1408     8  router_inflight           i64: dispatched by any router, not yet finished
 *  1416     8  dispatched                u64: total dispatched by routers
 *  1424     4  circuit                   0 closed, 1 open, 2 half-open
 *  1428     4  reserved
 *  1432     8  prefill_tokens            i64: uncached prompt tokens of requests dispatched whose
 *                                        first token has not come back yet (outstanding prefill)
 *  1440     8  decode_reqs               i64: requests past their first token, not finished
 *  1448     8  decode_ctx_tokens         i64: prompt tokens of those decoding requests
 *  1456     8  prefill_rate              f64 bits: learned prefill speed, tokens/s (0 = none yet)
 *  1464     8  prefill_rate_n            u64: samples the rate has learned from
 *  ---- line 23: router statistics (atomics, outside the seqlock) ----------------------------
 *  1472     8  ttft_s                    f64 bits: EWMA of TTFT seen by the routers, s (0 = none)
 *  1480     8  tpot_s                    f64 bits: EWMA of TPOT seen by the routers, s (0 = none)
 *  1488     8  ttft_n                    u64: TTFT samples
 *  1496     8  tpot_n                    u64: TPOT samples
 *  1504     8  completed                 u64: attempts on this worker the routers saw answered
 *                                        (no 5xx, no connection error, no broken stream), added
 *                                        once per attempt by the router's lease at its finish
 *  1512     8  failed                    u64: attempts that failed there (5xx, connection error,
 *                                        timeout, broken stream); a client that left counts in neither
 *  1520    16  reserved
 *
 * Seqlock (Boehm, "Can seqlocks get along with programming language memory models?", 2012):
 *   writer: s = seq; seq = s+1 (relaxed); release fence; copy data; seq = s+2 (release store)
 *   reader: s1 = seq (acquire); odd -> retry; copy data; acquire fence; s2 = seq (relaxed);
 *           s1 != s2 -> retry.
 * One writer per slot; the writer keeps a private copy of the slot and publishes it whole.
 */
#ifndef DPLB_SHM_H
#define DPLB_SHM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>
#include <time.h>

/* "DPLBSHM\0" read as a little-endian u64 */
#define DPLB_MAGIC 0x004D4853424C5044ULL
#define DPLB_LAYOUT_VERSION 5
#define DPLB_CACHE_LINE 64
#define DPLB_HEADER_SIZE 128
#define DPLB_SLOT_SIZE 1536
#define DPLB_MAX_SLOTS 4096
#define DPLB_WINDOW 32
#define DPLB_HIST_BINS 32
#define DPLB_MAX_GPUS 16
#define DPLB_ENDPOINT_LEN 128
#define DPLB_UNIX_PATH_MAX 107
#define DPLB_MODEL_LEN 120
#define DPLB_HOT_END 64
#define DPLB_DATA_END 1408

enum {
    DPLB_STATE_EMPTY = 0,
    DPLB_STATE_STARTING = 1,
    DPLB_STATE_READY = 2,
    DPLB_STATE_DRAINING = 3,
    DPLB_STATE_DEAD = 4,
};

/* state_reason: why a slot is DEAD or (re)STARTING; NONE once READY after a clean start */
enum {
    DPLB_REASON_NONE = 0,
    DPLB_REASON_ENGINE_EXITED = 1, /* the engine exited unexpectedly; restarted after a backoff */
    DPLB_REASON_START_FAILED = 2,  /* the engine did not become ready; restarted after a backoff */
    DPLB_REASON_GAVE_UP = 3,       /* too many failures in the window: DEAD until an admin restart */
    DPLB_REASON_ADMIN_RESTART = 4, /* restarted on an operator's request */
    DPLB_REASON_AGENT_EXITED = 5,  /* the agent itself died (written by the launcher, which restarts
                                      it after a backoff; the new agent's claim clears it) */
};

enum { DPLB_CIRCUIT_CLOSED = 0, DPLB_CIRCUIT_OPEN = 1, DPLB_CIRCUIT_HALF_OPEN = 2 };

typedef struct dplb_header {
    uint64_t magic;
    uint32_t version;
    uint32_t num_slots;
    uint32_t slot_size;
    uint32_t header_size;
    int64_t created_ns;
    uint64_t generation;
    int32_t creator_pid;
    uint8_t reserved[84];
} dplb_header_t;

typedef struct dplb_router_line {
    int64_t router_inflight;
    uint64_t dispatched;
    int32_t circuit;
    int32_t reserved0;
    int64_t prefill_tokens;
    int64_t decode_reqs;
    int64_t decode_ctx_tokens;
    uint64_t prefill_rate;   /* f64 bits */
    uint64_t prefill_rate_n;
} dplb_router_line_t;

typedef struct dplb_router_stats {
    uint64_t ttft_s;         /* f64 bits */
    uint64_t tpot_s;         /* f64 bits */
    uint64_t ttft_n;
    uint64_t tpot_n;
    uint64_t completed;
    uint64_t failed;
    uint8_t reserved[16];
} dplb_router_stats_t;

typedef struct dplb_slot {
    uint64_t seq;
    /* hot */
    int32_t worker_id;
    int32_t state;
    double weight;
    int64_t heartbeat_ns;
    int32_t num_running;
    int32_t num_waiting;
    int32_t inflight;
    int32_t max_num_seqs;
    double kv_cache_usage;
    double ttft_ms;
    /* length compatibility by prompt bin */
    double length_compat[DPLB_HIST_BINS];
    /* cold */
    uint32_t prompt_len_hist[DPLB_HIST_BINS];
    int32_t pid;
    int32_t num_gpus;
    int64_t queued_prompt_tokens;
    int64_t gpu_mem_used_bytes;
    int64_t gpu_mem_total_bytes;
    double tpot_ms;
    double e2e_ms;
    double ttft_p99_ms;
    double tpot_p99_ms;
    double e2e_p99_ms;
    uint64_t completed;
    uint64_t failed;
    uint32_t ttft_n;
    uint32_t tpot_n;
    uint32_t e2e_n;
    uint32_t agent_restarts;
    int16_t gpu_ids[DPLB_MAX_GPUS];
    float ttft_ring[DPLB_WINDOW];
    float tpot_ring[DPLB_WINDOW];
    float e2e_ring[DPLB_WINDOW];
    char endpoint[DPLB_ENDPOINT_LEN];
    char model[DPLB_MODEL_LEN];
    uint32_t restarts;
    int32_t last_exit_code;
    uint32_t state_reason;
    int32_t engine_pid;
    int64_t next_restart_ns;
    char control[DPLB_ENDPOINT_LEN];
    uint8_t reserved1[DPLB_DATA_END - 1368];
    /* router lines: atomics, outside the seqlock */
    dplb_router_line_t router;
    dplb_router_stats_t rstats;
} dplb_slot_t;

#define DPLB_ASSERT_OFF(T, f, o) _Static_assert(offsetof(T, f) == (o), #T "." #f " offset")
_Static_assert(sizeof(dplb_header_t) == DPLB_HEADER_SIZE, "header size");
_Static_assert(sizeof(dplb_router_line_t) == DPLB_CACHE_LINE, "router line size");
_Static_assert(sizeof(dplb_router_stats_t) == DPLB_CACHE_LINE, "router stats line size");
_Static_assert(sizeof(dplb_slot_t) == DPLB_SLOT_SIZE, "slot size");
_Static_assert(DPLB_SLOT_SIZE % DPLB_CACHE_LINE == 0, "slot is whole cache lines");
_Static_assert(DPLB_HEADER_SIZE % DPLB_CACHE_LINE == 0, "header is whole cache lines");
DPLB_ASSERT_OFF(dplb_header_t, version, 8);
DPLB_ASSERT_OFF(dplb_header_t, num_slots, 12);
DPLB_ASSERT_OFF(dplb_header_t, generation, 32);
DPLB_ASSERT_OFF(dplb_slot_t, worker_id, 8);
DPLB_ASSERT_OFF(dplb_slot_t, weight, 16);
DPLB_ASSERT_OFF(dplb_slot_t, heartbeat_ns, 24);
DPLB_ASSERT_OFF(dplb_slot_t, kv_cache_usage, 48);
DPLB_ASSERT_OFF(dplb_slot_t, ttft_ms, 56);
DPLB_ASSERT_OFF(dplb_slot_t, length_compat, DPLB_HOT_END);
DPLB_ASSERT_OFF(dplb_slot_t, prompt_len_hist, 320);
DPLB_ASSERT_OFF(dplb_slot_t, pid, 448);
DPLB_ASSERT_OFF(dplb_slot_t, completed, 520);
DPLB_ASSERT_OFF(dplb_slot_t, gpu_ids, 552);
DPLB_ASSERT_OFF(dplb_slot_t, ttft_ring, 584);
DPLB_ASSERT_OFF(dplb_slot_t, endpoint, 968);
DPLB_ASSERT_OFF(dplb_slot_t, model, 1096);
DPLB_ASSERT_OFF(dplb_slot_t, restarts, 1216);
DPLB_ASSERT_OFF(dplb_slot_t, engine_pid, 1228);
DPLB_ASSERT_OFF(dplb_slot_t, next_restart_ns, 1232);
DPLB_ASSERT_OFF(dplb_slot_t, control, 1240);
DPLB_ASSERT_OFF(dplb_slot_t, reserved1, 1368);
DPLB_ASSERT_OFF(dplb_slot_t, router, DPLB_DATA_END);
DPLB_ASSERT_OFF(dplb_slot_t, router.circuit, DPLB_DATA_END + 16);
DPLB_ASSERT_OFF(dplb_slot_t, router.prefill_tokens, DPLB_DATA_END + 24);
DPLB_ASSERT_OFF(dplb_slot_t, router.prefill_rate, DPLB_DATA_END + 48);
DPLB_ASSERT_OFF(dplb_slot_t, rstats, DPLB_DATA_END + DPLB_CACHE_LINE);

static inline dplb_slot_t *dplb_slot_at(void *base, uint32_t i) {
    return (dplb_slot_t *)((char *)base + DPLB_HEADER_SIZE + (size_t)i * DPLB_SLOT_SIZE);
}

static inline int64_t dplb_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t dplb_realtime_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline void dplb_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A reader that finds the sequence odd waits for the writer: a pause per spin, and every
 * DPLB_YIELD_EVERY spins the CPU itself (sched_yield), so that a writer preempted inside its write
 * on an oversubscribed machine gets to finish it. Pause alone (~40 ns x 1e6 spins) let a reader
 * give up on a live writer descheduled for one time slice, and read the slot as EMPTY (seen as 4
 * "torn" reads in 750,000 with two cores under heavy load). */
#define DPLB_YIELD_EVERY 1024
static inline void dplb_wait_writer(long spin) {
    if ((spin & (DPLB_YIELD_EVERY - 1)) == DPLB_YIELD_EVERY - 1) {
        sched_yield();
    } else {
        dplb_cpu_relax();
    }
}

/* Writer: publish bytes [8, DPLB_DATA_END) of `src` into `dst`. Only the slot's single writer
 * may call this. The sequence becomes odd for the duration of the copy. A sequence left odd by a
 * writer that was killed mid-write is repaired by the next write (its restarted agent's claim). */
static inline void dplb_seqlock_write(dplb_slot_t *dst, const dplb_slot_t *src) {
    uint64_t s = __atomic_load_n(&dst->seq, __ATOMIC_RELAXED);
    s += s & 1; /* a previous writer died inside a write: start from the next even value */
    __atomic_store_n(&dst->seq, s + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    memcpy((char *)dst + 8, (const char *)src + 8, DPLB_DATA_END - 8);
    __atomic_store_n(&dst->seq, s + 2, __ATOMIC_RELEASE);
}

/* Results of a guarded read besides success (a retry count >= 0). */
#define DPLB_READ_TORN (-1)  /* no consistent version within max_spins (a writer preempted that long) */
#define DPLB_READ_STALE (-2) /* the writer stopped inside a write: see DPLB_STALE_WRITE_NS */

/* A full read that finds the sequence odd at a yield point (every DPLB_YIELD_EVERY spins) while the
 * slot's heartbeat (loaded without the seqlock: the time of the writer's last publish, at latest
 * the start of the write in progress) is older than this gives up at once: the writer was killed
 * between its two stores (or a stray write made the sequence odd) and will never finish. A live
 * writer's copy takes well under a microsecond; 1 s is the routers' default heartbeat timeout
 * (health_check.heartbeat_timeout_ms), past which the worker is out of routing by its heartbeat
 * anyway, so the verdict changes no routing decision about a writer that is merely slow. Without
 * this, every read of such a slot spun DPLB_READ_MAX_SPINS (~10^6 pauses and 1000 yields) before
 * giving up: an idle router's health tick spent a third of a core. */
#define DPLB_STALE_WRITE_NS 1000000000LL

/* Is `src`'s heartbeat before `stale_before_ns`? (a relaxed load outside the seqlock: made only
 * while the sequence is odd, to tell a writer that stopped from one inside its copy) */
static inline int dplb_heartbeat_before(const dplb_slot_t *src, int64_t stale_before_ns) {
    return __atomic_load_n(&src->heartbeat_ns, __ATOMIC_RELAXED) < stale_before_ns;
}

/* Reader: copy bytes [8, end) of `src` into `dst` as one consistent version. `end` is
 * DPLB_HOT_END for the kernel, DPLB_DATA_END for full snapshots. Spins while a write is in
 * progress, at most `max_spins` times (DPLB_READ_TORN after that); at each yield point a sequence
 * still odd with the heartbeat before `stale_before_ns` ends the read as DPLB_READ_STALE
 * (INT64_MIN: never). Returns the number of spins made (the retries: 0 on a clean first read) and
 * stores 0, DPLB_READ_TORN or DPLB_READ_STALE in *result. On failure `dst` is unspecified. */
static inline long dplb_seqlock_read_ex(const dplb_slot_t *src, dplb_slot_t *dst, size_t end,
                                        long max_spins, int64_t stale_before_ns, int *result) {
    long spin;
    for (spin = 0; spin < max_spins; spin++) {
        uint64_t s1 = __atomic_load_n(&src->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1) {
            if ((spin & (DPLB_YIELD_EVERY - 1)) == DPLB_YIELD_EVERY - 1
                && dplb_heartbeat_before(src, stale_before_ns)) {
                *result = DPLB_READ_STALE;
                return spin;
            }
            dplb_wait_writer(spin);
            continue;
        }
        memcpy((char *)dst + 8, (const char *)src + 8, end - 8);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint64_t s2 = __atomic_load_n(&src->seq, __ATOMIC_RELAXED);
        if (s1 == s2) {
            dst->seq = s1;
            *result = 0;
            return spin;
        }
    }
    *result = DPLB_READ_TORN;
    return spin;
}

/* dplb_seqlock_read_ex without the stale verdict: returns the retries, or -1 (the slot then reads
 * as EMPTY in `dst`) when the sequence stayed odd for `max_spins`. The seqlock self-test's reader. */
static inline int dplb_seqlock_read(const dplb_slot_t *src, dplb_slot_t *dst, size_t end,
                                    long max_spins) {
    int r;
    long spins = dplb_seqlock_read_ex(src, dst, end, max_spins, INT64_MIN, &r);
    if (r == 0) return (int)spins;
    memset((char *)dst + 8, 0, end - 8);
    dst->state = DPLB_STATE_EMPTY;
    return -1;
}

/* Kernel reader: line 0 (bytes [8, DPLB_HOT_END)) plus length_compat[b], as one consistent
 * version. Returns the retries, or -1: the sequence stayed odd for `max_spins`, or it is odd while
 * the heartbeat is before `stale_before_ns` (the kernel passes now - heartbeat timeout: such
 * a slot is ineligible whatever the write brings, so the pick skips it without waiting). */
static inline int dplb_seqlock_read_hot(const dplb_slot_t *src, dplb_slot_t *dst, int b,
                                        long max_spins, int64_t stale_before_ns) {
    int retries = 0;
    for (long spin = 0; spin < max_spins; spin++) {
        uint64_t s1 = __atomic_load_n(&src->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1) {
            if (dplb_heartbeat_before(src, stale_before_ns)) break;
            dplb_wait_writer(spin);
            retries++;
            continue;
        }
        memcpy((char *)dst + 8, (const char *)src + 8, DPLB_HOT_END - 8);
        memcpy(&dst->length_compat[b], &src->length_compat[b], sizeof(double));
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        uint64_t s2 = __atomic_load_n(&src->seq, __ATOMIC_RELAXED);
        if (s1 == s2) {
            dst->seq = s1;
            return retries;
        }
        retries++;
    }
    dst->state = DPLB_STATE_EMPTY;
    return -1;
}

/* ---- router line and header atomics (several router processes, no lock) ------------------ */

static inline int64_t dplb_router_inflight_add(dplb_slot_t *s, int64_t delta) {
    return __atomic_add_fetch(&s->router.router_inflight, delta, __ATOMIC_ACQ_REL);
}
static inline uint64_t dplb_dispatched_add(dplb_slot_t *s, uint64_t n) {
    return __atomic_add_fetch(&s->router.dispatched, n, __ATOMIC_ACQ_REL);
}
static inline void dplb_circuit_set(dplb_slot_t *s, int32_t c) {
    __atomic_store_n(&s->router.circuit, c, __ATOMIC_RELEASE);
}
static inline int64_t dplb_router_inflight_get(const dplb_slot_t *s) {
    return __atomic_load_n(&s->router.router_inflight, __ATOMIC_ACQUIRE);
}
static inline uint64_t dplb_dispatched_get(const dplb_slot_t *s) {
    return __atomic_load_n(&s->router.dispatched, __ATOMIC_ACQUIRE);
}
static inline int32_t dplb_circuit_get(const dplb_slot_t *s) {
    return __atomic_load_n(&s->router.circuit, __ATOMIC_ACQUIRE);
}
static inline uint64_t dplb_u64_add(uint64_t *p, uint64_t n) {
    return __atomic_add_fetch(p, n, __ATOMIC_ACQ_REL);
}
static inline int64_t dplb_i64_add(int64_t *p, int64_t delta) {
    return __atomic_add_fetch(p, delta, __ATOMIC_ACQ_REL);
}
static inline void dplb_i64_set(int64_t *p, int64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}
static inline int64_t dplb_i64_get(const int64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline uint64_t dplb_u64_get(const uint64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline double dplb_f64_get(const uint64_t *bits) {
    uint64_t b = __atomic_load_n(bits, __ATOMIC_ACQUIRE);
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}
static inline void dplb_f64_set(uint64_t *bits, double v) {
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    __atomic_store_n(bits, b, __ATOMIC_RELEASE);
}

/* Lock-free exponentially weighted average shared by every router process: `bits` holds a double
 * (0 = no sample yet). The sample is first clipped to [cur/clip, cur*clip] (clip > 1; 0 = no
 * clipping) so one outlier moves the average by at most alpha*(clip-1)*cur, then
 * cur += alpha*(sample - cur), committed by compare-and-swap (retried if another router process
 * committed in between). The first sample is taken whole. `n` counts samples. Returns the new
 * value. */
static inline double dplb_ewma_observe(uint64_t *bits, uint64_t *n, double sample, double alpha, double clip) {
    uint64_t old = __atomic_load_n(bits, __ATOMIC_RELAXED), nw;
    double v;
    do {
        double cur;
        memcpy(&cur, &old, sizeof cur);
        if (!(cur > 0.0)) {
            v = sample;
        } else {
            double x = sample;
            if (clip > 1.0) {
                if (x > cur * clip) x = cur * clip;
                if (x < cur / clip) x = cur / clip;
            }
            v = cur + alpha * (x - cur);
        }
        memcpy(&nw, &v, sizeof nw);
    } while (!__atomic_compare_exchange_n(bits, &old, nw, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
    __atomic_add_fetch(n, 1, __ATOMIC_RELAXED);
    return v;
}

static inline uint64_t dplb_generation_bump(dplb_header_t *h) {
    return __atomic_add_fetch(&h->generation, 1, __ATOMIC_ACQ_REL);
}
static inline uint64_t dplb_generation_get(const dplb_header_t *h) {
    return __atomic_load_n(&h->generation, __ATOMIC_ACQUIRE);
}
static inline uint64_t dplb_magic_get(const dplb_header_t *h) {
    return __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE);
}
static inline void dplb_magic_set(dplb_header_t *h, uint64_t m) {
    __atomic_store_n(&h->magic, m, __ATOMIC_RELEASE);
}

/* ---- field table: name, offsetof, sizeof of every field, exported for tests ---------------- */

typedef struct dplb_field { const char *name; size_t offset; size_t size; } dplb_field_t;
#define DPLB_F(T, f) { #f, offsetof(T, f), sizeof(((T *)0)->f) }

static const dplb_field_t dplb_header_fields[] = {
    DPLB_F(dplb_header_t, magic), DPLB_F(dplb_header_t, version),
    DPLB_F(dplb_header_t, num_slots), DPLB_F(dplb_header_t, slot_size),
    DPLB_F(dplb_header_t, header_size), DPLB_F(dplb_header_t, created_ns),
    DPLB_F(dplb_header_t, generation), DPLB_F(dplb_header_t, creator_pid),
    DPLB_F(dplb_header_t, reserved),
    { 0, 0, 0 },
};

static const dplb_field_t dplb_slot_fields[] = {
    DPLB_F(dplb_slot_t, seq), DPLB_F(dplb_slot_t, worker_id), DPLB_F(dplb_slot_t, state),
    DPLB_F(dplb_slot_t, weight), DPLB_F(dplb_slot_t, heartbeat_ns),
    DPLB_F(dplb_slot_t, num_running), DPLB_F(dplb_slot_t, num_waiting),
    DPLB_F(dplb_slot_t, inflight), DPLB_F(dplb_slot_t, max_num_seqs),
    DPLB_F(dplb_slot_t, kv_cache_usage), DPLB_F(dplb_slot_t, ttft_ms), DPLB_F(dplb_slot_t, length_compat),
    DPLB_F(dplb_slot_t, prompt_len_hist), DPLB_F(dplb_slot_t, pid), DPLB_F(dplb_slot_t, num_gpus),
    DPLB_F(dplb_slot_t, queued_prompt_tokens), DPLB_F(dplb_slot_t, gpu_mem_used_bytes),
    DPLB_F(dplb_slot_t, gpu_mem_total_bytes), DPLB_F(dplb_slot_t, tpot_ms),
    DPLB_F(dplb_slot_t, e2e_ms), DPLB_F(dplb_slot_t, ttft_p99_ms), DPLB_F(dplb_slot_t, tpot_p99_ms),
    DPLB_F(dplb_slot_t, e2e_p99_ms), DPLB_F(dplb_slot_t, completed), DPLB_F(dplb_slot_t, failed),
    DPLB_F(dplb_slot_t, ttft_n), DPLB_F(dplb_slot_t, tpot_n), DPLB_F(dplb_slot_t, e2e_n),
    DPLB_F(dplb_slot_t, agent_restarts), DPLB_F(dplb_slot_t, gpu_ids), DPLB_F(dplb_slot_t, ttft_ring),
    DPLB_F(dplb_slot_t, tpot_ring), DPLB_F(dplb_slot_t, e2e_ring), DPLB_F(dplb_slot_t, endpoint),
    DPLB_F(dplb_slot_t, model), DPLB_F(dplb_slot_t, restarts), DPLB_F(dplb_slot_t, last_exit_code),
    DPLB_F(dplb_slot_t, state_reason), DPLB_F(dplb_slot_t, engine_pid), DPLB_F(dplb_slot_t, next_restart_ns),
    DPLB_F(dplb_slot_t, control),
    DPLB_F(dplb_slot_t, reserved1), DPLB_F(dplb_slot_t, router), DPLB_F(dplb_slot_t, rstats),
    { 0, 0, 0 },
};

static const dplb_field_t dplb_router_fields[] = {
    DPLB_F(dplb_router_line_t, router_inflight), DPLB_F(dplb_router_line_t, dispatched),
    DPLB_F(dplb_router_line_t, circuit), DPLB_F(dplb_router_line_t, reserved0),
    DPLB_F(dplb_router_line_t, prefill_tokens), DPLB_F(dplb_router_line_t, decode_reqs),
    DPLB_F(dplb_router_line_t, decode_ctx_tokens), DPLB_F(dplb_router_line_t, prefill_rate),
    DPLB_F(dplb_router_line_t, prefill_rate_n),
    { 0, 0, 0 },
};

static const dplb_field_t dplb_rstats_fields[] = {
    DPLB_F(dplb_router_stats_t, ttft_s), DPLB_F(dplb_router_stats_t, tpot_s),
    DPLB_F(dplb_router_stats_t, ttft_n), DPLB_F(dplb_router_stats_t, tpot_n),
    DPLB_F(dplb_router_stats_t, completed), DPLB_F(dplb_router_stats_t, failed),
    DPLB_F(dplb_router_stats_t, reserved),
    { 0, 0, 0 },
};

#endif /* DPLB_SHM_H */
