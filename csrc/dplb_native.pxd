# Extern declarations of csrc/dplb_shm.h (segment layout + seqlock) and csrc/dplb_kernel.h
# (scoring kernel) for Cython. The header is the source of truth; keep these in step with it.
from libc.stdint cimport int16_t, int32_t, int64_t, uint32_t, uint64_t, uint8_t


cdef extern from "dplb_shm.h" nogil:
    const uint64_t DPLB_MAGIC
    const int DPLB_LAYOUT_VERSION
    const int DPLB_CACHE_LINE
    const int DPLB_HEADER_SIZE
    const int DPLB_SLOT_SIZE
    const int DPLB_MAX_SLOTS
    const int DPLB_WINDOW
    const int DPLB_HIST_BINS
    const int DPLB_MAX_GPUS
    const int DPLB_ENDPOINT_LEN
    const int DPLB_UNIX_PATH_MAX
    const int DPLB_MODEL_LEN
    const int DPLB_HOT_END
    const int DPLB_DATA_END
    const int DPLB_STATE_EMPTY
    const int DPLB_STATE_STARTING
    const int DPLB_STATE_READY
    const int DPLB_STATE_DRAINING
    const int DPLB_STATE_DEAD
    const int DPLB_REASON_NONE
    const int DPLB_REASON_GAVE_UP

    ctypedef struct dplb_header_t:
        uint64_t magic
        uint32_t version
        uint32_t num_slots
        uint32_t slot_size
        uint32_t header_size
        int64_t created_ns
        uint64_t generation
        int32_t creator_pid

    ctypedef struct dplb_router_line_t:
        int64_t router_inflight
        uint64_t dispatched
        int32_t circuit
        int64_t prefill_tokens
        int64_t decode_reqs
        int64_t decode_ctx_tokens
        uint64_t prefill_rate
        uint64_t prefill_rate_n

    ctypedef struct dplb_router_stats_t:
        uint64_t ttft_s
        uint64_t tpot_s
        uint64_t ttft_n
        uint64_t tpot_n
        uint64_t completed
        uint64_t failed

    ctypedef struct dplb_slot_t:
        uint64_t seq
        int32_t worker_id
        int32_t state
        double weight
        int64_t heartbeat_ns
        int32_t num_running
        int32_t num_waiting
        int32_t inflight
        int32_t max_num_seqs
        double kv_cache_usage
        double ttft_ms
        double length_compat[32]
        uint32_t prompt_len_hist[32]
        int32_t pid
        int32_t num_gpus
        int64_t queued_prompt_tokens
        int64_t gpu_mem_used_bytes
        int64_t gpu_mem_total_bytes
        double tpot_ms
        double e2e_ms
        double ttft_p99_ms
        double tpot_p99_ms
        double e2e_p99_ms
        uint64_t completed
        uint64_t failed
        uint32_t ttft_n
        uint32_t tpot_n
        uint32_t e2e_n
        uint32_t agent_restarts
        int16_t gpu_ids[16]
        float ttft_ring[32]
        float tpot_ring[32]
        float e2e_ring[32]
        char endpoint[128]
        char model[120]
        uint32_t restarts
        int32_t last_exit_code
        uint32_t state_reason
        int32_t engine_pid
        int64_t next_restart_ns
        char control[128]
        dplb_router_line_t router
        dplb_router_stats_t rstats

    dplb_slot_t *dplb_slot_at(void *base, uint32_t i)
    int64_t dplb_now_ns()
    int64_t dplb_realtime_ns()
    void dplb_seqlock_write(dplb_slot_t *dst, const dplb_slot_t *src)
    int dplb_seqlock_read(const dplb_slot_t *src, dplb_slot_t *dst, size_t end, long max_spins)
    long dplb_seqlock_read_ex(const dplb_slot_t *src, dplb_slot_t *dst, size_t end, long max_spins,
                              int64_t stale_before_ns, int *result)
    const int DPLB_READ_TORN
    const int DPLB_READ_STALE
    const int64_t DPLB_STALE_WRITE_NS


cdef extern from "dplb_kernel.h" nogil:
    const long DPLB_READ_MAX_SPINS
    ctypedef struct dplb_params_t:
        double w_pending
        double w_kv
        double w_latency
        double w_length
        int32_t max_queue
        double kv_cache_threshold
        double heartbeat_timeout_ms
        double latency_scale_ms

    ctypedef struct dplb_terms_t:
        int32_t worker_id
        double score
        double pending
        double pending_term
        double kv_term
        double latency_term
        double length_term
        double affinity
        double weight

    int dplb_len_bin(int64_t n)
    double dplb_length_compat(const uint32_t *hist, int b)
    void dplb_refresh_compat(dplb_slot_t *s)
    int dplb_pick(const void *base, uint32_t num_slots, const dplb_params_t *p, int64_t prompt_len,
                  const double *affinity, uint32_t n_aff, int64_t now_ns, double rng_u,
                  double *scores, dplb_terms_t *terms, int *n_terms)
    ctypedef struct dplb_ttft_params_t:
        double prefill_rate
        double waiting_tokens
        double step_tokens
        double step_base_s
        double decode_seq_s
        double decode_ctx_s
        double kv_barrier_s
        double w_decode
        double kv_cache_threshold
        double heartbeat_timeout_ms
        double rate_band
        double w_interf
        double w_miss
        double interf_batch_cap

    ctypedef struct dplb_ttft_terms_t:
        int32_t worker_id
        double est_s
        double queue_tokens
        double uncached_tokens
        double rate
        double own_rate
        double steps
        double prefill_s
        double decode_s
        double kv_s
        double batch_s
        double interf_s
        double miss_s
        double decode_reqs
        double batch
        double outside_reqs
        double weight

    int dplb_pick_ttft(const void *base, uint32_t num_slots, const dplb_ttft_params_t *p, int64_t prompt_len,
                       double out_tokens, const double *uncached, uint32_t n_unc, int64_t now_ns, double rng_u,
                       double *ests, dplb_ttft_terms_t *terms, int *n_terms)
    uint64_t dplb_splitmix64(uint64_t *state)
    double dplb_rng_u(uint64_t *state)


cdef extern from "dplb_shm.h" nogil:
    int64_t dplb_router_inflight_add(dplb_slot_t *s, int64_t delta)
    uint64_t dplb_dispatched_add(dplb_slot_t *s, uint64_t n)
    void dplb_circuit_set(dplb_slot_t *s, int32_t c)
    int64_t dplb_router_inflight_get(const dplb_slot_t *s)
    uint64_t dplb_dispatched_get(const dplb_slot_t *s)
    int32_t dplb_circuit_get(const dplb_slot_t *s)
    uint64_t dplb_u64_add(uint64_t *p, uint64_t n)
    int64_t dplb_i64_add(int64_t *p, int64_t delta)
    int64_t dplb_i64_get(const int64_t *p)
    void dplb_i64_set(int64_t *p, int64_t v)
    uint64_t dplb_u64_get(const uint64_t *p)
    double dplb_f64_get(const uint64_t *bits)
    void dplb_f64_set(uint64_t *bits, double v)
    double dplb_ewma_observe(uint64_t *bits, uint64_t *n, double sample, double alpha, double clip)
    uint64_t dplb_generation_bump(dplb_header_t *h)
    uint64_t dplb_generation_get(const dplb_header_t *h)
    uint64_t dplb_magic_get(const dplb_header_t *h)
    void dplb_magic_set(dplb_header_t *h, uint64_t m)

    ctypedef struct dplb_field_t:
        const char *name
        size_t offset
        size_t size
    const dplb_field_t dplb_header_fields[]
    const dplb_field_t dplb_slot_fields[]
    const dplb_field_t dplb_router_fields[]
    const dplb_field_t dplb_rstats_fields[]
