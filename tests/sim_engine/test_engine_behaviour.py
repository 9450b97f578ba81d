"""Engine behaviour seen from outside, through a real server process: prefix caching, KV pressure,
streaming, client disconnects, metrics."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import orjson

from tests.helpers import wait_until
from tests.sim_engine.simhelpers import metrics


def words(prefix: str, n: int) -> str:
    return " ".join(f"{prefix}{i}" for i in range(n))


def state_when(c: httpx.Client, pred, what: str) -> dict:
    """Poll ``/sim/state`` until ``pred(state)``; return that state (TimeoutError after 20 s)."""

    def probe() -> dict | None:
        st = c.get("/sim/state").json()
        return st if pred(st) else None

    return wait_until(probe, timeout=20, what=what)


def stream_ttft(c: httpx.Client, prompt: str) -> float:
    """Client-side time to the first content chunk of a streamed completion (seconds)."""
    t0 = time.monotonic()
    with c.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "stream": True}) as s:
        ttft = None
        for line in s.iter_lines():
            if ttft is None and line.startswith("data: {"):
                ttft = time.monotonic() - t0
    assert ttft is not None
    return ttft


def test_shared_prefix_lowers_ttft_and_counts_hits_until_evicted(engine_factory):
    # 700 blocks x 16 = 11,200 tokens of KV; half real time: a 4,050-token prefill takes ~0.3 s of wall
    # time, a cached one ~15 ms, so scheduling noise on a loaded machine cannot blur the difference
    c = engine_factory("--time-scale", "0.5", "--num-gpu-blocks", "700")
    shared = words("s", 4000)
    m0 = metrics(c)
    ttft_a = stream_ttft(c, shared + " " + words("a", 50))
    m1 = metrics(c)
    ttft_b = stream_ttft(c, shared + " " + words("b", 50))
    m2 = metrics(c)
    hits = "vllm:prefix_cache_hits_total"
    assert m1[hits] - m0[hits] == 0
    assert m2[hits] - m1[hits] == 4000  # the 250 shared full blocks
    sim_ttft_a = m1["vllm:time_to_first_token_seconds_sum"] - m0["vllm:time_to_first_token_seconds_sum"]
    sim_ttft_b = m2["vllm:time_to_first_token_seconds_sum"] - m1["vllm:time_to_first_token_seconds_sum"]
    assert sim_ttft_b < sim_ttft_a / 3
    assert ttft_b < ttft_a
    # three unrelated 5000-token prompts need 939 blocks > 700: every shared block gets evicted
    for i in range(3):
        stream_ttft(c, words(f"f{i}x", 5000))
    m3 = metrics(c)
    ttft_c = stream_ttft(c, shared + " " + words("b", 50))
    m4 = metrics(c)
    assert m4[hits] == m3[hits]
    sim_ttft_c = m4["vllm:time_to_first_token_seconds_sum"] - m3["vllm:time_to_first_token_seconds_sum"]
    assert sim_ttft_c > 3 * sim_ttft_b
    assert ttft_c > ttft_b


async def test_filling_kv_makes_requests_wait_then_preempt(engine_factory, run_dir):
    # 64 blocks = 1024 tokens; 8 requests of 200 prompt + 150 output tokens (22 blocks each at the end)
    sync = engine_factory("--time-scale", "4", "--num-gpu-blocks", "64", "--max-num-seqs", "16")
    transport = httpx.AsyncHTTPTransport(uds=f"{run_dir}/engine.sock")
    async with httpx.AsyncClient(transport=transport, base_url="http://sim", timeout=120) as ac:

        async def one(i: int) -> dict:
            r = await ac.post("/v1/completions", json={"prompt": words(f"r{i}x", 200), "max_tokens": 150})
            assert r.status_code == 200, r.text
            return r.json()

        tasks = [asyncio.ensure_future(one(i)) for i in range(8)]
        max_waiting = max_usage = 0.0
        while not all(t.done() for t in tasks):
            m = metrics(sync)
            max_waiting = max(max_waiting, m["vllm:num_requests_waiting"])
            max_usage = max(max_usage, m["vllm:kv_cache_usage_perc"])
            assert 0.0 <= m["vllm:kv_cache_usage_perc"] <= 1.0
            await asyncio.sleep(0.02)
        results = await asyncio.gather(*tasks)
    assert all(r["usage"]["completion_tokens"] == 150 for r in results)
    m = metrics(sync)
    assert max_waiting > 0
    assert max_usage > 0.8
    assert m["vllm:num_preemptions_total"] > 0
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def _sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, e
    return [e[6:] for e in events]


def test_streaming_is_well_formed_and_starts_before_the_last_token(engine_factory):
    c = engine_factory("--time-scale", "0.25")  # 60 tokens take >1 s: time to look at the engine mid-stream
    body = {
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 60,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    raw = b""
    state_at_first = None
    with c.stream("POST", "/v1/chat/completions", json=body) as s:
        for chunk in s.iter_raw():
            raw += chunk
            if state_at_first is None and b'"content":" ' in raw:
                state_at_first = c.get("/sim/state").json()
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    objs = [orjson.loads(e) for e in events[:-1]]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    toks = objs[1:-1]
    assert len(toks) == 60
    for o in toks:
        assert o["object"] == "chat.completion.chunk"
        assert len(o["choices"]) == 1 and len(o["choices"][0]["delta"]["content"].split()) == 1
    assert [o["choices"][0]["finish_reason"] for o in toks] == [None] * 59 + ["length"]
    usage = objs[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 60
    assert usage["usage"]["prompt_tokens"] == 7  # <|user|> tell me a story <|eot|> <|assistant|>
    # the first token reached us while the engine was still generating this request
    assert state_at_first is not None and state_at_first["running"] == 1
    assert state_at_first["generation_tokens"] < 60


def test_completion_stream_without_usage(engine_factory):
    c = engine_factory("--time-scale", "50")
    with c.stream(
        "POST", "/v1/completions", json={"prompt": "a b c", "max_tokens": 5, "stream": True, "n": 2}
    ) as s:
        raw = s.read()
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    objs = [orjson.loads(e) for e in events[:-1]]
    assert all("usage" not in o for o in objs)
    assert sorted(o["choices"][0]["index"] for o in objs) == [0] * 5 + [1] * 5
    assert all(o["object"] == "text_completion" for o in objs)


def test_client_disconnect_mid_stream_frees_blocks_within_one_step(engine_factory):
    # time-scale 0.01: every step lasts >= 0.5 s of wall time, so "within one step" is observable
    c = engine_factory("--time-scale", "0.01")
    with c.stream(
        "POST", "/v1/completions", json={"prompt": words("p", 40), "max_tokens": 500, "stream": True}
    ) as s:
        lines = s.iter_lines()  # keep a reference: a collected iterator closes the connection
        got = 0
        for line in lines:
            if line.startswith("data: {"):
                got += 1
                if got == 2:
                    break
        before = c.get("/sim/state").json()
        assert before["running"] == 1 and before["used_blocks"] == 3
        assert c.get("/load").json() == {"server_load": 1}
    # leaving the block closes the connection
    state = state_when(c, lambda st: st["used_blocks"] == 0, "blocks freed")
    assert state["running"] == 0 and state["in_flight"] == []
    assert state["steps"] <= before["steps"] + 1
    assert state["request_success"]["abort"] == 1
    assert c.get("/load").json() == {"server_load": 0}


def test_disconnect_while_queued_removes_the_waiting_request(engine_factory):
    c = engine_factory("--time-scale", "0.05", "--max-num-seqs", "1")
    body = {"prompt": words("p", 10), "max_tokens": 400, "stream": True}
    with c.stream("POST", "/v1/completions", json=body) as first:
        lines = first.iter_lines()
        next(ln for ln in lines if ln.startswith("data: {"))
        with c.stream("POST", "/v1/completions", json=body) as second:
            st = state_when(c, lambda st: st["waiting"] == 1, "second request queued")
            waiting_id = st["waiting_ids"][0]
            assert second.status_code == 200
        st = state_when(c, lambda st: st["waiting"] == 0, "queued request aborted")
        assert waiting_id not in st["in_flight"] and st["running"] == 1
        assert st["request_success"]["abort"] == 1


def test_non_streaming_client_disconnect_aborts(engine_factory, run_dir):
    c = engine_factory("--time-scale", "0.05")
    body = orjson.dumps({"prompt": words("q", 20), "max_tokens": 1000})
    s = socket.socket(socket.AF_UNIX)
    s.connect(f"{run_dir}/engine.sock")
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    wait_until(lambda: c.get("/sim/state").json()["running"] == 1, timeout=20, what="request running")
    assert c.get("/load").json() == {"server_load": 1}
    s.close()
    state = state_when(c, lambda st: st["running"] == 0, "request aborted")
    assert state["used_blocks"] == 0 and state["request_success"]["abort"] == 1
    assert c.get("/load").json() == {"server_load": 0}


def test_metrics_agree_with_engine_state(engine_factory):
    c = engine_factory("--time-scale", "20")
    sent = []
    shared = words("sys", 64)
    for i in range(6):
        r = c.post(
            "/v1/completions", json={"prompt": f"{shared} {words(f'u{i}x', 10 + i)}", "max_tokens": 3 + i}
        )
        assert r.status_code == 200
        sent.append(r.json()["usage"])
    m = metrics(c)
    st = c.get("/sim/state").json()
    assert m["vllm:num_requests_running"] == st["running"] == 0
    assert m["vllm:num_requests_waiting"] == st["waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == st["kv_cache_usage"] == 0
    assert m["vllm:prompt_tokens_total"] == sum(u["prompt_tokens"] for u in sent) == st["prompt_tokens"]
    assert (
        m["vllm:generation_tokens_total"]
        == sum(u["completion_tokens"] for u in sent)
        == st["generation_tokens"]
    )
    assert m["vllm:request_success_total{finished_reason=length}"] == 6
    assert (
        m["vllm:prefix_cache_queries_total"]
        == st["prefix_cache_queries"]
        == sum(u["prompt_tokens"] for u in sent)
    )
    assert m["vllm:prefix_cache_hits_total"] == st["prefix_cache_hits"] == 5 * 64
    assert m["vllm:num_preemptions_total"] == st["preemptions"] == 0
    assert m["vllm:time_to_first_token_seconds_count"] == 6
    assert m["vllm:e2e_request_latency_seconds_count"] == 6
    assert m["vllm:inter_token_latency_seconds_count"] == sum(u["completion_tokens"] - 1 for u in sent)
    assert m["vllm:time_to_first_token_seconds_bucket{le=+Inf}"] == 6
    # under load: gauges equal the engine state whenever no step ended between the two reads
    slow = engine_factory("--time-scale", "0.05", name="slow")
    with slow.stream(
        "POST", "/v1/completions", json={"prompt": words("z", 100), "max_tokens": 400, "stream": True}
    ) as s:
        it = s.iter_lines()
        next(line for line in it if line.startswith("data: {"))
        for _ in range(10):
            a = slow.get("/sim/state").json()
            m = metrics(slow)
            b = slow.get("/sim/state").json()
            if a["steps"] == b["steps"]:
                break
        assert a["steps"] == b["steps"]
        assert m["vllm:num_requests_running"] == a["running"] == 1
        assert m["vllm:kv_cache_usage_perc"] == a["kv_cache_usage"] > 0
        assert m["vllm:generation_tokens_total"] == a["generation_tokens"] >= 1


def test_fast_time_scale_bursts_still_stream_one_token_per_chunk(engine_factory):
    # at --time-scale 1000 a 5 ms step lasts 5 us: the runner computes ~200 steps per 1 ms burst
    c = engine_factory("--time-scale", "1000")
    with c.stream(
        "POST", "/v1/completions", json={"prompt": "go", "max_tokens": 300, "stream": True, "n": 2}
    ) as s:
        events = _sse_events(s.read())
    assert events[-1] == "[DONE]"
    objs = [orjson.loads(e) for e in events[:-1]]
    for idx in (0, 1):
        mine = [o["choices"][0] for o in objs if o["choices"][0]["index"] == idx]
        assert len(mine) == 300 and all(len(ch["text"].split()) == 1 for ch in mine)
        assert [ch["finish_reason"] for ch in mine[-2:]] == [None, "length"]
    m = metrics(c)
    assert m["vllm:inter_token_latency_seconds_count"] == 2 * 299
    # the reported inter-token latency is the modelled step (~5 ms) in wall-clock seconds, i.e.
    # divided by the time scale (what a client of a 1000x engine measures when the CPU keeps up)
    assert 0.004 / 1000 < m["vllm:inter_token_latency_seconds_sum"] / (2 * 299) < 0.02 / 1000
