# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""dplb_shm._native: the segment (csrc/dplb_shm.h) and scoring kernel (csrc/dplb_kernel.h) for Python.

Import it through :mod:`dplb_shm`, which checks that this build matches the sources on disk.
Layout, seqlock protocol and the scoring formula are documented in the two headers.
"""
from libc.stdint cimport int16_t, int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memset, memcpy
from libc.stdlib cimport malloc, free
from libc.math cimport isfinite
from cpython.list cimport PyList_GET_SIZE, PyList_GET_ITEM
from posix.mman cimport mmap, munmap, PROT_READ, PROT_WRITE, MAP_SHARED, MAP_FAILED

from dplb_native cimport *

import operator
import os

import posix_ipc

from dplb_shm.errors import (LayoutMismatchError, SegmentClosedError, SegmentError,
                             SegmentExistsError, SegmentNotFoundError, SlotFieldError,
                             SlotIndexError)
from dplb_shm.types import (ScoreTerms, ScoringParams, StateReason, TtftParams, TtftTerms, WorkerSnapshot,
                            WorkerState)

cdef extern from *:
    """
    #ifndef DPLB_SOURCE_SHA256
    #define DPLB_SOURCE_SHA256 "unknown"
    #endif
    """
    const char *DPLB_SOURCE_SHA256

cdef extern from "<string.h>" nogil:
    size_t strnlen(const char *s, size_t maxlen)

MAGIC = DPLB_MAGIC
LAYOUT_VERSION = DPLB_LAYOUT_VERSION
HEADER_SIZE = DPLB_HEADER_SIZE
SLOT_SIZE = DPLB_SLOT_SIZE
MAX_SLOTS = DPLB_MAX_SLOTS
WINDOW = DPLB_WINDOW
HIST_BINS = DPLB_HIST_BINS
MAX_GPUS = DPLB_MAX_GPUS
UNIX_PATH_MAX = DPLB_UNIX_PATH_MAX
ENDPOINT_MAX = DPLB_ENDPOINT_LEN - 1
MODEL_MAX = DPLB_MODEL_LEN - 1
HOT_END = DPLB_HOT_END
DATA_END = DPLB_DATA_END
SOURCE_SHA256 = DPLB_SOURCE_SHA256.decode("ascii")


cdef uint64_t _fork_gen = 0
# the heartbeat of SlotWriter.fill_pattern's slot, 2**62 + v: in the future, never "stopped"
cdef int64_t DPLB_PATTERN_HEARTBEAT = 4611686018427387904


def _after_fork_in_child():
    global _fork_gen
    _fork_gen += 1


# A router that attaches and then forks its workers must not hand every child the same
# tie-breaking sequence (they would pile onto the same worker): reseed after a fork.
os.register_at_fork(after_in_child=_after_fork_in_child)


cdef uint64_t _urandom64():
    return <uint64_t>int.from_bytes(os.urandom(8), "little")


cdef dict _table(const dplb_field_t *t):
    cdef dict out = {}
    cdef int i = 0
    while t[i].name != NULL:
        out[t[i].name.decode("ascii")] = (t[i].offset, t[i].size)
        i += 1
    return out


def offsets():
    """``offsetof``/``sizeof`` of every field as compiled from csrc/dplb_shm.h.

    Returns ``{"header": {field: (offset, size)}, "slot": {...}, "router": {...},
    "rstats": {...}}`` (bytes; router and rstats offsets are relative to their line).
    """
    return {"header": _table(dplb_header_fields), "slot": _table(dplb_slot_fields),
            "router": _table(dplb_router_fields), "rstats": _table(dplb_rstats_fields)}


def now_ns():
    """CLOCK_MONOTONIC in ns, the clock of ``heartbeat_ns`` (same as ``time.monotonic_ns()``)."""
    return dplb_now_ns()


def len_bin(int64_t n):
    """Histogram bin of a prompt length: floor(log2 n) clipped to [0, 31]; 0 for n <= 1."""
    return dplb_len_bin(n)


def length_compat(hist, int b):
    """The kernel's length compatibility of a prompt in bin ``b`` with histogram ``hist`` (32 counts)."""
    cdef uint32_t h[32]
    cdef int k
    vals = list(hist)
    if len(vals) != DPLB_HIST_BINS or not 0 <= b < DPLB_HIST_BINS:
        raise SlotFieldError("length_compat wants 32 counts and a bin in 0..31", field="prompt_len_hist")
    for k in range(DPLB_HIST_BINS):
        h[k] = <uint32_t>_i(vals[k], "prompt_len_hist", 0, 2**32 - 1)
    return dplb_length_compat(h, b)


cdef str _posix_name(name):
    if not isinstance(name, str) or not name:
        raise SegmentError(f"segment name must be a non-empty string, got {name!r}", name=None)
    n = name[1:] if name.startswith("/") else name
    if not n or "/" in n or len(n) > 250 or "\0" in n:
        raise SegmentError(f"bad segment name {name!r}: want a POSIX shm name like 'dplb-30000'",
                           name=str(name))
    return n


cdef inline double _f(v, str field) except? -1.0:
    cdef double d
    if isinstance(v, (str, bytes, bool)):
        raise SlotFieldError(f"{field} must be a number, got {v!r}", field=field)
    try:
        d = float(v)
    except (TypeError, ValueError):
        raise SlotFieldError(f"{field} must be a number, got {v!r}", field=field)
    if not isfinite(d):
        raise SlotFieldError(f"{field} must be finite, got {v!r}", field=field)
    return d


cdef inline int64_t _i(v, str field, int64_t lo, int64_t hi) except? -1:
    if isinstance(v, bool):
        raise SlotFieldError(f"{field} must be an integer, got {v!r}", field=field)
    if isinstance(v, float):
        if not v.is_integer():
            raise SlotFieldError(f"{field} must be an integer, got {v!r}", field=field)
        v = int(v)
    else:
        try:
            v = operator.index(v)
        except TypeError:
            raise SlotFieldError(f"{field} must be an integer, got {v!r}", field=field) from None
    if v < lo or v > hi:
        raise SlotFieldError(f"{field} must be in [{lo}, {hi}], got {v}", field=field)
    return <int64_t>v


cdef void _set_str(char *dst, size_t cap, s, str field) except *:
    if not isinstance(s, str):
        raise SlotFieldError(f"{field} must be a string, got {s!r}", field=field)
    b = (<str>s).encode("utf-8")
    if <size_t>len(b) >= cap:
        raise SlotFieldError(f"{field} is {len(b)} bytes, at most {cap - 1} fit", field=field)
    if b"\0" in b:
        raise SlotFieldError(f"{field} must not contain NUL", field=field)
    memset(dst, 0, cap)
    memcpy(dst, <const char *>b, len(b))


cdef str _get_str(const char *src, size_t cap):
    cdef size_t n = strnlen(src, cap)
    return src[:n].decode("utf-8", "replace")


cdef void _empty_slot(dplb_slot_t *s, int32_t worker_id) noexcept nogil:
    """Fields of an EMPTY slot: zeros, with 'unknown' (-1) where 0 would be a real value."""
    memset(<char *>s + 8, 0, DPLB_DATA_END - 8)
    s.worker_id = worker_id
    s.state = DPLB_STATE_EMPTY
    s.weight = 1.0
    s.kv_cache_usage = -1.0
    s.gpu_mem_used_bytes = -1
    s.gpu_mem_total_bytes = -1
    s.ttft_ms = -1.0
    s.tpot_ms = -1.0
    s.e2e_ms = -1.0
    s.ttft_p99_ms = -1.0
    s.tpot_p99_ms = -1.0
    s.e2e_p99_ms = -1.0
    dplb_refresh_compat(s)


cdef dict _router_dict(dplb_slot_t *src):
    return {"router_inflight": dplb_router_inflight_get(src), "dispatched": dplb_dispatched_get(src),
            "circuit": dplb_circuit_get(src), "prefill_tokens": dplb_i64_get(&src.router.prefill_tokens),
            "decode_reqs": dplb_i64_get(&src.router.decode_reqs),
            "decode_ctx_tokens": dplb_i64_get(&src.router.decode_ctx_tokens),
            "prefill_rate": dplb_f64_get(&src.router.prefill_rate),
            "prefill_rate_n": dplb_u64_get(&src.router.prefill_rate_n),
            "router_ttft_s": dplb_f64_get(&src.rstats.ttft_s), "router_tpot_s": dplb_f64_get(&src.rstats.tpot_s),
            "completed": dplb_u64_get(&src.rstats.completed), "failed": dplb_u64_get(&src.rstats.failed)}


cdef object _snapshot(const dplb_slot_t *s, dplb_slot_t *src, int64_t now, bint stale=False):
    """``s``: the slot's data as read under the seqlock (``stale``: copied without it, the writer
    having stopped inside a write); ``src``: the live slot (router lines)."""
    cdef dict r = _router_dict(src)
    cdef int ng = s.num_gpus
    if ng < 0:
        ng = 0
    if ng > DPLB_MAX_GPUS:
        ng = DPLB_MAX_GPUS
    try:
        state = WorkerState(s.state)
    except ValueError:
        state = WorkerState.DEAD
    return WorkerSnapshot(
        worker_id=s.worker_id, state=state, pid=s.pid,
        endpoint=_get_str(s.endpoint, DPLB_ENDPOINT_LEN), control=_get_str(s.control, DPLB_ENDPOINT_LEN),
        model=_get_str(s.model, DPLB_MODEL_LEN),
        gpu_ids=[s.gpu_ids[k] for k in range(ng)], weight=s.weight,
        heartbeat_ns=s.heartbeat_ns,
        heartbeat_age_ms=(now - s.heartbeat_ns) / 1e6 if s.heartbeat_ns > 0 else -1.0,
        num_running=s.num_running, num_waiting=s.num_waiting, inflight=s.inflight,
        router_inflight=r["router_inflight"], dispatched=r["dispatched"],
        queued_prompt_tokens=s.queued_prompt_tokens, max_num_seqs=s.max_num_seqs,
        kv_cache_usage=s.kv_cache_usage, gpu_mem_used_bytes=s.gpu_mem_used_bytes,
        gpu_mem_total_bytes=s.gpu_mem_total_bytes, ttft_ms=s.ttft_ms, tpot_ms=s.tpot_ms,
        e2e_ms=s.e2e_ms, ttft_p99_ms=s.ttft_p99_ms, tpot_p99_ms=s.tpot_p99_ms,
        e2e_p99_ms=s.e2e_p99_ms, prompt_len_hist=[s.prompt_len_hist[k] for k in range(DPLB_HIST_BINS)],
        completed=r["completed"], failed=r["failed"], engine_completed=s.completed, engine_failed=s.failed,
        circuit=r["circuit"], seq=s.seq,
        prefill_tokens=r["prefill_tokens"], decode_reqs=r["decode_reqs"],
        decode_ctx_tokens=r["decode_ctx_tokens"], prefill_rate=r["prefill_rate"],
        router_ttft_s=r["router_ttft_s"], router_tpot_s=r["router_tpot_s"],
        restarts=s.restarts, agent_restarts=s.agent_restarts, last_exit_code=s.last_exit_code,
        state_reason=_reason(s.state_reason), next_restart_ns=s.next_restart_ns, engine_pid=s.engine_pid,
        stale=stale)


cdef object _reason(uint32_t r):
    try:
        return StateReason(r)
    except ValueError:
        return StateReason.NONE


cdef extern from "<stdint.h>" nogil:
    const int64_t INT64_MAX_ "INT64_MAX"


cdef object _mismatch(str name, uint64_t magic, uint32_t version, detail):
    if magic != DPLB_MAGIC:
        msg = (f"segment {name}: not a DPLB layout (magic 0x{magic:016x}, version {version}); "
               f"this build expects magic 0x{DPLB_MAGIC:016x}, layout version {DPLB_LAYOUT_VERSION}")
    else:
        msg = (f"segment {name}: layout version {version}, this build expects layout version "
               f"{DPLB_LAYOUT_VERSION}")
    if detail:
        msg += f" ({detail})"
    return LayoutMismatchError(msg, name=name, found_magic=magic, found_version=version,
                               expected_version=DPLB_LAYOUT_VERSION)


cdef int _apply(dplb_slot_t *s, dict fields) except -1:
    """Validate and store ``fields`` into the private copy ``s``."""
    cdef int k
    for key, v in fields.items():
        if key == "state":
            try:
                st = WorkerState(v)
            except ValueError:
                raise SlotFieldError(f"unknown worker state {v!r}", field="state")
            s.state = <int32_t>int(st)
        elif key == "pid":
            s.pid = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "engine_pid":
            s.engine_pid = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "endpoint":
            _set_endpoint(s.endpoint, v, "endpoint")
        elif key == "control":
            _set_endpoint(s.control, v, "control")
        elif key == "model":
            _set_str(s.model, DPLB_MODEL_LEN, v, key)
        elif key == "gpu_ids":
            ids = list(v)
            if len(ids) > DPLB_MAX_GPUS:
                raise SlotFieldError(f"at most {DPLB_MAX_GPUS} gpu_ids, got {len(ids)}", field=key)
            for k in range(DPLB_MAX_GPUS):
                s.gpu_ids[k] = <int16_t>_i(ids[k], key, 0, 32767) if k < len(ids) else 0
            s.num_gpus = len(ids)
        elif key == "weight":
            s.weight = _f(v, key)
            if s.weight < 0:
                raise SlotFieldError("weight must be >= 0", field=key)
        elif key == "num_running":
            s.num_running = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "num_waiting":
            s.num_waiting = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "inflight":
            s.inflight = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "max_num_seqs":
            s.max_num_seqs = <int32_t>_i(v, key, 0, 2**31 - 1)
        elif key == "queued_prompt_tokens":
            s.queued_prompt_tokens = _i(v, key, 0, 2**62)
        elif key == "kv_cache_usage":
            d = _f(v, key)
            if d != -1.0 and d < 0.0:
                raise SlotFieldError(f"kv_cache_usage must be in [0, 1] or -1, got {v!r}", field=key)
            s.kv_cache_usage = d if d <= 1.0 else 1.0   # engines may round a full cache above 1
        elif key == "gpu_mem_used_bytes":
            s.gpu_mem_used_bytes = _i(v, key, -1, 2**62)
        elif key == "gpu_mem_total_bytes":
            s.gpu_mem_total_bytes = _i(v, key, -1, 2**62)
        elif key in ("ttft_ms", "tpot_ms", "e2e_ms", "ttft_p99_ms", "tpot_p99_ms", "e2e_p99_ms"):
            d = _f(v, key)
            if d < 0 and d != -1.0:
                raise SlotFieldError(f"{key} must be >= 0 or -1, got {v!r}", field=key)
            if key == "ttft_ms":
                s.ttft_ms = d
            elif key == "tpot_ms":
                s.tpot_ms = d
            elif key == "e2e_ms":
                s.e2e_ms = d
            elif key == "ttft_p99_ms":
                s.ttft_p99_ms = d
            elif key == "tpot_p99_ms":
                s.tpot_p99_ms = d
            else:
                s.e2e_p99_ms = d
        elif key == "prompt_len_hist":
            h = list(v)
            if len(h) > DPLB_HIST_BINS:
                raise SlotFieldError(f"prompt_len_hist has at most {DPLB_HIST_BINS} bins", field=key)
            for k in range(DPLB_HIST_BINS):
                s.prompt_len_hist[k] = <uint32_t>_i(h[k], key, 0, 2**32 - 1) if k < len(h) else 0
            dplb_refresh_compat(s)
        elif key == "completed":
            s.completed = <uint64_t>_i(v, key, 0, 2**63 - 1)
        elif key == "failed":
            s.failed = <uint64_t>_i(v, key, 0, 2**63 - 1)
        elif key == "heartbeat_ns":
            s.heartbeat_ns = _i(v, key, 0, 2**63 - 1)
        elif key == "restarts":
            s.restarts = <uint32_t>_i(v, key, 0, 2**32 - 1)
        elif key == "agent_restarts":
            s.agent_restarts = <uint32_t>_i(v, key, 0, 2**32 - 1)
        elif key == "last_exit_code":
            s.last_exit_code = <int32_t>_i(v, key, -2**31, 2**31 - 1)
        elif key == "state_reason":
            try:
                r = StateReason(v)
            except ValueError:
                raise SlotFieldError(f"unknown state reason {v!r}", field="state_reason")
            s.state_reason = <uint32_t>int(r)
        elif key == "next_restart_ns":
            s.next_restart_ns = _i(v, key, 0, 2**63 - 1)
        else:
            raise SlotFieldError(f"unknown slot field {key!r}", field=str(key))
    return 0


cdef int _set_endpoint(char *dst, v, str name) except -1:
    """An address field (``endpoint``: the engine's data address; ``control``: the agent's)."""
    if not isinstance(v, str):
        raise SlotFieldError(f"{name} must be a string, got {v!r}", field=name)
    if v.startswith("/"):
        if len(v.encode("utf-8")) > DPLB_UNIX_PATH_MAX:
            raise SlotFieldError(f"{name} socket path is {len(v.encode())} bytes; a Unix socket path "
                                 f"holds at most {DPLB_UNIX_PATH_MAX}", field=name)
    elif v:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise SlotFieldError(f"{name} must be an absolute socket path or host:port, got {v!r}",
                                 field=name)
    _set_str(dst, DPLB_ENDPOINT_LEN, v, name)
    return 0


# The two extension types live in include files (one textual module, as uvloop does) to keep
# each file readable: the mapped segment and its kernel, and the single writer of a slot.
include "dplb_segment.pxi"
include "dplb_writer.pxi"
