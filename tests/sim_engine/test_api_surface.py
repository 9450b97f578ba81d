"""The HTTP surface: OpenAI-shaped errors, peer endpoints in the shapes other routers expect,
SGLang's /generate, and the OpenAI SDK against ``--port``."""

from __future__ import annotations

import sys

import httpx
import orjson
import pytest

from tests.helpers import free_port, wait_for_port
from tests.sim_engine.simhelpers import metrics


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"max_tokens": 5}, "prompt"),
        ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
        ("/v1/completions", {"prompt": "a", "temperature": 9}, "temperature"),
        ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": "", "max_tokens": 3}, "prompt"),
        ("/v1/completions", {"prompt": "a b", "max_tokens": 200_000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/generate", {"sampling_params": {"max_new_tokens": 3}}, "text"),
        ("/tokenize", {"prompt": 3}, "prompt"),
    ],
)
def test_bad_requests_get_openai_shaped_400(shared_engine, path, body, param):
    assert_openai_error(shared_engine.post(path, json=body), 400, param)


def test_invalid_json_unknown_model_unknown_path(shared_engine):
    c = shared_engine
    assert_openai_error(
        c.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"}), 400
    )
    assert_openai_error(c.post("/v1/completions", content=b"[1, 2]"), 400)
    err = assert_openai_error(
        c.post(
            "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
        ),
        404,
        "model",
    )
    assert "gpt-9" in err["message"]
    assert_openai_error(c.get("/v1/nothing-here"), 404)
    long_prompt = " ".join(["w"] * 131_000)
    err = assert_openai_error(c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 100}), 400)
    assert "maximum context length" in err["message"]


def test_peer_endpoints_shapes(shared_engine):
    c = shared_engine
    for path in ("/server_info", "/get_server_info"):
        info = c.get(path).json()
        assert info["max_running_requests"] == 256 and info["page_size"] == 16
        assert "internal_states" in info and "model_path" not in info
    for path in ("/model_info", "/get_model_info"):
        mi = c.get(path).json()
        assert mi["is_generation"] is True and "model_path" not in mi
    load = c.get("/get_load").json()
    assert isinstance(load, list) and load[0]["dp_rank"] == 0
    assert {"num_reqs", "num_waiting_reqs", "num_tokens"} <= set(load[0])
    assert c.get("/load").json() == {"server_load": 0}

    tok = c.post("/tokenize", json={"prompt": "hello big world hello"}).json()
    assert tok["count"] == 4 and tok["max_model_len"] == 131072
    assert len(tok["tokens"]) == 4 and tok["tokens"][0] == tok["tokens"][3] != tok["tokens"][1]
    msgs = [{"role": "user", "content": "hello big world"}]
    tok_chat = c.post("/tokenize", json={"messages": msgs}).json()
    render = c.post("/v1/chat/completions/render", json={"messages": msgs, "max_tokens": 5}).json()
    assert render["token_ids"] == tok_chat["tokens"] and len(render["token_ids"]) == 6
    assert render["sampling_params"]["max_tokens"] == 5
    rc = c.post("/v1/completions/render", json={"prompt": ["a b", "c d e"]}).json()
    assert isinstance(rc, list) and [len(x["token_ids"]) for x in rc] == [2, 3]
    # render does not run anything
    assert c.get("/sim/state").json()["in_flight"] == []


def test_token_ids_are_stable_across_processes(shared_engine):
    """Token ids are crc32-based, not Python's per-process salted hash: another process agrees."""
    from sim_engine.tokenizer import render_chat, token_ids

    msgs = [{"role": "system", "content": "you are kind"}, {"role": "user", "content": "hi"}]
    got = shared_engine.post("/v1/chat/completions/render", json={"messages": msgs}).json()["token_ids"]
    assert got == token_ids(render_chat(msgs), 128_256)


def test_generate_sglang_shape(shared_engine):
    c = shared_engine
    r = c.post("/generate", json={"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 6}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["text"].split()) == 6
    mi = out["meta_info"]
    assert mi["prompt_tokens"] == 4 and mi["completion_tokens"] == 6
    assert mi["finish_reason"] == {"type": "length", "length": 6}
    with c.stream(
        "POST", "/generate", json={"text": "x y", "sampling_params": {"max_new_tokens": 4}, "stream": True}
    ) as s:
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    texts = [orjson.loads(e)["text"] for e in events[:-1]]
    assert [len(t.split()) for t in texts] == [1, 2, 3, 4]  # cumulative text, as SGLang streams
    r = c.post("/generate", json={"text": ["a", "b c"], "sampling_params": {"max_new_tokens": 2}})
    assert [o["meta_info"]["prompt_tokens"] for o in r.json()] == [1, 2]


def test_n_choices_stop_and_request_id(shared_engine):
    c = shared_engine
    r = c.post(
        "/v1/completions",
        json={"prompt": "a b c", "max_tokens": 4, "n": 3},
        headers={"X-Request-Id": "my-req-1"},
    ).json()
    assert r["id"] == "my-req-1"
    echoed = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers={"X-Request-Id": "abc"})
    assert echoed.headers["x-request-id"] == "abc"
    assert sorted(ch["index"] for ch in r["choices"]) == [0, 1, 2]
    assert r["usage"]["completion_tokens"] == 12 and r["usage"]["prompt_tokens"] == 3


def test_stop_string_cuts_output_and_reports_stop(engine_factory):
    from sim_engine.tokenizer import WordSource

    c = engine_factory("--seed", "5", "--time-scale", "50")
    ws = WordSource(5)
    start = ws.start()
    expect = [ws.word(start + k) for k in range(200)]  # the first request's words
    stop = next(w for k, w in enumerate(expect) if k >= 5 and w not in "".join(" " + x for x in expect[:k]))
    # stop strings match anywhere in the text: the token that first completes the match ends the request
    k_end = next(k for k in range(200) if stop in "".join(" " + x for x in expect[: k + 1]))
    full = "".join(" " + x for x in expect[: k_end + 1])
    r = c.post("/v1/completions", json={"prompt": "stop test", "max_tokens": 200, "stop": [stop]}).json()
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    assert ch["text"] == full[: full.find(stop)] and stop not in ch["text"]
    assert r["usage"]["completion_tokens"] == k_end + 1 < 200


def test_openai_sdk_stream_and_not_over_tcp(procs):
    openai = pytest.importorskip("openai")
    port = free_port()
    procs.start([sys.executable, "-m", "sim_engine", "--port", str(port), "--time-scale", "10"])
    wait_for_port(port, timeout=30)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    try:
        resp = client.chat.completions.create(
            model="sim-llama-3.1-8b", max_tokens=5, messages=[{"role": "user", "content": "hello"}]
        )
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
        pieces = []
        for chunk in client.chat.completions.create(
            model="sim-llama-3.1-8b",
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "hello"}],
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage:
                assert chunk.usage.completion_tokens == 7
        assert len(pieces) == 7
        comp = client.completions.create(model="sim-llama-3.1-8b", prompt="one two", max_tokens=3)
        assert len(comp.choices[0].text.split()) == 3
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="sim-llama-3.1-8b", prompt="x", max_tokens=-3)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=3)
        names = {
            ln.split("{")[0].split(" ")[0]
            for ln in httpx.get(f"http://127.0.0.1:{port}/metrics").text.splitlines()
            if ln and ln[0] != "#"
        }
        for n in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
            "vllm:num_preemptions_total",
            "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket",
            "vllm:e2e_request_latency_seconds_bucket",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:request_success_total",
        ):
            assert n in names, n
    finally:
        client.close()


def test_metrics_types_are_vllms(shared_engine):
    text = shared_engine.get("/metrics").text
    for name, typ in (
        ("vllm:num_requests_running", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:prefix_cache_queries", "counter"),
        ("vllm:num_preemptions", "counter"),
        ("vllm:time_to_first_token_seconds", "histogram"),
        ("vllm:inter_token_latency_seconds", "histogram"),
        ("vllm:e2e_request_latency_seconds", "histogram"),
    ):
        assert f"# TYPE {name} {typ}" in text or f"# TYPE {name}_total {typ}" in text, name
    assert metrics(shared_engine)["vllm:kv_cache_usage_perc"] >= 0


def test_get_load_vllm_format_and_lenient_render(engine_factory):
    c = engine_factory("--get-load-format", "vllm", "--time-scale", "50")
    assert c.get("/get_load").json() == {"load": 0}
    # routers send their own model name to the tokenize/render helpers: accepted
    r = c.post(
        "/v1/chat/completions/render",
        json={"model": "router-alias", "messages": [{"role": "user", "content": "a b"}]},
    )
    assert r.status_code == 200 and len(r.json()["token_ids"]) == 5
    assert c.post("/tokenize", json={"model": "x", "prompt": ["a b", "c"]}).json()["count"] == 3
    # generation keeps vLLM's strictness
    assert c.post("/v1/completions", json={"model": "router-alias", "prompt": "a"}).status_code == 404
