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
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 7, "total_tokens": 11,
                             "prompt_tokens_details": None}

    r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi there"}],
                                             "max_completion_tokens": 3})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and len(msg["content"].split()) == 3

    with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 4, "stream": True}) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(ln[6:]) for ln in lines[:-1]]
    contents = [ch["choices"][0]["delta"].get("content") for ch in chunks[1:]]
    assert len(contents) == 4 and all(len(t.split()) == 1 for t in contents)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
