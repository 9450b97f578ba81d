"""dplb_trace.mooncake: Mooncake JSONL → requests, deterministic prompt text that keeps prefix sharing."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dplb_trace.errors import TraceFormatError
from dplb_trace.mooncake import (
    BLOCK_TOKENS,
    TraceRequest,
    block_text,
    load_trace,
    prompt_for,
    shared_prefix_blocks,
)
from tests.helpers import ROOT, TRACE


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_real_trace_head_matches_file():
    reqs = load_trace(TRACE, limit=5)
    assert len(reqs) == 5
    first = reqs[0]
    assert first.index == 0 and first.timestamp_ms == 0
    assert first.input_length == 6758 and first.output_length == 500
    assert first.hash_ids == tuple(range(14))


def test_prompt_has_exact_length_and_is_deterministic_across_processes():
    req = load_trace(TRACE, limit=1)[0]
    text = prompt_for(req)
    assert len(text.split()) == req.input_length
    code = ("from dplb_trace.mooncake import load_trace, prompt_for; import hashlib, sys;"
            "r = load_trace(sys.argv[1], limit=1)[0]; print(hashlib.sha256(prompt_for(r).encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code, str(TRACE)], capture_output=True, text=True, cwd=ROOT,
                         check=True, timeout=120).stdout.strip()
    import hashlib
    assert out == hashlib.sha256(text.encode()).hexdigest()


def test_shared_blocks_give_shared_text_and_different_blocks_differ():
    a = TraceRequest(0, 0, 3 * BLOCK_TOKENS, 1, (7, 8, 9))
    b = TraceRequest(1, 0, 2 * BLOCK_TOKENS + 100, 1, (7, 8, 11))
    c = TraceRequest(2, 0, BLOCK_TOKENS, 1, (12,))
    wa, wb, wc = prompt_for(a).split(), prompt_for(b).split(), prompt_for(c).split()
    assert shared_prefix_blocks(a, b) == 2
    assert wa[: 2 * BLOCK_TOKENS] == wb[: 2 * BLOCK_TOKENS]
    assert wa[2 * BLOCK_TOKENS:2 * BLOCK_TOKENS + 100] != wb[2 * BLOCK_TOKENS:]
    assert wb[2 * BLOCK_TOKENS:] == block_text(11).split()[:100]
    assert wa[:BLOCK_TOKENS] != wc


def test_real_trace_prefix_sharing_survives():
    reqs = load_trace(TRACE, limit=50)
    pairs = [(a, b) for a in reqs for b in reqs if a.index < b.index and shared_prefix_blocks(a, b) >= 1]
    assert pairs, "the trace's first requests share the system-prompt block"
    for a, b in pairs[:20]:
        k = shared_prefix_blocks(a, b) * BLOCK_TOKENS
        k = min(k, a.input_length, b.input_length)
        assert prompt_for(a).split()[:k] == prompt_for(b).split()[:k]


def test_limit_and_blank_lines(tmp_path):
    p = _write(tmp_path, ['{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1]}', "",
                          '{"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}'])
    assert [r.index for r in load_trace(p)] == [0, 1]
    assert len(load_trace(p, limit=1)) == 1
    assert load_trace(p, limit=0) == []


@pytest.mark.parametrize("line,reason", [
    ("{nope", "invalid JSON"),
    ('{"timestamp": 0, "input_length": 3, "hash_ids": [1]}', "missing field 'output_length'"),
    ('{"timestamp": 0, "input_length": "3", "output_length": 1, "hash_ids": [1]}', "wrong type"),
    ('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [-1]}', "non-negative"),
    ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}', "exceeds 1 blocks"),
    ('[1, 2]', "JSON object"),
])
def test_bad_lines_name_file_line_and_reason(tmp_path, line, reason):
    p = _write(tmp_path, ['{"timestamp": 0, "input_length": 3, "output_length": 2, "hash_ids": [1]}', line])
    with pytest.raises(TraceFormatError) as ei:
        load_trace(p)
    assert ei.value.line == 2 and reason in str(ei.value) and str(p) in str(ei.value)


def test_timestamps_going_backwards_are_refused(tmp_path):
    p = _write(tmp_path, ['{"timestamp": 9, "input_length": 3, "output_length": 2, "hash_ids": [1]}',
                          '{"timestamp": 2, "input_length": 3, "output_length": 2, "hash_ids": [1]}'])
    with pytest.raises(TraceFormatError, match="backwards"):
        load_trace(p)
