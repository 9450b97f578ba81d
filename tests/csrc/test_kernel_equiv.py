"""The native kernel equals the pure-Python reference (dplb_shm.reference) on random states."""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dplb_shm import ScoringParams, Segment, WorkerState, reference
from tests.helpers import unique_shm_name

NOW = 10 ** 15  # a fixed CLOCK_MONOTONIC "now" (ns) so heartbeat ages are exact
N = 16


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


def _small_or(values, wide):
    return st.sampled_from(values) | wide


slot_st = st.fixed_dictionaries({
    "state": st.sampled_from([WorkerState.READY] * 5 + [WorkerState.EMPTY, WorkerState.STARTING,
                                                        WorkerState.DRAINING, WorkerState.DEAD]),
    "num_running": _small_or([0, 1, 8], st.integers(0, 600)),
    "num_waiting": _small_or([0, 2], st.integers(0, 600)),
    "inflight": _small_or([0, 1, 8], st.integers(0, 600)),
    "router_inflight": _small_or([0, 1, 8], st.integers(-5, 600)),
    "max_num_seqs": st.sampled_from([0, 1, 16, 256]),
    "kv_cache_usage": _small_or([-1.0, 0.0, 0.5, 0.8, 0.8000001, 1.0], st.floats(0.0, 1.0)),
    "ttft_ms": _small_or([-1.0, 0.0, 100.0], st.floats(0.0, 1e5)),
    "hist": st.just([0] * 32) | st.lists(st.sampled_from([0, 0, 0, 1, 3]), min_size=32, max_size=32)
    | st.lists(st.integers(0, 2 ** 32 - 1), min_size=32, max_size=32),
    "hb_age_ns": st.sampled_from([0, 999_999_999, 1_000_000_000, 1_000_000_001, 50_000_000]),
    "circuit": st.sampled_from([0, 0, 1, 2]),
    "weight": st.sampled_from([0.0, 0.5, 1.0, 1.0, 2.0]) | st.floats(0.0, 10.0),
})

params_st = st.builds(
    ScoringParams,
    w_pending=_small_or([0.4, 0.0], st.floats(0.0, 1.0)),
    w_kv=_small_or([0.3, 0.0], st.floats(0.0, 1.0)),
    w_latency=_small_or([0.2, 0.0], st.floats(0.0, 1.0)),
    w_length=_small_or([0.1, 0.0], st.floats(0.0, 1.0)),
    max_queue=st.sampled_from([0, 1, 64, 256]),
    kv_cache_threshold=st.sampled_from([0.8, 1.0, 0.5]),
    heartbeat_timeout_ms=st.sampled_from([1000.0, 50.0, 999.9999995]),
    latency_scale_ms=st.sampled_from([100.0, 1.0, 333.3]),
)

affinity_st = st.none() | st.lists(_small_or([0.0, 0.1, 0.5], st.floats(-1.0, 1.0)), max_size=N)


def _write(seg: Segment, slots: list[dict]) -> None:
    for i, f in enumerate(slots):
        w = seg.writer(i)
        w.claim(i, endpoint=f"/tmp/dplb-eq/{i}.sock", max_num_seqs=f["max_num_seqs"], weight=f["weight"])
        w.publish(state=f["state"], num_running=f["num_running"], num_waiting=f["num_waiting"],
                  inflight=f["inflight"], kv_cache_usage=f["kv_cache_usage"], ttft_ms=f["ttft_ms"],
                  prompt_len_hist=f["hist"], heartbeat_ns=NOW - f["hb_age_ns"])
        seg.router_inflight_add(i, f["router_inflight"] - seg.router_inflight_get(i))
        seg.circuit_set(i, f["circuit"])


def _both(seg, params, prompt_len, affinity, rng_u):
    native = seg.pick_explain(params, prompt_len, affinity, now_ns=NOW, rng_u=rng_u)
    ref = reference.pick(seg.snapshot(), params, prompt_len, affinity, NOW, rng_u)
    return native, ref


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(slots=st.lists(slot_st, min_size=N, max_size=N), params=params_st,
       prompt_len=_small_or([0, 1, 2, 1000], st.integers(0, 2 ** 40)), affinity=affinity_st,
       rng_u=st.floats(0.0, 1.0, exclude_max=True))
def test_native_equals_reference_random_states(seg, slots, params, prompt_len, affinity, rng_u):
    _write(seg, slots)
    (chosen, terms), (ref_chosen, ref_terms) = _both(seg, params, prompt_len, affinity, rng_u)
    assert terms == ref_terms
    assert chosen == ref_chosen
    # the plain pick agrees with pick_explain on the same inputs
    assert seg.pick(params, prompt_len, affinity, now_ns=NOW, rng_u=rng_u) == chosen


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_ready=st.integers(1, N), group=st.sampled_from([1, 2, 3]), rng_u=st.floats(0.0, 1.0, exclude_max=True),
       bonus=st.sampled_from([0.0, 5e-10, 2e-9]))
def test_ties_match_reference(seg, n_ready, group, rng_u, bonus):
    """Identical workers (score ties), some nudged by less or more than the 1e-9 tie window."""
    base = {"state": WorkerState.READY, "num_running": 1, "num_waiting": 0, "inflight": 1, "router_inflight": 0,
            "max_num_seqs": 256, "kv_cache_usage": 0.1, "ttft_ms": 20.0, "hist": [0] * 32,
            "hb_age_ns": 0, "circuit": 0, "weight": 1.0}
    slots = [dict(base, state=WorkerState.READY if i < n_ready else WorkerState.EMPTY) for i in range(N)]
    _write(seg, slots)
    affinity = [bonus if i % group == 0 else 0.0 for i in range(N)]
    (chosen, terms), (ref_chosen, ref_terms) = _both(seg, ScoringParams(), 100, affinity, rng_u)
    assert (chosen, terms) == (ref_chosen, ref_terms)
    assert 0 <= chosen < n_ready
    if bonus > 1e-9:
        assert chosen % group == 0


def test_all_ineligible_returns_minus_one(seg):
    base = {"num_running": 0, "num_waiting": 0, "inflight": 0, "router_inflight": 0, "max_num_seqs": 256,
            "kv_cache_usage": 0.0, "ttft_ms": -1.0, "hist": [0] * 32, "hb_age_ns": 0, "circuit": 0, "weight": 1.0}
    # one reason per slot: not ready (4 states), stale heartbeat, circuit open, KV above threshold, weight 0
    reasons = [dict(base, state=s) for s in (WorkerState.EMPTY, WorkerState.STARTING, WorkerState.DRAINING,
                                             WorkerState.DEAD)]
    reasons += [dict(base, state=WorkerState.READY, hb_age_ns=2_000_000_000),
                dict(base, state=WorkerState.READY, circuit=1),
                dict(base, state=WorkerState.READY, kv_cache_usage=0.81),
                dict(base, state=WorkerState.READY, weight=0.0)]
    slots = [reasons[i % len(reasons)] for i in range(N)]
    _write(seg, slots)
    (chosen, terms), (ref_chosen, ref_terms) = _both(seg, ScoringParams(), 10, None, 0.5)
    assert chosen == ref_chosen == -1 and terms == ref_terms == []
    assert seg.pick(ScoringParams(), 10, now_ns=NOW) == -1
    # half-open is eligible (it admits probe requests)
    seg.circuit_set(5, 2)
    assert seg.pick(ScoringParams(), 10, now_ns=NOW) == 5


def test_zero_workers(seg):
    for i in range(N):
        seg.writer(i).release()
    assert seg.pick_explain(ScoringParams(), 10, [1.0] * N, now_ns=NOW, rng_u=0.3) == (-1, [])
    assert reference.pick(seg.snapshot(), ScoringParams(), 10, [1.0] * N, NOW, 0.3) == (-1, [])
    assert reference.pick([], ScoringParams(), 10, None, NOW, 0.3) == (-1, [])


def test_terms_follow_documented_formula(seg):
    """One hand-computed case pins the formula itself (not just native == reference)."""
    for i in range(N):
        seg.writer(i).release()
    w = seg.writer(7)
    w.claim(7, max_num_seqs=100, weight=2.0)
    hist = [0] * 32
    hist[10] = 3   # 3 queued prompts of 1024..2047 tokens
    hist[12] = 1   # 1 queued prompt of 4096..8191
    w.publish(state=WorkerState.READY, num_running=10, num_waiting=5, inflight=12, kv_cache_usage=0.5,
              ttft_ms=100.0, prompt_len_hist=hist, heartbeat_ns=NOW)
    seg.router_inflight_add(7, 20 - seg.router_inflight_get(7))
    seg.circuit_set(7, 0)
    chosen, (t,) = seg.pick_explain(ScoringParams(), 1500, [0.0] * 7 + [0.25], now_ns=NOW)
    assert chosen == 7
    assert t.pending == 15 + 8                      # max(10+5, 12) + max(0, 20-12)
    assert t.pending_term == pytest.approx(0.4 * (1 - 23 / 100))    # queue scale 100 (max_num_seqs)
    assert t.kv_term == pytest.approx(0.3 * 0.5)
    assert t.latency_term == pytest.approx(0.2 * 0.5)
    assert t.length_term == pytest.approx(0.1 * (3 * 1 + 1 * 0.25) / 4)   # bin(1500)=10
    assert t.score == pytest.approx(2.0 * (t.pending_term + t.kv_term + t.latency_term + t.length_term) + 0.25)


def test_bad_kernel_arguments(seg):
    from dplb_shm import SlotFieldError

    with pytest.raises(SlotFieldError):
        seg.pick(ScoringParams(), 10, [0.0] * (N + 1))
    with pytest.raises(SlotFieldError):
        seg.pick(ScoringParams(), 10, [float("nan")])
    with pytest.raises(SlotFieldError):
        seg.pick({"w_kv": 1}, 10)
    with pytest.raises(SlotFieldError):
        ScoringParams(latency_scale_ms=0)
    with pytest.raises(SlotFieldError):
        ScoringParams(max_queue=-1)


def test_queue_term_still_orders_workers_past_the_queue_scale(seg):
    """Regression (herding): the seed's term clipped every worker past max_queue to 0; unclipped,
    40 and 41 pending still differ by one request's worth (0.4/16) at scale 16."""
    for i in range(N):
        seg.writer(i).release()
    for wid, running in ((2, 40), (5, 41)):
        w = seg.writer(wid)
        w.claim(wid, max_num_seqs=256)
        w.publish(state=WorkerState.READY, num_running=running, num_waiting=0, inflight=0, heartbeat_ns=NOW)
        seg.router_inflight_add(wid, -seg.router_inflight_get(wid))
        seg.circuit_set(wid, 0)
    params = ScoringParams(max_queue=16)
    for u in (0.0, 0.5, 0.99):
        chosen, terms = seg.pick_explain(params, 100, None, now_ns=NOW, rng_u=u)
        assert chosen == 2
    by = {t.worker_id: t for t in terms}
    assert by[2].pending_term == pytest.approx(0.4 * (1 - 40 / 16))
    assert by[2].pending_term - by[5].pending_term == pytest.approx(0.4 / 16)


def test_a_draining_slot_is_never_picked_by_either_kernel_or_reference(seg):
    """Issue 27 item 6: a DRAINING worker is out of the candidates whatever its score. Here it is
    the idlest worker by far (the best score and the smallest estimated TTFT were it READY); the
    native kernels and the reference pick among the loaded READY ones, for every tie draw, and
    find nobody (-1) once every worker drains. ``Segment.state_get`` reads the state the kernel
    checks first (the scheduler's check of a pick made without the kernel)."""
    from dplb_shm import TtftParams

    idle = {"num_running": 0, "num_waiting": 0, "inflight": 0, "router_inflight": 0, "max_num_seqs": 256,
            "kv_cache_usage": 0.0, "ttft_ms": -1.0, "hist": [0] * 32, "hb_age_ns": 0, "circuit": 0, "weight": 1.0}
    busy = dict(idle, num_running=40, num_waiting=20, inflight=40, router_inflight=40, kv_cache_usage=0.6,
                ttft_ms=900.0)
    slots = [dict(idle, state=WorkerState.DRAINING) if i % 4 == 0 else dict(busy, state=WorkerState.READY)
             for i in range(N)]
    _write(seg, slots)
    draining = {i for i in range(N) if i % 4 == 0}
    assert {i for i in range(N) if seg.state_get(i) == WorkerState.DRAINING} == draining
    tp = TtftParams()
    for u in (0.0, 0.13, 0.5, 0.77, 0.999):
        (chosen, terms), (ref_chosen, ref_terms) = _both(seg, ScoringParams(), 100, [1.0] * N, u)
        assert chosen == ref_chosen and terms == ref_terms
        assert chosen not in draining and not draining & {t.worker_id for t in terms}
        wid, _ = seg.pick_ttft(tp, 100, None, now_ns=NOW, rng_u=u)
        ref_wid, ref_t = reference.pick_ttft(seg.snapshot(), tp, 100, None, NOW, u)
        assert wid == ref_wid and wid not in draining and not draining & {t.worker_id for t in ref_t}
    _write(seg, [dict(idle, state=WorkerState.DRAINING)] * N)
    assert _both(seg, ScoringParams(), 100, None, 0.5) == ((-1, []), (-1, []))
    assert seg.pick_ttft(tp, 100, None, now_ns=NOW, rng_u=0.5)[0] == -1
    assert reference.pick_ttft(seg.snapshot(), tp, 100, None, NOW, 0.5) == (-1, [])
