"""Prompt-length estimates and TTFT/TPOT/e2e measurement of relayed streams."""
from __future__ import annotations

import orjson
import pytest

from worker_agent.meter import RequestMeter, estimate_prompt_tokens

MS = 1_000_000


def sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


def chat_delta(content=None, role=None, finish=None):
    delta = {}
    if role:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@pytest.mark.parametrize("body, n", [
    ({"model": "m", "prompt": "one two  three\nfour"}, 4),
    ({"model": "m", "prompt": [1, 2, 3, 4, 5]}, 5),
    ({"model": "m", "prompt": ["a b", "c"]}, 3),
    ({"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                 {"role": "user", "content": [{"type": "text", "text": "x y z"},
                                                              {"type": "image_url", "image_url": {}}]}]}, 5),
    ({"text": "sglang native prompt"}, 3),
    ({"input_ids": [7, 8]}, 2),
    ({"model": "m"}, 0),
])
def test_prompt_estimate(body, n):
    assert estimate_prompt_tokens(orjson.dumps(body)) == n


def test_prompt_estimate_tolerates_garbage():
    assert estimate_prompt_tokens(b"") == 0
    assert estimate_prompt_tokens(b"{not json") == 0
    assert estimate_prompt_tokens(b"[1,2]") == 0


def test_vllm_chat_stream_role_chunk_is_not_first_token():
    m = RequestMeter(0, streaming=True)
    m.feed(sse(chat_delta(role="assistant", content="")), now_ns=5 * MS)
    assert m.first_token_ns is None
    m.feed(sse(chat_delta("Hello")), now_ns=40 * MS)
    for i, t in enumerate(range(50, 90, 10)):          # 4 more tokens, 10 ms apart
        m.feed(sse(chat_delta(f" w{i}")), now_ns=t * MS)
    m.feed(sse(chat_delta("", finish="stop")) + sse(b"[DONE]"), now_ns=85 * MS)
    ttft, tpot, e2e = m.finish(now_ns=90 * MS)
    assert m.output_tokens() == 5
    assert ttft == pytest.approx(40.0)
    assert e2e == pytest.approx(90.0)
    assert tpot == pytest.approx((90 - 40) / 4)


def test_events_split_across_chunks_and_usage_wins():
    body = b"".join([sse(chat_delta("a")), sse(chat_delta("b")), sse(chat_delta("c")),
                     sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}), sse(b"[DONE]")])
    m = RequestMeter(0, streaming=True)
    for i in range(0, len(body), 5):                   # 5-byte chunks: separators straddle chunks
        m.feed(body[i:i + 5], now_ns=10 * MS)
    assert m.first_token_ns == 10 * MS
    assert m.output_tokens() == 7                      # usage.completion_tokens is exact


def test_split_chunks_count_events_without_usage():
    body = b"".join([sse(chat_delta("a"))] + [sse(chat_delta("x")) for _ in range(9)] + [sse(b"[DONE]")])
    m = RequestMeter(0, streaming=True)
    for i in range(0, len(body), 7):
        m.feed(body[i:i + 7], now_ns=1)
    assert m.output_tokens() == 10


def test_completions_and_sglang_generate_streams():
    m = RequestMeter(0, streaming=True)
    m.feed(sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]}), now_ns=1 * MS)
    m.feed(sse({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}), now_ns=3 * MS)
    assert m.first_token_ns == 3 * MS
    g = RequestMeter(0, streaming=True)
    g.feed(sse({"text": "a", "meta_info": {"completion_tokens": 1}}), now_ns=2 * MS)
    g.feed(sse({"text": "a b c", "meta_info": {"completion_tokens": 3}}) + sse(b"[DONE]"), now_ns=4 * MS)
    assert g.output_tokens() == 3
    ttft, tpot, e2e = g.finish(now_ns=6 * MS)
    assert (ttft, tpot, e2e) == pytest.approx((2.0, 2.0, 6.0))


def test_non_streaming_gives_only_e2e_and_single_token_no_tpot():
    m = RequestMeter(1 * MS, streaming=False)
    m.feed(b'{"choices": [{"text": "x"}]}', now_ns=2 * MS)
    assert m.finish(now_ns=11 * MS) == (None, None, pytest.approx(10.0))
    one = RequestMeter(0, streaming=True)
    one.feed(sse(chat_delta("x")) + sse(b"[DONE]"), now_ns=MS)
    ttft, tpot, _ = one.finish(now_ns=2 * MS)
    assert ttft == pytest.approx(1.0) and tpot is None
