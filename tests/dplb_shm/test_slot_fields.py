"""The C wall, field by field: every field of the slot's table in csrc/dplb_shm.h
(``dplb_slot_fields``, compiled into the extension as ``_native.offsets()["slot"]``) is either a
key of :class:`dplb_shm.types.SlotFields` (what ``SlotWriter.publish`` sets) or named here with who
else writes it; and every published field, written through ``publish``, reads back the same
through the seqlock (``Segment.read_slot``) and through Python's own layout of the raw bytes
(:mod:`dplb_shm.layout`). A field added to the header fails the first test until it is typed or
named, and one the writer stores wrongly (offset, width, conversion) fails the second."""
from __future__ import annotations

import mmap
import typing

from dplb_shm import StateReason, WorkerState, _native, layout
from dplb_shm.types import SlotFields

#: fields of ``dplb_slot_t`` no ``publish`` sets, and who writes each
NOT_PUBLISHED = {
    "seq": "the seqlock counter, every write",
    "worker_id": "SlotWriter.claim (the slot index)",
    "num_gpus": "the length of gpu_ids",
    "length_compat": "derived from prompt_len_hist (dplb_refresh_compat)",
    "ttft_ring": "record_latency", "tpot_ring": "record_latency", "e2e_ring": "record_latency",
    "ttft_n": "record_latency", "tpot_n": "record_latency", "e2e_n": "record_latency",
    "reserved1": "padding",
    "router": "the routers' atomics (outside the seqlock)",
    "rstats": "the routers' latency averages (outside the seqlock)",
}

#: the snapshot's name of a slot field where it differs (its ``completed``/``failed`` are the routers')
SNAPSHOT_NAME = {"completed": "engine_completed", "failed": "engine_failed"}

HIST = [i * 3 + 1 for i in range(32)]

#: per published field: the value written, which must read back (the snapshot's attribute of the
#: same name but for :data:`SNAPSHOT_NAME`); each distinct from a fresh slot's, so a field left
#: unwritten fails
VALUES: dict[str, object] = {
    "state": WorkerState.DRAINING,
    "state_reason": StateReason.ADMIN_RESTART,
    "pid": 43210,
    "engine_pid": 98765,
    "endpoint": "/run/dplb/engine-2.sock",
    "control": "127.0.0.1:9102",
    "model": "walk-model-7b",
    "gpu_ids": [5, 3, 9],
    "weight": 2.5,
    "num_running": 17,
    "num_waiting": 23,
    "inflight": 29,
    "max_num_seqs": 384,
    "queued_prompt_tokens": 123457,
    "kv_cache_usage": 0.375,
    "gpu_mem_used_bytes": 7 << 33,
    "gpu_mem_total_bytes": 9 << 33,
    "ttft_ms": 12.5,
    "tpot_ms": 7.25,
    "e2e_ms": 812.0,
    "ttft_p99_ms": 44.5,
    "tpot_p99_ms": 19.75,
    "e2e_p99_ms": 2048.5,
    "prompt_len_hist": HIST,
    "completed": 1 << 40,
    "failed": 31,
    "heartbeat_ns": 123_456_789_012,
    "restarts": 6,
    "agent_restarts": 4,
    "last_exit_code": -9,
    "next_restart_ns": 987_654_321_000,
}


def test_every_field_of_the_header_table_is_typed_or_named():
    table = set(_native.offsets()["slot"])
    typed = set(typing.get_type_hints(SlotFields))
    assert typed & set(NOT_PUBLISHED) == set()
    assert typed | set(NOT_PUBLISHED) == table, (
        f"typed but not in the header: {sorted((typed | set(NOT_PUBLISHED)) - table)}; "
        f"in the header, neither typed nor named: {sorted(table - typed - set(NOT_PUBLISHED))}")
    assert set(VALUES) == typed


def _raw_slot(shm_name: str, k: int) -> layout.Slot:
    with open(f"/dev/shm/{shm_name}", "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            return layout.Slot.from_buffer_copy(mm, layout.slot_offset(k))
        finally:
            mm.close()


def _raw_value(s: layout.Slot, name: str) -> object:
    v = getattr(s, name)
    if name in ("endpoint", "control", "model"):
        return v.decode()
    if name == "gpu_ids":
        return list(v[:s.num_gpus])
    if name == "prompt_len_hist":
        return list(v)
    return v


def test_every_published_field_reads_back_through_the_seqlock_and_the_raw_layout(segment, shm_name):
    w = segment.writer(2)
    w.claim(2, pid=1, endpoint="127.0.0.1:8000", model="m")
    fields: SlotFields = dict(VALUES)   # type: ignore[assignment]
    w.publish(**fields)
    snap = segment.read_slot(2)
    raw = _raw_slot(shm_name, 2)
    wrong = []
    for name, expected in VALUES.items():
        got = getattr(snap, SNAPSHOT_NAME.get(name, name))
        if isinstance(got, tuple):
            got = list(got)
        if got != expected:
            wrong.append(f"{name}: read_slot {got!r}, wrote {expected!r}")
        rv = _raw_value(raw, name)
        if rv != expected:
            wrong.append(f"{name}: raw bytes {rv!r}, wrote {expected!r}")
    assert wrong == []
    assert raw.num_gpus == 3 and raw.worker_id == 2 and raw.seq % 2 == 0
