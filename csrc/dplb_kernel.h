/*
 * dplb_kernel.h -- DPLB's scoring kernel: one pass over every slot, one routing decision.
 *
 * dplb_shm/reference.py is the same function in pure Python; tests/csrc/test_kernel_equiv.py
 * checks that both give the same choice and the same terms. Change both together.
 *
 * For slot i, read once (line 0 and length_compat[bin(prompt_len)] under the seqlock, the router
 * line with relaxed atomic loads):
 *
 *   eligible  = state == READY
 *               && now_ns - heartbeat_ns <= (int64)(heartbeat_timeout_ms * 1e6)
 *               && circuit != OPEN                 (HALF_OPEN is eligible: it admits probes)
 *               && kv_cache_usage <= kv_cache_threshold   (unknown, -1, passes)
 *               && weight > 0
 *   pending   = max(num_running + num_waiting, inflight) + max(0, router_inflight - inflight)
 *               The engine's own counts lag by one state interval and the agent's in-flight count
 *               may already include requests the engine has not reported yet, so the larger of
 *               the two is the worker's known load; router_inflight - inflight is what routers
 *               dispatched that the agent has not seen yet (on the wire, or dispatched since the
 *               last publish). Counting it is what stops a burst piling onto one worker between
 *               two state refreshes.
 *   max_queue = params.max_queue if > 0, else the slot's max_num_seqs, else 256
 *               (256: vLLM's EngineArgs default max_num_seqs). It is the queue *scale*: the
 *               pending count at which the queue term reaches 0 (the router passes 16).
 *   pending_term = w_pending * (1 - pending / max_queue)            NOT clipped at 0
 *               Unlike the seeds' clip(pending/max_queue, 0, 1): clipping made every worker past
 *               max_queue look equally full, and with vLLM's 256 one request was worth 0.0016 of
 *               score, far below the spread of the TTFT term (~0.13 between idle workers), so
 *               bursts herded onto one worker (bench/results/NOTES.md). Unclipped and linear, one
 *               request is always worth w_pending/max_queue (0.025 at 16): the other terms are
 *               bounded (latency <= 0.2, KV <= 0.3, length <= 0.1), so none of them can outweigh
 *               more than a fixed number of queued requests, at any depth.
 *   kv_term      = w_kv * (1 - kv)               kv = 0 when unknown (-1)
 *   latency_term = w_latency * 1 / (1 + ttft_ms / latency_scale_ms)    1.0 when no sample (-1)
 *   length_term  = w_length * compat, where b = bin(prompt_len), bin(x) = floor(log2 x) clipped
 *                  to [0, 31] (bin(0) = bin(1) = 0), and
 *                    compat = sum_k h[k] * 2^-|k-b| / sum_k h[k]      (1.0 if nothing queued)
 *                  with h[k] = min(hist[k], 2^26), summed exactly in 31-bit fixed point,
 *                  precomputed by the writer for every b (dplb_refresh_compat, slot.length_compat),
 *                  i.e. 1 when everything queued is in the prompt's own power-of-two bucket,
 *                  halving per bucket of distance (prompts of similar length batch well together:
 *                  similar prefill cost, similar padding in chunked prefill).
 *   score = weight * (((pending_term + kv_term) + latency_term) + length_term) + affinity[i]
 *   (weights default to the seeds' 0.4/0.3/0.2/0.1, docs/DESIGN.md "Scoring").
 *
 * Pick: best = max score over eligible slots; ties = eligible slots with score >= best - 1e-9;
 * the winner is ties[floor(rng_u * len(ties))] in slot order, so ties break uniformly at random
 * and slot 0 is never favoured. No eligible slot: -1.
 *
 * Evaluation order above is the order of floating-point operations; the reference follows it so
 * both give bit-identical scores (built with -ffp-contract=off: no fused multiply-add).
 */
#ifndef DPLB_KERNEL_H
#define DPLB_KERNEL_H

#include <math.h>

#include "dplb_shm.h"

#define DPLB_TIE_EPS 1e-9
#define DPLB_DEFAULT_MAX_QUEUE 256
/* Full reads (snapshots) wait up to 10^6 spins (tens of ms) for a preempted writer; the kernel
 * waits only DPLB_KERNEL_MAX_SPINS and skips the slot for this decision instead of stalling the
 * router (a writer's critical section is a ~1 KB memcpy, well under a microsecond). */
#define DPLB_READ_MAX_SPINS 1000000L
#define DPLB_KERNEL_MAX_SPINS 256L

typedef struct dplb_params {
    double w_pending;
    double w_kv;
    double w_latency;
    double w_length;
    int32_t max_queue;
    double kv_cache_threshold;
    double heartbeat_timeout_ms;
    double latency_scale_ms;
} dplb_params_t;

typedef struct dplb_terms {
    int32_t worker_id;
    double score;
    double pending;
    double pending_term;
    double kv_term;
    double latency_term;
    double length_term;
    double affinity;
    double weight;
} dplb_terms_t;

static inline int dplb_len_bin(int64_t n) {
    if (n <= 1) return 0;
    int b = 63 - __builtin_clzll((unsigned long long)n);
    return b > DPLB_HIST_BINS - 1 ? DPLB_HIST_BINS - 1 : b;
}

/* Histogram counts saturate here for scoring, so the fixed-point sum below cannot overflow:
 * 32 bins * 2^26 * 2^31 < 2^63. (67M queued prompts in one bin is far beyond any engine.) */
#define DPLB_HIST_SAT (1u << 26)

/* compat = sum_k hist[k] * 2^-|k-b| / sum_k hist[k], in fixed point with 31 fractional bits:
 * integer sums are exact and branch-free (no mispredicts, no 4-cycle FP add chain), and the
 * result is the correctly rounded (double)num * 2^-31 / (double)den, which Python reproduces. */
static inline double dplb_length_compat(const uint32_t *hist, int b) {
    uint64_t num = 0, den = 0;
    for (int k = 0; k < DPLB_HIST_BINS; k++) {
        uint64_t c = hist[k] < DPLB_HIST_SAT ? hist[k] : DPLB_HIST_SAT;
        int d = k > b ? k - b : b - k;
        num += c << (31 - d);
        den += c;
    }
    return den ? ((double)(int64_t)num * 0x1p-31) / (double)den : 1.0;
}

/* Writer side: recompute the slot's length_compat table from its histogram (32 x 32 steps,
 * done once per histogram change so the kernel reads one double instead of 32 counts). */
static inline void dplb_refresh_compat(dplb_slot_t *s) {
    for (int b = 0; b < DPLB_HIST_BINS; b++) s->length_compat[b] = dplb_length_compat(s->prompt_len_hist, b);
}

/*
 * Score every slot of the segment at `base` and pick one.
 *   affinity: n_aff doubles (slot i gets affinity[i] when i < n_aff, else 0); may be NULL.
 *   scores:   scratch of num_slots doubles (caller-owned).
 *   terms:    NULL, or num_slots entries receiving the terms of every eligible slot, in slot
 *             order; *n_terms gets their count.
 * Returns the chosen slot index or -1.
 */
static inline int dplb_pick(const void *base, uint32_t num_slots, const dplb_params_t *p,
                            int64_t prompt_len, const double *affinity, uint32_t n_aff,
                            int64_t now_ns, double rng_u, double *scores, dplb_terms_t *terms,
                            int *n_terms) {
    dplb_slot_t s;
    const int b = dplb_len_bin(prompt_len);
    const int64_t hb_timeout_ns = (int64_t)(p->heartbeat_timeout_ms * 1e6);
    double best = 0.0;
    int any = 0, nt = 0;
    for (uint32_t i = 0; i < num_slots; i++) {
        const dplb_slot_t *src = dplb_slot_at((void *)base, i);
        scores[i] = -1.0 / 0.0;
        if (__atomic_load_n(&src->state, __ATOMIC_RELAXED) != DPLB_STATE_READY) continue;
        if (dplb_seqlock_read_hot(src, &s, b, DPLB_KERNEL_MAX_SPINS, now_ns - hb_timeout_ns) < 0) continue;
        int32_t circuit = __atomic_load_n(&src->router.circuit, __ATOMIC_RELAXED);
        int64_t rinfl = __atomic_load_n(&src->router.router_inflight, __ATOMIC_RELAXED);
        if (s.state != DPLB_STATE_READY) continue;
        if (now_ns - s.heartbeat_ns > hb_timeout_ns) continue;
        if (circuit == DPLB_CIRCUIT_OPEN) continue;
        if (s.kv_cache_usage > p->kv_cache_threshold) continue;
        if (!(s.weight > 0.0)) continue;

        int64_t engine = (int64_t)s.num_running + (int64_t)s.num_waiting;
        int64_t known = engine > s.inflight ? engine : (int64_t)s.inflight;
        int64_t unseen = rinfl - (int64_t)s.inflight;
        if (unseen < 0) unseen = 0;
        double pending = (double)(known + unseen);
        double mq = p->max_queue > 0 ? (double)p->max_queue
                  : (s.max_num_seqs > 0 ? (double)s.max_num_seqs : (double)DPLB_DEFAULT_MAX_QUEUE);
        double pending_term = p->w_pending * (1.0 - pending / mq);
        double kv = s.kv_cache_usage < 0.0 ? 0.0 : s.kv_cache_usage;
        double kv_term = p->w_kv * (1.0 - kv);
        double lat = s.ttft_ms < 0.0 ? 1.0 : 1.0 / (1.0 + s.ttft_ms / p->latency_scale_ms);
        double latency_term = p->w_latency * lat;
        double length_term = p->w_length * s.length_compat[b];
        double aff = i < n_aff && affinity ? affinity[i] : 0.0;
        double score = s.weight * (((pending_term + kv_term) + latency_term) + length_term) + aff;
        scores[i] = score;
        if (!any || score > best) best = score;
        any = 1;
        if (terms) {
            dplb_terms_t *t = &terms[nt];
            t->worker_id = (int32_t)i;
            t->score = score;
            t->pending = pending;
            t->pending_term = pending_term;
            t->kv_term = kv_term;
            t->latency_term = latency_term;
            t->length_term = length_term;
            t->affinity = aff;
            t->weight = s.weight;
        }
        nt++;
    }
    if (n_terms) *n_terms = nt;
    if (!any) return -1;
    const double floor_ = best - DPLB_TIE_EPS;
    int k = 0;
    for (uint32_t i = 0; i < num_slots; i++) k += scores[i] >= floor_;
    int j = (int)(rng_u * (double)k);
    if (j >= k) j = k - 1;
    if (j < 0) j = 0;
    for (uint32_t i = 0; i < num_slots; i++) {
        if (scores[i] >= floor_) {
            if (j == 0) return (int)i;
            j--;
        }
    }
    return -1; /* unreachable */
}

/*
 * ---- The estimated-TTFT kernel (policy `dplb`) ------------------------------------------------
 *
 * Choose the worker with the smallest estimated time to first token of THIS request, counted in
 * tokens, not requests (one Mooncake request is 300 tokens, another 85,000). For eligible slot i
 * (same eligibility as dplb_pick), with the router line read by relaxed atomic loads:
 *
 *   X_i     = max(0, num_running_i + num_waiting_i - inflight_i): requests in the engine that no
 *             router here dispatched (sent around the routers, or before a router restart). The
 *             agent takes the engine's counts and the routers' in-flight count (inflight_i) at the
 *             same scrape, so X_i is not skewed by the scrape's age: requests that finished or
 *             were dispatched since leave it unchanged. Between two scrapes everything the
 *             routers dispatched is in their live counters below.
 *   W_i     = max(prefill_tokens_i, 0) + min(X_i, num_waiting_i) * waiting_tokens
 *             prefill_tokens_i: uncached prompt tokens dispatched to i by the routers whose first
 *             token has not come back: the prefill queue ahead (continuous batching serves it
 *             first, FCFS), live; plus the outside requests still waiting in the engine, priced
 *             at waiting_tokens each. (Taking the engine's stale num_waiting * waiting_tokens
 *             when larger, as before, priced the routers' own short requests at 1,024 tokens
 *             each until the next scrape: a burst split 0.28/0.16 and 8 engines in a closed loop
 *             got min shares of 0.09.)
 *   u_i     = uncached[i] when given (the router's prefix index: prompt tokens not cached on i),
 *             else prompt_len; uncached[i] < 0 excludes slot i (the router rules it out)
 *   r_i     = prefill_rate_i when > 0 (learned online from observed TTFTs), else p->prefill_rate;
 *             then, with rate_band > 0, pooled: let m = the median of r over the eligible workers;
 *             a worker whose r_i lies within [m / (1 + rate_band), m * (1 + rate_band)] is priced
 *             at m. Learned rates of identical engines drift apart by the noise of their samples
 *             (a busy host, the mix of prompts each happened to get); priced as they stand, a
 *             burst on idle workers follows that noise (a 1.4x drift gave a 0.305/0.215 share in
 *             the benchmark). Within the band the workers count as equally fast; a worker outside
 *             it (a slower GPU, another model, a degraded engine) keeps its own rate.
 *   steps_i = 1 + floor((W_i + u_i) / step_tokens)   engine steps until our last prompt chunk
 *             (chunked prefill: at most step_tokens = max_num_batched_tokens per step)
 *   prefill_s = (W_i + u_i) / r_i
 *   decode_s  = steps_i * (step_base_s + decode_seq_s * D_i + decode_ctx_s * C_i)
 *             D_i = max(0, decode_reqs_i), C_i = max(0, decode_ctx_tokens_i): every step that
 *             carries our prefill also carries one token of each running decode, whose cost
 *             grows with its attention context (vLLM V1 mixes them in one batch)
 *   kv_s      = kv_barrier_s * k / (1 - k), k = min(kv_cache_usage, 0.99) (unknown -1 -> 0):
 *             a convex barrier as the KV cache fills (SGLang gateway least_load's 0.15 s * k/(1-k));
 *             above kv_cache_threshold the worker is not eligible at all
 *   batch_s   = w_decode * out_tokens * (decode_seq_s * B_i + decode_ctx_s * C_i)
 *             what the batch already on i adds to this request's own decode (out_tokens steps, each
 *             slowed by every request in the batch and its context): B_i = max(router_inflight_i, 0)
 *             + X_i, the requests sharing i's steps. TTFT alone would
 *             pile a burst that shares a cached prefix onto one worker (each costs it ~0 prefill),
 *             where every TPOT suffers; this term prices that. out_tokens is the request's expected
 *             output (its max_tokens, capped); w_decode = 0 turns the term off.
 *   interf_s  = w_interf * min(B_i, interf_batch_cap) * u_i / r_i   (cap 0 = none)
 *             what our prefill costs the work already on i (the cluster's side of the choice, not
 *             this request's): continuous batching runs our u_i prompt tokens in the same steps as
 *             the B_i requests in flight there (the decodes, and the prefills queued ahead, which
 *             decode while ours runs), so each of their next tokens comes u_i / r_i later; the
 *             summed delay is B_i * u_i / r_i seconds. A queued prefill behind a FCFS arrival does
 *             not exist (we queue last), so nothing else is delayed. With w_interf = 1,
 *             prefill_s's own u_i/r_i plus this is u_i * (B_i + 1) / r_i: lmetric's score in
 *             seconds (lmetric leaves out the queue ahead; we keep it). 0 turns the term off.
 *             The cap (64): beyond it the differences in B_i between workers say which worker
 *             holds the long outputs, not how much harm our prefill does (decodes with slack
 *             absorb it; the router's TPOT-SLO term prices the ones without); uncapped, a worker
 *             with a small batch drew every long prompt until its prefill saturated (Azure's
 *             conversation trace, docs/DESIGN.md "Capping the batch the interference counts").
 *   miss_s    = w_miss * (u_i - u_min) / r_i,  u_min = min over the eligible workers of u_j
 *             the compute a prefix miss spends that the best-hit placement would not: worker i's
 *             prefill is busy that much longer, and each request that arrives there before the
 *             recompute drains waits for it in full (FCFS). w_miss is that number of requests (a
 *             count; 0 turns the term off), so miss_s is their summed delay in seconds. It prices
 *             the recompute once more than prefill_s does (which counts only this request's wait).
 *   est_i     = (((((prefill_s + decode_s) + kv_s) + batch_s) + interf_s) + miss_s) / weight_i
 *
 * Pick the smallest est_i; ties (est <= best + 1e-9 s) break uniformly at random in slot order.
 * The prefix-cache bonus is exactly the prefill time a hit saves (u_i smaller), so a hot prefix
 * escapes to another worker exactly when queueing there costs more than recomputing it.
 * dplb_shm/reference.py (pick_ttft) is the same function in Python; keep them in step.
 */
typedef struct dplb_ttft_params {
    double prefill_rate;        /* tokens/s used until a worker has learned its own */
    double waiting_tokens;      /* prompt tokens assumed per request waiting in the engine */
    double step_tokens;         /* max_num_batched_tokens: prompt tokens per engine step */
    double step_base_s;         /* fixed cost of one engine step, s */
    double decode_seq_s;        /* per decoding request per step, s */
    double decode_ctx_s;        /* per context token of decoding requests per step, s */
    double kv_barrier_s;        /* scale of the KV barrier, s */
    double w_decode;            /* weight of batch_s (0 = TTFT only) */
    double kv_cache_threshold;
    double heartbeat_timeout_ms;
    double rate_band;           /* learned rates within this fraction of the median count as the median; 0 = off */
    double w_interf;            /* weight of interf_s (0 = off) */
    double w_miss;              /* weight of miss_s: later requests assumed to wait behind a recompute (0 = off) */
    double interf_batch_cap;    /* interf_s counts at most this many of B_i (0 = no cap) */
} dplb_ttft_params_t;

typedef struct dplb_ttft_terms {
    int32_t worker_id;
    double est_s;
    double queue_tokens;
    double uncached_tokens;
    double rate;
    double own_rate;            /* the worker's own rate (learned or seed) before pooling */
    double steps;
    double prefill_s;
    double decode_s;
    double kv_s;
    double batch_s;
    double interf_s;            /* our prefill's delay summed over the B_i requests sharing its steps */
    double miss_s;              /* the recompute a prefix miss costs the requests arriving behind it */
    double decode_reqs;
    double batch;
    double outside_reqs;        /* X_i: requests in the engine no router here dispatched */
    double weight;
} dplb_ttft_terms_t;

/* The k-th smallest (0-based) of a[0..n), in place (Hoare's selection; a is reordered). */
static inline double dplb_select_kth(double *a, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        double pivot = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] < pivot) i++;
            while (a[j] > pivot) j--;
            if (i <= j) {
                double t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else break;
    }
    return a[k];
}

/* The median of a[0..n), n > 0: the middle value, or the mean of the two middle values (a is
 * reordered). */
static inline double dplb_median(double *a, int n) {
    int k = n / 2;
    double hi = dplb_select_kth(a, n, k);
    if (n % 2) return hi;
    double lo = a[0];  /* a[0..k) now holds the k smallest: the largest of them is the (k-1)-th */
    for (int i = 1; i < k; i++)
        if (a[i] > lo) lo = a[i];
    return (lo + hi) / 2.0;
}

/* terms: required, num_slots entries (filled for the eligible workers, slot order; *n_terms
 * tells how many); ests: num_slots entries, NaN for the ineligible. */
static inline int dplb_pick_ttft(const void *base, uint32_t num_slots, const dplb_ttft_params_t *p,
                                 int64_t prompt_len, double out_tokens, const double *uncached, uint32_t n_unc,
                                 int64_t now_ns, double rng_u, double *ests, dplb_ttft_terms_t *terms,
                                 int *n_terms) {
    dplb_slot_t s;
    const int64_t hb_timeout_ns = (int64_t)(p->heartbeat_timeout_ms * 1e6);
    int nt = 0;
    /* pass 1: every eligible worker's terms, priced at its own rate */
    for (uint32_t i = 0; i < num_slots; i++) {
        dplb_slot_t *src = dplb_slot_at((void *)base, i);
        if (__atomic_load_n(&src->state, __ATOMIC_RELAXED) != DPLB_STATE_READY) continue;
        double u = uncached && i < n_unc ? uncached[i] : (double)prompt_len;
        if (u < 0.0) continue;
        if (dplb_seqlock_read_hot(src, &s, 0, DPLB_KERNEL_MAX_SPINS, now_ns - hb_timeout_ns) < 0) continue;
        int32_t circuit = __atomic_load_n(&src->router.circuit, __ATOMIC_RELAXED);
        int64_t rinfl = __atomic_load_n(&src->router.router_inflight, __ATOMIC_RELAXED);
        int64_t w_tok = __atomic_load_n(&src->router.prefill_tokens, __ATOMIC_RELAXED);
        int64_t d_req = __atomic_load_n(&src->router.decode_reqs, __ATOMIC_RELAXED);
        int64_t d_ctx = __atomic_load_n(&src->router.decode_ctx_tokens, __ATOMIC_RELAXED);
        uint64_t rate_bits = __atomic_load_n(&src->router.prefill_rate, __ATOMIC_RELAXED);
        if (s.state != DPLB_STATE_READY) continue;
        if (now_ns - s.heartbeat_ns > hb_timeout_ns) continue;
        if (circuit == DPLB_CIRCUIT_OPEN) continue;
        if (s.kv_cache_usage > p->kv_cache_threshold) continue;
        if (!(s.weight > 0.0)) continue;

        double learned;
        memcpy(&learned, &rate_bits, sizeof learned);
        double rate = learned > 0.0 ? learned : p->prefill_rate;
        int64_t waiting = s.num_waiting > 0 ? (int64_t)s.num_waiting : 0;
        int64_t ext = (int64_t)(s.num_running > 0 ? s.num_running : 0) + waiting - (int64_t)s.inflight;
        if (ext < 0) ext = 0;
        double queue = (w_tok > 0 ? (double)w_tok : 0.0) + (double)(ext < waiting ? ext : waiting) * p->waiting_tokens;
        double dreq = d_req > 0 ? (double)d_req : 0.0;
        double dctx = d_ctx > 0 ? (double)d_ctx : 0.0;
        double tokens = queue + u;
        double k = s.kv_cache_usage < 0.0 ? 0.0 : (s.kv_cache_usage > 0.99 ? 0.99 : s.kv_cache_usage);
        double batch = (double)((rinfl > 0 ? rinfl : 0) + ext);
        dplb_ttft_terms_t *t = &terms[nt++];
        t->worker_id = (int32_t)i;
        t->queue_tokens = queue;
        t->uncached_tokens = u;
        t->rate = rate;
        t->own_rate = rate;
        t->steps = 1.0 + floor(tokens / p->step_tokens);
        t->decode_s = t->steps * ((p->step_base_s + p->decode_seq_s * dreq) + p->decode_ctx_s * dctx);
        t->kv_s = p->kv_barrier_s * k / (1.0 - k);
        t->batch_s = p->w_decode * out_tokens * (p->decode_seq_s * batch + p->decode_ctx_s * dctx);
        t->decode_reqs = dreq;
        t->batch = batch;
        t->outside_reqs = (double)ext;
        t->weight = s.weight;
    }
    if (n_terms) *n_terms = nt;
    for (uint32_t i = 0; i < num_slots; i++)
        /* NaN, not +inf: an eligible worker's estimate may itself be +inf (a denormal weight), and
         * "est <= best + eps" must never admit an ineligible slot into the ties */
        ests[i] = __builtin_nan("");
    if (nt == 0) return -1;
    /* pooling: rates within the band around the median count as the median */
    if (p->rate_band > 0.0 && nt > 1) {
        for (int j = 0; j < nt; j++) ests[j] = terms[j].own_rate;  /* scratch */
        double m = dplb_median(ests, nt);
        double lo = m / (1.0 + p->rate_band), hi = m * (1.0 + p->rate_band);
        for (int j = 0; j < nt; j++) {
            if (terms[j].own_rate >= lo && terms[j].own_rate <= hi) terms[j].rate = m;
            ests[j] = __builtin_nan("");
        }
    }
    /* pass 2: estimates; u_min for the miss term */
    double umin = terms[0].uncached_tokens;
    for (int j = 1; j < nt; j++)
        if (terms[j].uncached_tokens < umin) umin = terms[j].uncached_tokens;
    double best = 0.0;
    for (int j = 0; j < nt; j++) {
        dplb_ttft_terms_t *t = &terms[j];
        t->prefill_s = (t->queue_tokens + t->uncached_tokens) / t->rate;
        double b_int = (p->interf_batch_cap > 0.0 && t->batch > p->interf_batch_cap) ? p->interf_batch_cap : t->batch;
        t->interf_s = p->w_interf * b_int * t->uncached_tokens / t->rate;
        t->miss_s = p->w_miss * (t->uncached_tokens - umin) / t->rate;
        t->est_s = (((((t->prefill_s + t->decode_s) + t->kv_s) + t->batch_s) + t->interf_s) + t->miss_s) / t->weight;
        ests[t->worker_id] = t->est_s;
        if (j == 0 || t->est_s < best) best = t->est_s;
    }
    const double ceil_ = best + DPLB_TIE_EPS;
    int k = 0;
    for (uint32_t i = 0; i < num_slots; i++) k += ests[i] <= ceil_;
    int j = (int)(rng_u * (double)k);
    if (j >= k) j = k - 1;
    if (j < 0) j = 0;
    for (uint32_t i = 0; i < num_slots; i++) {
        if (ests[i] <= ceil_) {
            if (j == 0) return (int)i;
            j--;
        }
    }
    return -1; /* unreachable */
}

/* splitmix64 (Steele, Lea, Flood 2014): a fast, seedable 64-bit generator for tie-breaking. */
static inline uint64_t dplb_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Uniform double in [0, 1) from the top 53 bits. */
static inline double dplb_rng_u(uint64_t *state) {
    return (double)(dplb_splitmix64(state) >> 11) * 0x1p-53;
}

#endif /* DPLB_KERNEL_H */
