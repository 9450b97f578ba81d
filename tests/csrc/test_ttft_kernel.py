"""The estimated-TTFT kernel (``dplb_pick_ttft``): native equals the Python reference on random
states, and each term moves the choice the way its formula says (csrc/dplb_kernel.h)."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dplb_shm import Segment, SlotFieldError, TtftParams, WorkerState, reference
from tests.helpers import unique_shm_name

NOW = 10 ** 15
N = 8


@pytest.fixture(scope="module")
def seg():
    name = unique_shm_name()
    s = Segment.create(name, num_slots=N)
    try:
        yield s
    finally:
        s.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def put(seg: Segment, i: int, *, state=WorkerState.READY, kv=0.1, weight=1.0, queue=0, dreq=0, dctx=0,
        rate=0.0, circuit=0, hb_age_ns=0, waiting=0, running=0, inflight=0, rinfl=0) -> None:
    """Write slot ``i`` (agent fields: the engine's ``running``/``waiting`` and the routers'
    ``inflight`` at that scrape) and set its router line to exactly the given accounting
    (``rinfl``: the routers' live in-flight count)."""
    w = seg.writer(i)
    w.claim(i, endpoint=f"/tmp/dplb-ttft/{i}.sock", weight=weight)
    w.publish(state=state, kv_cache_usage=kv, heartbeat_ns=NOW - hb_age_ns, num_waiting=waiting,
              num_running=running, inflight=inflight)
    seg.router_reset(i)
    seg.prefill_add(i, queue)
    seg.decode_add(i, dreq, dctx)
    seg.router_inflight_add(i, rinfl - seg.router_line(i)["router_inflight"])  # not zeroed by router_reset
    if rate > 0:
        seg.prefill_rate_observe(i, rate)  # the first sample is taken whole
    seg.circuit_set(i, circuit)


def clear(seg: Segment) -> None:
    for i in range(N):
        put(seg, i, state=WorkerState.EMPTY)


slot_st = st.fixed_dictionaries({
    "state": st.sampled_from([WorkerState.READY] * 6 + [WorkerState.EMPTY, WorkerState.DRAINING, WorkerState.DEAD]),
    "kv": st.sampled_from([-1.0, 0.0, 0.5, 0.79, 0.8, 0.8000001, 0.995, 1.0]) | st.floats(0.0, 1.0),
    "weight": st.sampled_from([0.0, 0.5, 1.0, 1.0, 3.0]) | st.floats(0.0, 10.0),
    "queue": st.sampled_from([0, 0, 512, 100_000]) | st.integers(-100, 10 ** 7),
    "dreq": st.sampled_from([0, 1, 64]) | st.integers(-3, 600),
    "dctx": st.sampled_from([0, 6000, 10 ** 6]) | st.integers(-100, 10 ** 8),
    "rate": st.sampled_from([0.0, 0.0, 1000.0, 30769.0]) | st.floats(1.0, 1e6),
    "circuit": st.sampled_from([0, 0, 1, 2]),
    "hb_age_ns": st.sampled_from([0, 999_999_999, 1_000_000_001]),
    "waiting": st.sampled_from([0, 0, 3]) | st.integers(0, 1000),
    "running": st.sampled_from([0, 5]) | st.integers(0, 1000),
    "inflight": st.sampled_from([0, 5]) | st.integers(0, 2000),
    "rinfl": st.sampled_from([0, 3]) | st.integers(-2, 2000),
})

params_st = st.builds(
    TtftParams,
    prefill_rate=st.sampled_from([30_769.0, 1.0, 1e6]),
    waiting_tokens=st.sampled_from([1024.0, 0.0, 5000.0]),
    step_tokens=st.sampled_from([8192.0, 1.0, 512.0]),
    step_base_s=st.sampled_from([0.005, 0.0]),
    decode_seq_s=st.sampled_from([5e-5, 0.0, 0.01]),
    decode_ctx_s=st.sampled_from([3.9e-8, 0.0]),
    kv_barrier_s=st.sampled_from([0.15, 0.0, 10.0]),
    w_decode=st.sampled_from([1.0, 0.0, 0.3]),
    kv_cache_threshold=st.sampled_from([0.8, 1.0]),
    heartbeat_timeout_ms=st.sampled_from([1000.0, 50.0]),
    rate_band=st.sampled_from([0.25, 0.0, 1.0]),
    w_interf=st.sampled_from([0.0, 1.0, 0.5]),
    w_miss=st.sampled_from([0.0, 1.0, 4.0]),
    interf_batch_cap=st.sampled_from([0.0, 2.0, 64.0]),
)

uncached_st = st.none() | st.lists(st.sampled_from([-1.0, 0.0, 100.0, 6600.0]) | st.floats(-10.0, 1e6),
                                   max_size=N)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=st.lists(slot_st, min_size=N, max_size=N), params=params_st,
       prompt_len=st.sampled_from([0, 1, 6600, 85_000]) | st.integers(0, 2 ** 31),
       uncached=uncached_st, rng_u=st.floats(0.0, 1.0, exclude_max=True),
       out_tokens=st.sampled_from([0.0, 256.0]) | st.floats(0.0, 1e5))
def test_native_equals_reference(seg, slots, params, prompt_len, uncached, rng_u, out_tokens):
    for i, f in enumerate(slots):
        put(seg, i, **f)
    native = seg.pick_ttft_explain(params, prompt_len, uncached, now_ns=NOW, rng_u=rng_u, out_tokens=out_tokens)
    ref = reference.pick_ttft(seg.snapshot(), params, prompt_len, uncached, NOW, rng_u, out_tokens)
    assert native == ref
    chosen, est = seg.pick_ttft(params, prompt_len, uncached, now_ns=NOW, rng_u=rng_u, out_tokens=out_tokens)
    assert chosen == native[0]
    assert est == (next(t.est_s for t in native[1] if t.worker_id == chosen) if chosen >= 0 else float("inf"))
    # the lean rows (dplb's TPOT-SLO term re-ranks them) are the same choice and the same numbers
    rows = seg.pick_ttft_rows(params, prompt_len, uncached, now_ns=NOW, rng_u=rng_u, out_tokens=out_tokens)
    assert rows == (native[0], [(t.worker_id, t.est_s, t.uncached_tokens, t.rate, t.weight) for t in native[1]])


DEFAULT = TtftParams()


def _pick(seg, uncached=None, prompt_len=6000, params=DEFAULT, out_tokens=0.0):
    return seg.pick_ttft_explain(params, prompt_len, uncached, now_ns=NOW, rng_u=0.0, out_tokens=out_tokens)


# (name, per-slot settings for slots 0 and 1, uncached tokens per slot, expected winner)
CASES = [
    ("idle: the cached prefix wins", [{}, {}], [6000.0, 1000.0], 1),
    ("queued prefill outweighs a cache hit", [{"queue": 50_000}, {}], [1000.0, 6000.0], 1),
    ("a cache hit outweighs a short queue", [{"queue": 2000}, {}], [1000.0, 6000.0], 0),
    ("a slower learned rate is avoided", [{"rate": 5000.0}, {"queue": 4000}], [6000.0, 6000.0], 1),
    ("decoding load costs every step", [{"dreq": 200, "dctx": 2_000_000}, {}], [6000.0, 6000.0], 1),
    ("the KV barrier prefers room", [{"kv": 0.75}, {"kv": 0.1}], [6000.0, 6000.0], 1),
    ("KV above the threshold is not eligible", [{"kv": 0.81}, {"queue": 10 ** 6}], [0.0, 6000.0], 1),
    ("weight 2 halves the estimate", [{"weight": 2.0, "queue": 5000}, {}], [6000.0, 6000.0], 0),
    ("a negative entry rules a slot out", [{}, {"queue": 10 ** 6}], [-1.0, 6000.0], 1),
    ("requests sent around the routers queue too", [{"waiting": 30}, {"queue": 20_000}], [6000.0, 6000.0], 1),
    ("outside requests add to the routers' queue", [{"waiting": 3, "queue": 9000}, {"queue": 11_000}],
     [6000.0, 6000.0], 1),
    ("the routers' own waiting requests are not counted twice",
     [{"waiting": 10, "inflight": 10, "queue": 9000}, {"queue": 12_000}], [6000.0, 6000.0], 0),
    ("an open circuit is not eligible", [{"circuit": 1}, {"queue": 10 ** 6}], [0.0, 6000.0], 1),
    ("a stale heartbeat is not eligible", [{"hb_age_ns": 2 * 10 ** 9}, {"queue": 10 ** 6}], [0.0, 6000.0], 1),
]


@pytest.mark.parametrize("name,slots,uncached,winner", CASES, ids=[c[0] for c in CASES])
def test_each_term_moves_the_choice(seg, name, slots, uncached, winner):
    clear(seg)
    for i, f in enumerate(slots):
        put(seg, i, **f)
    chosen, terms = _pick(seg, uncached)
    assert chosen == winner, [t.to_dict() for t in terms]


def test_batch_term_spreads_a_burst_that_shares_a_cached_prefix(seg):
    clear(seg)
    put(seg, 0)
    put(seg, 1)
    seg.router_inflight_add(0, 3)  # three requests already in worker 0's batch
    # worker 0 holds the prefix: 350 tokens less to compute (11 ms at 30,769 tokens/s)
    assert _pick(seg, [5.0, 355.0], out_tokens=0.0)[0] == 0            # TTFT alone: pile on
    full = TtftParams(w_decode=1.0)
    chosen, terms = _pick(seg, [5.0, 355.0], out_tokens=256.0, params=full)  # 3 x 256 x 50 us = 38 ms > 11 ms
    assert chosen == 1 and terms[0].batch == 3 and terms[0].batch_s == pytest.approx(256 * 3 * 5e-5)
    _, terms = _pick(seg, [5.0, 355.0], out_tokens=256.0)                  # default weight 0.25
    assert terms[0].batch_s == pytest.approx(0.25 * 256 * 3 * 5e-5)
    seg.router_inflight_add(0, -3)


def pick_both(seg, native, params, prompt_len, unc):
    """``pick_ttft_explain`` of the native kernel (``native``) or of the Python reference, rng 0."""
    if native:
        return seg.pick_ttft_explain(params, prompt_len, unc, now_ns=NOW, rng_u=0.0)
    return reference.pick_ttft(seg.snapshot(), params, prompt_len, unc, NOW, 0.0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_interference_term_keeps_a_long_prefill_off_a_busy_batch(seg, native):
    """Worker 0 runs 20 decodes and has 2,000 prefill tokens queued; worker 1 has 4,000 queued and
    nothing decoding (say a long prompt just landed there). Our 8,000-token prompt reaches its first
    token sooner on worker 0 (10,000 vs 12,000 tokens ahead and own), so the request-only estimate
    picks 0 — and stretches the next token of 20 requests by 0.26 s each (5.2 s summed). With the
    interference term (w_interf 1) worker 0 costs 0.33 + 5.2 s against worker 1's 0.39 s: it goes to 1."""
    clear(seg)
    put(seg, 0, queue=2000, rinfl=20, dreq=20, dctx=20_000)
    put(seg, 1, queue=4000)
    unc = [8000.0, 8000.0]

    def pick(params):
        return pick_both(seg, native, params, 8000, unc)

    off = TtftParams(w_decode=0.0, w_interf=0.0, w_miss=0.0)
    assert pick(off)[0] == 0
    chosen, terms = pick(replace(off, w_interf=1.0))
    assert chosen == 1
    assert terms[0].interf_s == pytest.approx(20 * 8000 / 30_769.0) and terms[1].interf_s == 0.0


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_interference_counts_at_most_the_capped_batch(seg, native):
    """Issue 29 round 9 (Azure's conversation trace). Worker 0 carries 150 decodes (long outputs),
    2,000 prefill tokens queued; worker 1 carries 100 and 40,000 tokens queued (it drew the long
    prompts). A 4,000-token prompt: uncapped, the 50 requests fewer on worker 1 are worth 0.5 · 50
    · 0.13 = 3.25 s of interference, more than its 1.24 s longer queue, so it goes to 1 and
    saturates its prefill further; with the batch counted up to 64 on both, the queue decides: 0."""
    clear(seg)
    put(seg, 0, queue=2000, rinfl=150, dreq=150)
    put(seg, 1, queue=40_000, rinfl=100, dreq=100)
    unc = [4000.0, 4000.0]

    def pick(params):
        return pick_both(seg, native, params, 4000, unc)

    base = TtftParams(w_decode=0.0, w_interf=0.5, w_miss=0.0)
    assert pick(replace(base, interf_batch_cap=0.0))[0] == 1
    chosen, terms = pick(base)
    assert base.interf_batch_cap == 64.0 and chosen == 0
    assert terms[0].interf_s == pytest.approx(terms[1].interf_s) == pytest.approx(0.5 * 64 * 4000 / 30_769.0)
    # a batch below the cap is counted whole
    clear(seg)
    put(seg, 0, rinfl=20, dreq=20)
    assert pick(base)[1][0].interf_s == pytest.approx(0.5 * 20 * 4000 / 30_769.0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_miss_term_keeps_a_long_context_on_its_holder(seg, native):
    """Worker 0 holds 30,000 of the request's 32,000 prompt tokens but has 31,000 queued ahead;
    worker 1 is idle. Request-only, worker 1 is sooner (32,000 tokens against 33,000): it picks 1,
    spending 0.98 s of prefill that a hit would not, for a 1,000-token (33 ms) gain. Pricing that
    recompute for one request arriving behind it (w_miss 1) keeps the request on 0."""
    clear(seg)
    put(seg, 0, queue=31_000)
    put(seg, 1)
    unc = [2000.0, 32_000.0]

    def pick(params):
        return pick_both(seg, native, params, 32_000, unc)

    off = TtftParams(w_decode=0.0, w_interf=0.0, w_miss=0.0)
    assert pick(off)[0] == 1
    chosen, terms = pick(replace(off, w_miss=1.0))
    assert chosen == 0
    assert terms[0].miss_s == 0.0 and terms[1].miss_s == pytest.approx(30_000 / 30_769.0)


def test_engine_counts_older_than_the_routers_counters_are_not_load(seg):
    """The agent published running=8 with the routers' inflight=8 at the same scrape; since then 6
    of those finished (the routers' live count is 2). Only the live count is load: a stale engine
    count paired with its own inflight adds nothing. Requests no router sent (running 8 against
    inflight 5) are added on top."""
    clear(seg)
    put(seg, 0, running=8, inflight=8, rinfl=2)
    put(seg, 1, running=8, inflight=5, rinfl=2)
    _, terms = _pick(seg, [100.0, 100.0], out_tokens=256.0)
    assert [t.batch for t in terms] == [2.0, 5.0] and [t.outside_reqs for t in terms] == [0.0, 3.0]
    assert [t.queue_tokens for t in terms] == [0.0, 0.0]  # outside requests are running, not waiting


def test_terms_are_seconds_and_add_up(seg):
    clear(seg)
    put(seg, 0, queue=10_000, dreq=10, dctx=50_000, rate=20_000.0, kv=0.5, weight=1.0)
    p = TtftParams()
    _, [t] = _pick(seg, [2000.0], prompt_len=5000, params=p)
    assert t.queue_tokens == 10_000 and t.uncached_tokens == 2000 and t.rate == 20_000.0
    assert t.steps == 2.0  # 12,000 tokens at 8,192 per step: this request's last chunk is in step 2
    assert t.prefill_s == pytest.approx(12_000 / 20_000)
    assert t.decode_s == pytest.approx(2 * (0.005 + 10 * 5e-5 + 50_000 * 3.9e-8))
    assert t.kv_s == pytest.approx(0.15)
    assert t.est_s == pytest.approx(t.prefill_s + t.decode_s + t.kv_s)


def test_missing_uncached_entries_mean_the_whole_prompt(seg):
    clear(seg)
    put(seg, 0)
    put(seg, 1)
    _, terms = _pick(seg, [100.0], prompt_len=7000)
    assert [t.uncached_tokens for t in terms] == [100.0, 7000.0]


def test_ties_break_at_random_never_towards_slot_0(seg):
    clear(seg)
    for i in range(4):
        put(seg, i)
    p = TtftParams()
    got = {seg.pick_ttft(p, 1000, None, now_ns=NOW, rng_u=u)[0] for u in (0.0, 0.3, 0.6, 0.99)}
    assert got == {0, 1, 2, 3}


def _burst_shares(seg, params, n=200, tokens=650):
    """Send a burst of ``n`` ``tokens``-token prompts at once (no first token comes back): shares."""
    counts = [0] * 4
    for _ in range(n):
        chosen, _ = seg.pick_ttft(params, tokens, None, now_ns=NOW, rng_u=0.5)
        counts[chosen] += 1
        seg.prefill_add(chosen, tokens)
    return counts


def test_learned_rates_that_drifted_apart_do_not_steer_a_burst(seg):
    """Identical engines whose learned rates drifted by sampling noise (within 25 % of their
    median) share a burst evenly; priced at their own rates they would not (the control)."""
    drifted = [33_000.0, 26_000.0, 30_000.0, 29_000.0]
    for band, even in ((0.25, True), (0.0, False)):
        clear(seg)
        for i, r in enumerate(drifted):
            put(seg, i, rate=r)
        counts = _burst_shares(seg, TtftParams(rate_band=band))
        ratio = max(counts) / min(counts)
        assert (ratio <= 1.05) == even, (band, counts)
        _, terms = _pick(seg, params=TtftParams(rate_band=band))
        assert [t.own_rate for t in terms] == drifted
        assert {t.rate for t in terms} == ({29_500.0} if band else set(drifted))  # median of the four


def test_a_worker_outside_the_band_keeps_its_own_rate(seg):
    """A 3x slower engine is priced at its own rate: it gets about a third of a fast one's share."""
    clear(seg)
    for i, r in enumerate([30_000.0, 31_000.0, 29_000.0, 10_000.0]):
        put(seg, i, rate=r)
    counts = _burst_shares(seg, TtftParams())
    _, terms = _pick(seg)
    assert [t.rate for t in terms] == [29_500.0, 29_500.0, 29_500.0, 10_000.0]
    assert 0.25 < counts[3] / (sum(counts[:3]) / 3) < 0.45, counts


def test_prefill_rate_is_a_clipped_shared_average(seg):
    clear(seg)
    put(seg, 0)
    assert seg.prefill_rate_observe(0, 10_000.0) == 10_000.0       # the first sample is taken whole
    assert seg.prefill_rate_observe(0, 1e9, alpha=0.5, clip=4.0) == pytest.approx(25_000.0)  # clipped to 4x
    assert seg.router_line(0)["prefill_rate_n"] == 2
    with pytest.raises(SlotFieldError):
        seg.prefill_rate_observe(0, 0.0)
    seg.router_reset(0)
    assert seg.router_line(0)["prefill_rate"] == 0.0


def test_params_validation():
    with pytest.raises(SlotFieldError):
        TtftParams(prefill_rate=0.0)
    with pytest.raises(SlotFieldError):
        TtftParams(step_base_s=float("nan"))
    with pytest.raises(SlotFieldError):
        TtftParams(decode_seq_s=-1.0)
    with pytest.raises(SlotFieldError):
        TtftParams(rate_band=-0.1)


def test_alternating_parameter_sets_each_price_with_their_own(seg):
    """The mapping keeps the last two parameter sets it loaded (a policy alternates its own and the
    own-TTFT set per decision): every call still prices with the set it was given, whatever came
    before, as a mapping that never saw another set does (and as the Python reference)."""
    clear(seg)
    put(seg, 0, queue=4000, dreq=8, dctx=40_000, rate=20_000.0)
    put(seg, 1, queue=0, dreq=40, dctx=400_000, rate=20_000.0)
    put(seg, 2, queue=9000, dreq=0, rate=20_000.0, kv=0.85)
    a = TtftParams()
    b = replace(a, w_decode=0.0, w_interf=0.0, w_miss=0.0, kv_cache_threshold=1.0)
    c = replace(a, prefill_rate=5_000.0, w_decode=2.0)

    def ref(p: TtftParams) -> tuple[int, float]:
        chosen, terms = reference.pick_ttft(seg.snapshot(), p, 2000, [1500.0, 2000.0, 100.0], NOW, 0.5, 64.0)
        return int(chosen), next(float(t.est_s) for t in terms if int(t.worker_id) == chosen)

    want = {id(p): ref(p) for p in (a, b, c)}
    assert len({v for v in want.values()}) == 3   # three sets, three different answers
    for p in (a, b, a, b, c, a, c, b, b, a, c, c, b):
        chosen, est = seg.pick_ttft(p, 2000, [1500.0, 2000.0, 100.0], now_ns=NOW, rng_u=0.5, out_tokens=64.0)
        assert (int(chosen), pytest.approx(float(est), rel=1e-9)) == want[id(p)]
