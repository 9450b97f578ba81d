"""Python's own view of the segment layout, written independently of ``csrc/dplb_shm.h``.

``tests/dplb_shm/test_layout.py`` checks every offset and size here against the ``offsetof`` /
``sizeof`` table compiled into the extension (``dplb_shm._native.offsets()``), so a change to the
header that is not mirrored here (or the reverse) fails the tests. Tools that want to decode a raw
segment image without the extension (post-mortem dumps) can use these ``ctypes`` structures; live
readers must go through the seqlock in :class:`dplb_shm.Segment`.
"""
from __future__ import annotations

import ctypes

HEADER_SIZE = 128
SLOT_SIZE = 1536
WINDOW = 32
HIST_BINS = 32
MAX_GPUS = 16


class Header(ctypes.Structure):
    """Segment header (128 bytes): see the drawing in csrc/dplb_shm.h."""

    _fields_ = [
        ("magic", ctypes.c_uint64),
        ("version", ctypes.c_uint32),
        ("num_slots", ctypes.c_uint32),
        ("slot_size", ctypes.c_uint32),
        ("header_size", ctypes.c_uint32),
        ("created_ns", ctypes.c_int64),
        ("generation", ctypes.c_uint64),
        ("creator_pid", ctypes.c_int32),
        ("reserved", ctypes.c_uint8 * 84),
    ]


class RouterLine(ctypes.Structure):
    """Router-side atomics of one slot (one cache line, outside the seqlock)."""

    _fields_ = [
        ("router_inflight", ctypes.c_int64),
        ("dispatched", ctypes.c_uint64),
        ("circuit", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
        ("prefill_tokens", ctypes.c_int64),
        ("decode_reqs", ctypes.c_int64),
        ("decode_ctx_tokens", ctypes.c_int64),
        ("prefill_rate", ctypes.c_uint64),  # f64 bits
        ("prefill_rate_n", ctypes.c_uint64),
    ]


class RouterStats(ctypes.Structure):
    """Router-side latency averages of one slot (second router line, outside the seqlock)."""

    _fields_ = [
        ("ttft_s", ctypes.c_uint64),  # f64 bits
        ("tpot_s", ctypes.c_uint64),  # f64 bits
        ("ttft_n", ctypes.c_uint64),
        ("tpot_n", ctypes.c_uint64),
        ("completed", ctypes.c_uint64),
        ("failed", ctypes.c_uint64),
        ("reserved", ctypes.c_uint8 * 16),
    ]


class Slot(ctypes.Structure):
    """One worker slot (1536 bytes): see the drawing in csrc/dplb_shm.h."""

    _fields_ = [
        ("seq", ctypes.c_uint64),
        ("worker_id", ctypes.c_int32),
        ("state", ctypes.c_int32),
        ("weight", ctypes.c_double),
        ("heartbeat_ns", ctypes.c_int64),
        ("num_running", ctypes.c_int32),
        ("num_waiting", ctypes.c_int32),
        ("inflight", ctypes.c_int32),
        ("max_num_seqs", ctypes.c_int32),
        ("kv_cache_usage", ctypes.c_double),
        ("ttft_ms", ctypes.c_double),
        ("length_compat", ctypes.c_double * HIST_BINS),
        ("prompt_len_hist", ctypes.c_uint32 * HIST_BINS),
        ("pid", ctypes.c_int32),
        ("num_gpus", ctypes.c_int32),
        ("queued_prompt_tokens", ctypes.c_int64),
        ("gpu_mem_used_bytes", ctypes.c_int64),
        ("gpu_mem_total_bytes", ctypes.c_int64),
        ("tpot_ms", ctypes.c_double),
        ("e2e_ms", ctypes.c_double),
        ("ttft_p99_ms", ctypes.c_double),
        ("tpot_p99_ms", ctypes.c_double),
        ("e2e_p99_ms", ctypes.c_double),
        ("completed", ctypes.c_uint64),
        ("failed", ctypes.c_uint64),
        ("ttft_n", ctypes.c_uint32),
        ("tpot_n", ctypes.c_uint32),
        ("e2e_n", ctypes.c_uint32),
        ("agent_restarts", ctypes.c_uint32),
        ("gpu_ids", ctypes.c_int16 * MAX_GPUS),
        ("ttft_ring", ctypes.c_float * WINDOW),
        ("tpot_ring", ctypes.c_float * WINDOW),
        ("e2e_ring", ctypes.c_float * WINDOW),
        ("endpoint", ctypes.c_char * 128),
        ("model", ctypes.c_char * 120),
        ("restarts", ctypes.c_uint32),
        ("last_exit_code", ctypes.c_int32),
        ("state_reason", ctypes.c_uint32),
        ("engine_pid", ctypes.c_int32),
        ("next_restart_ns", ctypes.c_int64),
        ("control", ctypes.c_char * 128),
        ("reserved1", ctypes.c_uint8 * 40),
        ("router", RouterLine),
        ("rstats", RouterStats),
    ]


def field_table(struct: type[ctypes.Structure]) -> dict[str, tuple[int, int]]:
    """``{field: (offset, size)}`` in bytes, as ctypes lays ``struct`` out."""
    return {f[0]: (getattr(struct, f[0]).offset, getattr(struct, f[0]).size) for f in struct._fields_}


def slot_offset(i: int) -> int:
    """Byte offset of slot ``i`` in the segment."""
    return HEADER_SIZE + i * SLOT_SIZE
