"""Segment life cycle and slot writer: create/attach/unlink, mode, fields round-trip, errors."""
from __future__ import annotations

import os
import stat

import pytest

from dplb_shm import (
    LAYOUT_VERSION,
    LayoutMismatchError,
    ScoringParams,
    Segment,
    SegmentClosedError,
    SegmentExistsError,
    SegmentNotFoundError,
    SlotFieldError,
    SlotIndexError,
    WorkerState,
    now_ns,
)


def test_create_mode_0600_and_unlink_leaves_nothing(shm_name):
    seg = Segment.create(shm_name, num_slots=8)
    try:
        st = os.stat(f"/dev/shm/{shm_name}")
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert seg.num_slots == 8 and seg.version == LAYOUT_VERSION and seg.generation == 0
        assert st.st_size == 128 + 8 * 1536
    finally:
        seg.close()
        seg.unlink()
    assert not os.path.exists(f"/dev/shm/{shm_name}")
    assert not [n for n in os.listdir("/dev/shm") if n == shm_name]


def test_mode_0600_even_with_permissive_umask(shm_name):
    old = os.umask(0)
    try:
        seg = Segment.create(shm_name, num_slots=1)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{shm_name}").st_mode) == 0o600
    finally:
        seg.close()
        seg.unlink()


def test_create_fails_if_exists_unless_replace(segment, shm_name):
    with pytest.raises(SegmentExistsError) as ei:
        Segment.create(shm_name, num_slots=4)
    assert isinstance(ei.value, FileExistsError) and ei.value.name == shm_name
    w = segment.writer(3)
    w.claim(3, endpoint="127.0.0.1:8001")
    seg2 = Segment.create(shm_name, num_slots=4, replace=True)
    try:
        assert seg2.num_slots == 4
        assert seg2.read_slot(3).state == WorkerState.EMPTY
        # the old mapping is still valid (and separate) for whoever had it open
        assert segment.read_slot(3).state == WorkerState.STARTING
    finally:
        seg2.close()


def test_attach_missing_and_unlink_missing(shm_name):
    with pytest.raises(SegmentNotFoundError):
        Segment.attach(shm_name)
    seg = Segment.create(shm_name, num_slots=1)
    seg.unlink()
    with pytest.raises(SegmentNotFoundError):
        seg.unlink()
    seg.close()


def test_attach_sees_writes_of_other_mapping(segment, shm_name):
    w = segment.writer(2)
    w.claim(2, pid=1234, endpoint="/tmp/dplb-x/agent-2.sock", gpu_ids=[4, 5], weight=2.0,
            model="sim-llama-3.1-8b", max_num_seqs=128)
    w.set_state(WorkerState.READY)
    w.publish(num_running=3, num_waiting=4, kv_cache_usage=0.25, gpu_mem_used_bytes=10 ** 9,
              gpu_mem_total_bytes=80 * 10 ** 9)
    w.inflight_add(5)
    w.inflight_add(-2)
    w.record_request(1000)
    w.record_request(3)
    w.record_request(1000, delta=-1)
    w.count(completed=7, failed=1)
    segment.outcome_add(2, completed=2, failed=3)     # what the routers' leases count
    with Segment.attach(shm_name, readonly=True) as other:
        s = other.read_slot(2)
    assert s.worker_id == 2 and s.state == WorkerState.READY and s.pid == 1234
    assert s.endpoint == "/tmp/dplb-x/agent-2.sock" and s.model == "sim-llama-3.1-8b"
    assert s.gpu_ids == [4, 5] and s.weight == 2.0 and s.max_num_seqs == 128
    assert (s.num_running, s.num_waiting, s.inflight) == (3, 4, 3)
    assert s.kv_cache_usage == 0.25
    assert (s.gpu_mem_used_bytes, s.gpu_mem_total_bytes) == (10 ** 9, 80 * 10 ** 9)
    assert s.queued_prompt_tokens == 3
    assert s.prompt_len_hist[1] == 1 and s.prompt_len_hist[9] == 0 and sum(s.prompt_len_hist) == 1
    assert (s.engine_completed, s.engine_failed) == (7, 1)      # the writer's (engine's) own counts
    assert (s.completed, s.failed) == (2, 3)                    # the routers' counts: what is shown
    assert 0 <= s.heartbeat_age_ms < 60_000
    assert segment.generation == 1


def test_latency_windows_mean_and_p99(segment):
    w = segment.writer(0)
    w.claim(0)
    assert segment.read_slot(0).ttft_ms == -1.0
    for v in range(1, 41):  # 40 samples: the window keeps the last 32 (9..40)
        w.record_latency(ttft_ms=v, tpot_ms=2 * v)
    w.record_latency(e2e_ms=500)
    s = segment.read_slot(0)
    assert s.ttft_ms == pytest.approx(sum(range(9, 41)) / 32)
    assert s.tpot_ms == pytest.approx(2 * sum(range(9, 41)) / 32)
    assert s.ttft_p99_ms == 40.0  # nearest rank ceil(0.99 * 32) = 32nd of 32
    assert s.e2e_ms == 500.0 and s.e2e_p99_ms == 500.0


def test_claim_and_release_bump_generation_and_reset(segment):
    w = segment.writer(5)
    g0 = segment.generation
    w.claim(5, endpoint="127.0.0.1:9000")
    w.publish(num_running=9, state=WorkerState.READY)
    assert segment.generation == g0 + 1
    w.release()
    s = segment.read_slot(5)
    assert segment.generation == g0 + 2
    assert s.state == WorkerState.EMPTY and s.num_running == 0 and s.endpoint == ""


def test_occupied_lists_exactly_the_slots_that_are_not_empty(segment):
    assert segment.occupied() == []
    ws = {i: segment.writer(i) for i in (1, 5, 9)}
    for i, w in ws.items():
        w.claim(i, endpoint=f"127.0.0.1:{9000 + i}")   # claimed: STARTING
    ws[9].set_state(WorkerState.READY)
    assert segment.occupied() == [1, 5, 9]
    assert segment.occupied() == [s.worker_id for s in segment.snapshot() if s.state != WorkerState.EMPTY]
    ws[5].release()
    assert segment.occupied() == [1, 9]


def test_router_atomics_shared_between_mappings(segment, shm_name):
    other = Segment.attach(shm_name)
    try:
        assert segment.router_inflight_add(1, 2) == 2
        assert other.router_inflight_add(1, 3) == 5
        assert other.router_inflight_add(1, -1) == 4
        assert segment.dispatched_add(1) == 1 and other.dispatched_add(1, 4) == 5
        other.circuit_set(1, 1)
        s = segment.read_slot(1)
        assert (s.router_inflight, s.dispatched, s.circuit) == (4, 5, 1)
        # router writes do not disturb the seqlock of the slot
        assert s.seq == segment.read_slot(1).seq
    finally:
        other.close()


@pytest.mark.parametrize("fields,field", [
    ({"endpoint": "/" + "x" * 107}, "endpoint"),
    ({"endpoint": "not-an-endpoint"}, "endpoint"),
    ({"kv_cache_usage": -0.5}, "kv_cache_usage"),
    ({"num_running": -1}, "num_running"),
    ({"gpu_ids": list(range(17))}, "gpu_ids"),
    ({"model": "m" * 120}, "model"),
    ({"weight": float("nan")}, "weight"),
    ({"bogus": 1}, "bogus"),
    ({"kv_cache_usage": "0.5"}, "kv_cache_usage"),
    ({"num_running": 2.5}, "num_running"),
    ({"num_running": "3"}, "num_running"),
    ({"num_running": True}, "num_running"),
    ({"state": 9}, "state"),
    ({"control": "no-port"}, "control"),
    ({"control": "/" + "c" * 107}, "control"),
])
def test_bad_fields_raise_and_leave_slot_unchanged(segment, fields, field):
    w = segment.writer(0)
    w.claim(0, endpoint="/tmp/a.sock")
    before = segment.read_slot(0)
    with pytest.raises(SlotFieldError) as ei:
        w.publish(num_waiting=7, **fields)
    assert ei.value.field == field and isinstance(ei.value, ValueError)
    after = segment.read_slot(0)
    assert after.num_waiting == before.num_waiting == 0 and after.endpoint == "/tmp/a.sock"


def test_kv_usage_above_one_is_clamped(segment):
    w = segment.writer(0)
    w.claim(0)
    w.publish(kv_cache_usage=1.0004)
    assert segment.read_slot(0).kv_cache_usage == 1.0


def test_data_and_control_addresses_are_two_fields(segment):
    """Layout 5 (one hop): ``endpoint`` is the engine's data address, ``control`` the agent's."""
    w = segment.writer(2)
    w.claim(2, endpoint="/run/x/engine-2.sock", control="/run/x/agent-2.sock")
    s = segment.read_slot(2)
    assert (s.endpoint, s.control) == ("/run/x/engine-2.sock", "/run/x/agent-2.sock")
    w.publish(endpoint="10.0.0.7:8002", control="10.0.0.7:9002")
    d = segment.read_slot(2).to_dict()
    assert (d["endpoint"], d["control"]) == ("10.0.0.7:8002", "10.0.0.7:9002")
    w.claim(2, endpoint="127.0.0.1:8000")   # no control address: the endpoint serves both
    assert segment.read_slot(2).control == ""


def test_longest_unix_socket_path_fits(segment):
    path = "/" + "p" * 106
    w = segment.writer(0)
    w.claim(0, endpoint=path)
    assert segment.read_slot(0).endpoint == path


def test_slot_index_and_closed_errors(segment):
    with pytest.raises(SlotIndexError):
        segment.read_slot(16)
    with pytest.raises(SlotIndexError):
        segment.writer(-1)
    w = segment.writer(0)
    with pytest.raises(SlotFieldError):
        w.claim(1)
    segment.close()
    with pytest.raises(SegmentClosedError):
        segment.snapshot()
    with pytest.raises(SegmentClosedError):
        w.heartbeat()
    with pytest.raises(SegmentClosedError):
        segment.pick(ScoringParams())


def test_readonly_attach_refuses_writes(segment, shm_name):
    with Segment.attach(shm_name, readonly=True) as ro:
        with pytest.raises(Exception, match="read-only"):
            ro.writer(0)
        with pytest.raises(Exception, match="read-only"):
            ro.router_inflight_add(0, 1)


def test_wrong_version_names_both_versions(shm_name):
    seg = Segment.create(shm_name, num_slots=2)
    seg.close()
    with open(f"/dev/shm/{shm_name}", "r+b") as f:
        f.seek(8)
        f.write((LAYOUT_VERSION + 6).to_bytes(4, "little"))
    with pytest.raises(LayoutMismatchError) as ei:
        Segment.attach(shm_name)
    msg = str(ei.value)
    assert f"version {LAYOUT_VERSION + 6}" in msg and f"version {LAYOUT_VERSION}" in msg
    assert "\n" not in msg and ei.value.found_version == LAYOUT_VERSION + 6


def test_wrong_magic(shm_name):
    with open(f"/dev/shm/{shm_name}", "wb") as f:
        f.write(b"NOTDPLB!" + (1).to_bytes(4, "little") + bytes(4096))
    with pytest.raises(LayoutMismatchError, match="magic"):
        Segment.attach(shm_name)


def test_heartbeat_is_monotonic_clock(segment):
    w = segment.writer(0)
    t0 = now_ns()
    w.heartbeat()
    s = segment.read_slot(0)
    assert t0 <= s.heartbeat_ns <= now_ns()


def test_latency_samples_expire_after_the_window(segment):
    """One slow request must not penalise an idle worker forever: samples leave the window.
    (Gaps of 0.5 s against a 1 s window leave 0.4-0.5 s for scheduling delays on a busy machine.)"""
    import time

    w = segment.writer(0, latency_window_s=1.0)
    w.claim(0)
    t0 = time.monotonic()
    w.record_latency(ttft_ms=5000.0, tpot_ms=50.0)
    assert segment.read_slot(0).ttft_ms == 5000.0
    time.sleep(0.5)
    w.record_latency(ttft_ms=100.0)
    t1 = time.monotonic()
    if t1 - t0 >= 1.0:
        pytest.skip("machine too busy for this test's margins (0.5 s sleep took >= 1 s)")
    assert segment.read_slot(0).ttft_ms == 2550.0
    time.sleep(max(0.0, t0 + 1.1 - time.monotonic()))   # the 5000 ms sample is older than 1 s now
    w.heartbeat()
    s = segment.read_slot(0)
    if time.monotonic() - t1 < 1.0:
        assert s.ttft_ms == 100.0 and s.ttft_p99_ms == 100.0
    assert s.tpot_ms == -1.0
    time.sleep(max(0.0, t1 + 1.1 - time.monotonic()))
    w.heartbeat()
    s = segment.read_slot(0)
    assert s.ttft_ms == -1.0 and s.ttft_p99_ms == -1.0


def test_count_only_window_and_mirrored_summaries_do_not_expire(segment):
    import time

    w = segment.writer(1, latency_window_s=0)
    w.claim(1)
    w.record_latency(ttft_ms=70.0)
    m = segment.writer(2, latency_window_s=0.05)   # a router mirroring a remote agent
    m.claim(2, endpoint="10.0.0.2:8000")
    m.publish(ttft_ms=30.0, ttft_p99_ms=90.0)
    time.sleep(0.1)
    w.heartbeat()
    m.heartbeat()
    assert segment.read_slot(1).ttft_ms == 70.0
    assert (segment.read_slot(2).ttft_ms, segment.read_slot(2).ttft_p99_ms) == (30.0, 90.0)
    with pytest.raises(SlotFieldError):
        segment.writer(3, latency_window_s=-1)


def test_snapshot_dict_round_trip(segment):
    from dplb_shm import WorkerSnapshot

    w = segment.writer(4)
    w.claim(4, endpoint="[::1]:8004", gpu_ids=[2, 3], model="m")
    w.publish(state=WorkerState.DRAINING, num_waiting=2)
    w.record_request(700)
    s = segment.read_slot(4)
    d = s.to_dict()
    assert d["state"] == "draining" and d["endpoint"] == "[::1]:8004" and d["gpu_ids"] == [2, 3]
    assert WorkerSnapshot.from_dict(d) == s
    with pytest.raises(SlotFieldError):
        WorkerSnapshot.from_dict(dict(d, state="sleepy"))
    with pytest.raises(SlotFieldError):
        WorkerSnapshot.from_dict({"state": "ready"})


def test_writer_clock_override_drives_heartbeat_and_latency_window(segment):
    """A virtual-time simulator sets the writer's clock: heartbeats and window expiry follow it,
    and the kernel judges staleness against the ``now_ns`` it is given."""
    w = segment.writer(5, latency_window_s=10.0)
    w.claim(5, endpoint="/tmp/x.sock")
    w.set_state(WorkerState.READY)
    assert w.now_override_ns == 0
    w.now_override_ns = 7_000_000_000
    w.record_latency(ttft_ms=400.0)
    s = segment.read_slot(5)
    assert (s.heartbeat_ns, s.ttft_ms) == (7_000_000_000, 400.0)
    w.now_override_ns = 16_999_999_999          # 9.99 s later: the sample is still in the window
    w.heartbeat()
    assert segment.read_slot(5).ttft_ms == 400.0
    w.now_override_ns = 17_000_000_001          # 10 s + 1 ns later: it left
    w.heartbeat()
    s = segment.read_slot(5)
    assert (s.heartbeat_ns, s.ttft_ms) == (17_000_000_001, -1.0)
    p = ScoringParams(heartbeat_timeout_ms=1000)
    assert segment.pick(p, 10, now_ns=17_500_000_000) == 5
    assert segment.pick(p, 10, now_ns=18_000_000_002) == -1      # stale in virtual time
    with pytest.raises(SlotFieldError):
        w.now_override_ns = -1
    w.now_override_ns = 0                        # back to CLOCK_MONOTONIC
    t0 = now_ns()
    w.heartbeat()
    assert t0 <= segment.read_slot(5).heartbeat_ns <= now_ns()
