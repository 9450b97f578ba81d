"""Request parsing and error bodies (dplb_protocol/wire.py): what is rejected, the routing fields, prompt length."""
from __future__ import annotations

import pytest

from dplb_protocol.wire import error_body, parse_request, sse_error_event
from router.errors import BadRequest


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", b"", None),
    ("/v1/chat/completions", b"{bad", None),
    ("/v1/chat/completions", b"[1,2]", None),
    ("/v1/chat/completions", b'{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", b'{"messages": []}', "messages"),
    ("/v1/chat/completions", b'{"messages": [1]}', "messages"),
    ("/v1/chat/completions", b'{"model": 3, "messages": [{"role":"user","content":"x"}]}', "model"),
    ("/v1/chat/completions", b'{"stream": "yes", "messages": [{"role":"user","content":"x"}]}', "stream"),
    ("/v1/completions", b'{"model": "m"}', "prompt"),
    ("/v1/completions", b'{"prompt": [{"a": 1}]}', "prompt"),
    ("/generate", b'{"sampling_params": {}}', "text"),
])
def test_parse_rejects_malformed(path, body, param):
    with pytest.raises(BadRequest) as ei:
        parse_request(path, body)
    assert ei.value.param == param and ei.value.status == 400


def test_parse_extracts_routing_fields():
    r = parse_request("/v1/chat/completions", b'{"model":"m","stream":true,"messages":[{"role":"system","content":'
                      b'"be brief"},{"role":"user","content":[{"type":"text","text":"two words"}]}],"x":{"y":1}}')
    # two messages: 2 + 2 content words, 2 template tokens each, 1 generation prompt (sim tokenizer)
    assert (r.model, r.stream, r.prompt_len) == ("m", True, 9)
    assert r.text == "system:be brief\nuser:two words"
    r = parse_request("/v1/completions", b'{"prompt":[1,2,3,4,5]}')
    assert (r.model, r.stream, r.text, r.prompt_len) == (None, False, "", 5)
    r = parse_request("/generate", b'{"text":"a b c","stream":false}')
    assert r.prompt_len == 3


def test_prompt_length_has_one_definition():
    """Issue 14: a batch of prompts costs the engine every prompt (the router used to count the
    first prompt only, the agent all of them); the same rule for every field that holds a prompt,
    and it matches the simulated engine's own count."""
    from sim_engine.tokenizer import render_chat

    assert parse_request("/v1/completions", b'{"prompt": ["a b c d", "e f g h i j"]}').prompt_len == 10
    assert parse_request("/v1/completions", b'{"prompt": [[1, 2, 3], [4, 5]]}').prompt_len == 5
    assert parse_request("/generate", b'{"text": ["a b", "c"]}').prompt_len == 3
    assert parse_request("/generate", b'{"input_ids": [[1, 2], [3]]}').prompt_len == 3
    assert parse_request("/v1/embeddings", b'{"input": ["x y", "z"]}').prompt_len == 3
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "two words"}, {"type": "image_url"}]},
            {"role": "assistant", "content": None}]
    import orjson

    assert parse_request("/v1/chat/completions", orjson.dumps({"messages": msgs})).prompt_len == len(render_chat(msgs))


def test_error_code_is_one_type():
    """The OpenAI error body's ``code`` is the HTTP status as an int everywhere (as vLLM fills it)."""
    import orjson

    from router.errors import GatewayTimeout, NoEligibleWorker

    assert orjson.loads(error_body("m", "t", 502))["error"]["code"] == 502
    assert orjson.loads(sse_error_event("m", "timeout_error", 504)[6:])["error"] == {
        "message": "m", "type": "timeout_error", "param": None, "code": 504}
    for e in (NoEligibleWorker(), GatewayTimeout("slow", worker_id=1), BadRequest("x", param="model")):
        assert orjson.loads(e.body())["error"]["code"] == e.status


def test_parse_never_fails_with_anything_but_bad_request():
    """Property: whatever the body, parsing either succeeds or raises BadRequest (→ 400, never 500)."""
    import orjson
    from hypothesis import given, settings
    from hypothesis import strategies as st

    json_values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False)
        | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
            st.sampled_from(["model", "messages", "prompt", "text", "input_ids", "stream", "role", "content",
                             "type", "x"]), inner, max_size=5),
        max_leaves=25)

    @settings(max_examples=400, deadline=None)
    @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate", "/v1/embeddings"]),
           body=st.one_of(st.binary(max_size=64), json_values.map(orjson.dumps)))
    def check(path, body):
        try:
            r = parse_request(path, body)
        except BadRequest as e:
            assert e.status == 400 and e.message
        else:
            assert r.prompt_len >= 0 and isinstance(r.text, str)

    check()
