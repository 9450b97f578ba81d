"""Python's view of the layout (dplb_shm.layout) equals the header's offsetof/sizeof."""
from __future__ import annotations

import ctypes
import mmap
import os

from dplb_shm import LAYOUT_VERSION, MAGIC, WorkerState, _native, layout


def test_slot_offsets_equal_header_offsetof():
    native = _native.offsets()
    assert layout.field_table(layout.Slot) == native["slot"]
    assert layout.field_table(layout.Header) == native["header"]
    assert layout.field_table(layout.RouterLine) == native["router"]
    assert layout.field_table(layout.RouterStats) == native["rstats"]


def test_sizes_and_cache_line_alignment():
    assert ctypes.sizeof(layout.Slot) == _native.SLOT_SIZE == layout.SLOT_SIZE
    assert ctypes.sizeof(layout.Header) == _native.HEADER_SIZE == layout.HEADER_SIZE
    assert _native.SLOT_SIZE % 64 == 0 and _native.HEADER_SIZE % 64 == 0
    # the router atomics sit on their own cache line, after the seqlock-guarded data
    off, size = _native.offsets()["slot"]["router"]
    assert off % 64 == 0 and size == 64 and off == _native.DATA_END
    off2, size2 = _native.offsets()["slot"]["rstats"]
    assert off2 == off + 64 and size2 == 64 and off2 + size2 == _native.SLOT_SIZE
    # the kernel copies line 0 and one entry of the length_compat table, which starts line 1
    assert _native.offsets()["slot"]["length_compat"][0] == _native.HOT_END == 64


def test_raw_bytes_decode_with_python_layout(segment, shm_name):
    """Bytes written by the native writer read back through the ctypes view at the same offsets."""
    w = segment.writer(3)
    w.claim(3, pid=4321, endpoint="127.0.0.1:8003", gpu_ids=[6, 7], model="m")
    w.publish(state=WorkerState.READY, num_running=11, kv_cache_usage=0.5, queued_prompt_tokens=77,
              engine_pid=98765)
    segment.router_inflight_add(3, 9)
    segment.prefill_add(3, 5000)
    segment.decode_add(3, 2, 700)
    segment.prefill_rate_observe(3, 12345.0)
    with open(f"/dev/shm/{shm_name}", "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            h = layout.Header.from_buffer_copy(mm, 0)
            s = layout.Slot.from_buffer_copy(mm, layout.slot_offset(3))
        finally:
            mm.close()
    assert h.magic == MAGIC and h.version == LAYOUT_VERSION and h.num_slots == 16
    assert h.creator_pid == os.getpid() and h.generation == 1
    assert (s.worker_id, s.state, s.pid, s.num_running) == (3, int(WorkerState.READY), 4321, 11)
    assert s.kv_cache_usage == 0.5 and s.queued_prompt_tokens == 77
    assert s.engine_pid == 98765 and layout.field_table(layout.Slot)["engine_pid"] == (1228, 4)
    assert s.endpoint == b"127.0.0.1:8003" and list(s.gpu_ids[:s.num_gpus]) == [6, 7]
    assert s.router.router_inflight == 9 and s.seq % 2 == 0
    assert (s.router.prefill_tokens, s.router.decode_reqs, s.router.decode_ctx_tokens) == (5000, 2, 700)
    assert ctypes.c_double.from_buffer_copy(ctypes.c_uint64(s.router.prefill_rate)).value == 12345.0
    assert s.router.prefill_rate_n == 1
