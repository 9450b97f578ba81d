"""A real engine process answers the OpenAI endpoints, stream and not, over its Unix socket."""

from __future__ import annotations

import os
import stat

import orjson


def test_health_models_completion_and_chat(engine_factory, run_dir):
    c = engine_factory("--time-scale", "50")
    assert stat.S_IMODE(os.stat(os.path.join(run_dir, "engine.sock")).st_mode) == 0o600
    assert c.get("/health").status_code == 200
    models = c.get("/v1/models").json()
    assert models["data"][0]["id"] == "sim-llama-3.1-8b"

    r = c.post("/v1/completions", json={"prompt": "one two three four", "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length"
    assert len(body["choices"][0]["text"].split()) == 7
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 7,
        "total_tokens": 11,
        "prompt_tokens_details": None,
    }

    r = c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi there"}], "max_completion_tokens": 3},
    )
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"].split()) == 3

    with c.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True},
    ) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(ln[6:]) for ln in lines[:-1]]
    contents = [ch["choices"][0]["delta"].get("content") for ch in chunks[1:]]
    assert len(contents) == 4 and all(len(t.split()) == 1 for t in contents)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_sigterm_ends_open_streams_with_abort_and_removes_socket(engine_factory, procs, run_dir):
    import signal

    c = engine_factory("--time-scale", "0.1")
    proc = procs.children[-1]
    with c.stream(
        "POST", "/v1/completions", json={"prompt": "a b c", "max_tokens": 5000, "stream": True}
    ) as s:
        lines = s.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: {"))
        assert orjson.loads(first[6:])["choices"][0]["finish_reason"] is None
        proc.send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln]
    assert rest[-1] == "data: [DONE]"
    assert orjson.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
    assert proc.wait(timeout=20) == 0
    assert not os.path.exists(os.path.join(run_dir, "engine.sock"))


def test_help_gives_sources_and_bad_flags_exit_2(capsys):
    from sim_engine.server import build_parser, main

    text = build_parser().format_help()
    for needle in (
        "--num-gpu-blocks",
        "131,072 B per token",
        "3.35 TB/s",
        "989 TFLOP/s",
        "--slowdown",
        "--time-scale",
        "--seed",
        "--max-num-batched-tokens",
    ):
        assert needle in text, needle
    assert main(["--block-size", "0"]) == 2
    assert "block_size=0" in capsys.readouterr().err
