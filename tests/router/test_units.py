"""Unit tests of the breaker, the prefix index, request parsing and config validation."""
from __future__ import annotations

import pytest

from router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from router.config import load_config
from router.errors import BadRequest, ConfigError
from router.policies.prefix_index import PrefixIndex
from router.protocol import error_body, parse_request, sse_error_event


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_needs_minimum_requests_before_opening():
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=Clock())
    for _ in range(19):
        cb.record(False)
    assert cb.state == CLOSED          # 19 failures out of 19, but fewer than 20 requests
    cb.record(False)
    assert cb.state == OPEN


@pytest.mark.parametrize("failures,successes,opens", [
    (3, 17, False),    # 15.0 % is not above 15 %
    (4, 16, True),     # 20 %
    (15, 85, False),   # 15 % over 100
    (16, 84, True),
])
def test_breaker_threshold(failures, successes, opens):
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=Clock())
    for _ in range(successes):
        cb.record(True)
    for _ in range(failures):
        cb.record(False)
    assert (cb.state == OPEN) is opens


def test_breaker_half_open_admits_one_probe_and_closes_on_success():
    clock = Clock()
    changes = []
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=clock, on_change=changes.append)
    for _ in range(20):
        cb.record(False)
    assert not cb.allow() and not cb.available()
    clock.t += 5.0
    assert cb.available() and cb.state == HALF_OPEN
    assert cb.allow()            # the probe
    assert not cb.allow()        # only one at a time
    cb.record(True)
    assert cb.state == CLOSED and cb.allow() and cb.failure_rate == 0.0
    assert changes == [OPEN, HALF_OPEN, CLOSED]


def test_breaker_half_open_failure_reopens_and_abandon_frees_probe():
    clock = Clock()
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=clock)
    for _ in range(20):
        cb.record(False)
    clock.t += 6
    assert cb.allow()
    cb.abandon()                 # client left: no verdict, the probe slot is free again
    assert cb.allow()
    cb.record(False)
    assert cb.state == OPEN and not cb.allow()


def test_breaker_sliding_window_forgets_old_failures():
    cb = CircuitBreaker(0.15, 20, 20, 5.0, clock=Clock())
    for _ in range(3):
        cb.record(False)
    for _ in range(40):
        cb.record(True)
    assert cb.failure_rate == 0.0
    for _ in range(3):
        cb.record(False)
    assert cb.state == CLOSED     # 3/20 = 15 %, not above


def test_prefix_index_match_depths_and_lru_bound():
    idx = PrefixIndex(chunk_chars=4, max_chunks=100, max_entries=6)
    a = idx.hashes("aaaabbbbcccc")
    b = idx.hashes("aaaabbbbdddd")
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    idx.insert(a, 0)
    idx.insert(b[:2], 1)
    assert idx.match(a) == {0: 3, 1: 2}
    assert idx.match(idx.hashes("zzzz")) == {}
    assert idx.match(idx.hashes("aaa")) == {}      # shorter than one chunk
    assert idx.size(0) == 3 and idx.size(1) == 2
    idx.insert(idx.hashes("qqqqrrrrsssstttt"), 2)  # 4 new entries, bound 6: 1 evicted (LRU)
    assert len(idx) == 6
    idx.remove_worker(2)
    assert idx.size(2) == 0 and len(idx) == 2


def test_prefix_index_same_chunk_at_different_depth_differs():
    idx = PrefixIndex(chunk_chars=4)
    assert idx.hashes("abcdabcd")[0] != idx.hashes("abcdabcd")[1]


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


def test_config_defaults_and_overrides(tmp_path):
    cfg = load_config(None)
    assert cfg.health_check.interval_ms == 200 and cfg.health_check.timeout_ms == 50
    assert cfg.health_check.max_failures == 3
    assert cfg.circuit_breaker.failure_rate_threshold == 0.15 and cfg.circuit_breaker.minimum_requests == 20
    assert cfg.routing_policy.kv_cache_threshold == 0.8 and cfg.shm_name == "dplb-30000"
    p = tmp_path / "d.yaml"
    p.write_text("router: {port: 31000}\nrouting_policy: {policy: cache_aware}\n"
                 "backend_servers:\n  - {endpoint: 'http://10.1.2.3:8001', weight: 2}\n")
    cfg = load_config(p, {"routing_policy.policy": "round_robin", "router.api_key": None})
    assert cfg.router.port == 31000 and cfg.shm_name == "dplb-31000"
    assert cfg.routing_policy.policy == "round_robin"          # flag beats file
    assert cfg.backend_servers[0].endpoint == "10.1.2.3:8001" and cfg.backend_servers[0].weight == 2.0


@pytest.mark.parametrize("text,field", [
    ("health_check: {interval_ms: -5}", "health_check.interval_ms"),
    ("routing_policy: {policy: fastest}", "routing_policy.policy"),
    ("routing_policy: {kv_cache_threshold: 1.5}", "routing_policy.kv_cache_threshold"),
    ("circuit_breaker: {failure_rate: 0.2}", "circuit_breaker.failure_rate"),     # unknown key (typo)
    ("backend_servers: [{endpoint: 'nohostport'}]", "backend_servers.0.endpoint"),
    ("router: {shm: '/dev/shm/x'}", "router.shm"),
    ("- just\n- a list", "<root>"),
    ("router: {port: [", "<file>"),
])
def test_config_errors_name_the_field(tmp_path, text, field):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.field == field
    assert field in str(ei.value)


def test_example_config_is_valid_and_matches_defaults():
    from router.config import Config
    from tests.helpers import ROOT

    cfg = load_config(ROOT / "dplb.example.yaml")
    assert cfg == Config()


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


def test_coalesced_request_counters_are_on_every_page_and_counted_once():
    from router.metrics import Metrics
    from tests.helpers import metric

    m = Metrics()
    for _ in range(3):
        m.decision("dplb", "ttft")
        m.observe_request("2", 200, "/v1/chat/completions", 0.01)
    m.count_tokens(2, "m", 9, 4)
    m.count_tokens(2, "m", 1, 0)
    for _ in range(2):   # the first render flushes; the second finds nothing new to add
        text = m.render()[0].decode()
        assert metric(text, "dplb_router_routing_decisions_total", policy="dplb", reason="ttft") == 3
        assert metric(text, "dplb_router_requests_total", worker="2", status="200") == 3
        assert metric(text, "dplb_router_prompt_tokens_total", worker="2", model="m") == 10
        assert metric(text, "dplb_router_generation_tokens_total", worker="2", model="m") == 4
        assert metric(text, "dplb_router_request_duration_seconds_count", route="/v1/chat/completions") == 3
    m.decision("dplb", "ttft")
    m.flush()   # what the health tick does
    assert metric(m.render()[0].decode(), "dplb_router_routing_decisions_total", policy="dplb", reason="ttft") == 4


def test_the_request_target_is_the_raw_path_and_query():
    from router.errors import BadRequest
    from router.exchange import request_target

    assert request_target({"path": "/v1/a\r\nb", "raw_path": b"/v1/a%0D%0Ab", "query_string": b"x=1"}) == \
        "/v1/a%0D%0Ab?x=1"
    assert request_target({"path": "/v1/a b\n"}) == "/v1/a%20b%0A"      # a server without raw_path
    with pytest.raises(BadRequest):
        request_target({"path": "/v1/x", "raw_path": b"/v1/x y", "query_string": b""})
    with pytest.raises(BadRequest):
        request_target({"path": "/v1/x", "raw_path": b"/v1/x", "query_string": b"a=\r\n"})
