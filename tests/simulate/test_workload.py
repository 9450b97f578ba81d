"""Trace input (Mooncake, Azure CSV, malformed lines) and the request each component sees, checked
against the live code: the router's parser, the agent's meter, the engine's chat template and hashes."""
from __future__ import annotations

import orjson
import pytest

from dplb_protocol.wire import CHAT, COMPLETIONS, parse_request
from dplb_trace.errors import TraceFormatError
from dplb_trace.mooncake import load_trace, prompt_for
from sim_engine.kv_cache import chain_hashes
from sim_engine.tokenizer import render_chat, tokenize
from simulate.workload import (
    EngineHasher,
    RenderedPrompt,
    detect_format,
    load_azure,
    load_workload,
    parse_azure_timestamp,
    router_text,
)
from tests.helpers import TRACE

AZURE_OK = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.0000000,879,0
2023-11-16 18:16:01.2,1200,8
"""


def test_azure_csv_parses_times_lengths_and_gives_unshared_blocks(tmp_path):
    p = tmp_path / "azure.csv"
    p.write_text(AZURE_OK)
    reqs = load_azure(p)
    assert [r.timestamp_ms for r in reqs] == pytest.approx([0.0, 4314.579, 4319.41, 14519.41])
    assert [(r.input_length, r.output_length) for r in reqs] == [(374, 44), (396, 109), (879, 0), (1200, 8)]
    assert [len(r.hash_ids) for r in reqs] == [1, 1, 2, 3]
    ids = [h for r in reqs for h in r.hash_ids]
    assert len(set(ids)) == len(ids)                       # no prefix information: nothing shared
    assert detect_format(p) == "azure" and detect_format(TRACE) == "mooncake"
    w = load_workload(p, start=1, requests=2)
    assert [r.index for r in w] == [0, 1] and [r.timestamp_ms for r in w] == pytest.approx([0.0, 4.831])


@pytest.mark.parametrize("text,line,fragment", [
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374\n", 2, "expected 3 fields"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,x\n", 2, "must be integers"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\nnot a date,3,4\n", 3, "bad TIMESTAMP"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,1\n", 2, "ContextTokens must be >= 1"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,-1\n", 2, "GeneratedTokens >= 0"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,5,1\n2023-11-16 18:15:45,5,1\n", 3,
     "backwards"),
    ("time,ctx,gen\n2023-11-16 18:15:46,5,1\n", 1, "expected the header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:15:46,5,1\n", 2, "bad TIMESTAMP"),
])
def test_malformed_azure_line_is_an_error_naming_the_line(tmp_path, text, line, fragment):
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(TraceFormatError) as ei:
        load_workload(p, fmt="azure")
    assert ei.value.line == line and fragment in str(ei.value) and str(p) in str(ei.value)


@pytest.mark.parametrize("line,fragment", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]', "invalid JSON"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 2}', "missing field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}', "exceeds"),
])
def test_malformed_mooncake_line_is_an_error_naming_the_line(tmp_path, line, fragment):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n\n' + line + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_workload(p)
    assert ei.value.line == 3 and fragment in str(ei.value)


def test_azure_timestamp_keeps_100ns():
    assert parse_azure_timestamp("2023-11-16 18:15:46.6805901") - parse_azure_timestamp(
        "2023-11-16 18:15:46") == 680_590_100
    assert parse_azure_timestamp("1970-01-01 00:00:01.5") == 1_500_000_000


def test_window_rate_and_cap():
    w = load_workload(TRACE, start=100, requests=50, max_tokens_cap=16)
    full = load_trace(TRACE, limit=150)[100:]
    assert len(w) == 50 and w[0].timestamp_ms == 0.0
    assert [r.timestamp_ms for r in w] == [r.timestamp_ms - full[0].timestamp_ms for r in full]
    assert [r.output_length for r in w] == [min(16, r.output_length) for r in full]
    with pytest.raises(ValueError):
        load_workload(TRACE, start=20000)


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_router_sees_what_the_replay_body_gives(api):
    """The simulator's RequestInfo text/length equal what dplb_protocol.wire makes of dplb-replay's
    body (the router's one definition of a prompt's length)."""
    from simulate.workload import router_prompt_len

    for r in load_trace(TRACE, limit=40)[::7]:
        prompt = prompt_for(r)
        body = {"model": "m", "max_tokens": r.output_length, "stream": True,
                "stream_options": {"include_usage": True}}
        if api == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        raw = orjson.dumps(body)
        info = parse_request(CHAT if api == "chat" else COMPLETIONS, raw, True)
        assert info.text == router_text(r, api)
        assert info.prompt_len == router_prompt_len(r, api)
        assert info.prompt_len == r.input_length + (3 if api == "chat" else 0)


@pytest.mark.parametrize("api,block_size", [("chat", 16), ("completions", 16), ("chat", 7), ("chat", 1024)])
def test_engine_hashes_share_exactly_what_the_engine_tokens_share(api, block_size):
    """For the trace's first requests (shared conversation prefixes), the simulator's block hashes
    agree with sim_engine's chain_hashes of the rendered tokens on every common prefix length."""
    reqs = load_trace(TRACE, limit=120)
    eh = EngineHasher(block_size, api)
    mine = [eh.hashes(r) for r in reqs]
    assert mine == [eh.hashes(r) for r in reqs]           # cached segments give the same chains

    def tokens(r):
        p = prompt_for(r)
        return render_chat([{"role": "user", "content": p}]) if api == "chat" else tokenize(p)

    real = [chain_hashes(tokens(r), block_size) for r in reqs]

    def common(a, b):
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    shared = 0
    for i in range(0, len(reqs), 3):
        assert len(mine[i]) == len(real[i])
        for k in range(len(reqs)):
            c = common(real[i], real[k])
            assert common(mine[i], mine[k]) == c, (i, k)
            shared += c > 0 and i != k
    if block_size <= 16:
        assert shared > 0                                  # the case does exercise sharing


def test_rendered_prompt_is_the_engine_prompt():
    r = load_trace(TRACE, limit=3)[2]
    rp = RenderedPrompt(r, "chat")
    toks = render_chat([{"role": "user", "content": prompt_for(r)}])
    assert len(rp) == len(toks) and rp[0:len(rp)] == toks and rp[-1] == toks[-1] and rp[5] == toks[5]
    assert rp[len(rp) - 20:] == toks[-20:]


def test_block_texts_equal_bench_trace_block_text():
    from dplb_trace.mooncake import block_text
    from simulate.workload import BlockTexts

    bt = BlockTexts(max_blocks=64)
    ids = list(range(0, 3000, 7)) + [182789, (1 << 32) - 1, 1 << 32, (1 << 40) + (5 << 12) + 3, 2**70 + 1]
    for b in ids:
        assert bt.get(b) == block_text.__wrapped__(b) == block_text(b)
    assert len(bt._texts) == 64
    for r in load_trace(TRACE, limit=300)[::5]:
        assert bt.prompt(r) == prompt_for(r)
