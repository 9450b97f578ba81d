"""The router against fake workers (bench/fakes.py): endpoints, pass-through, accounting, faults."""
from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import openai
import orjson
import pytest

from tests.helpers import metric, wait_until

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hello there"}]


def client(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=kw.pop("api_key", "sk-test"), max_retries=0, timeout=30, **kw)


def status(base: str) -> dict:
    return httpx.get(base + "/dplb/status", timeout=10).json()


def reset(c) -> None:
    for f in c.fakes:
        f.client().set_mode("ok", reset_stats=True)


# ---------------------------------------------------------------------------------- endpoints


def test_openai_client_every_endpoint(cluster4):
    c = client(cluster4.base)
    raw = c.chat.completions.with_raw_response.create(model=MODEL, messages=MSG)
    assert raw.headers["x-dplb-worker-id"] in {"0", "1", "2", "3"}
    chat = raw.parse()
    assert chat.choices[0].message.content.startswith("hello from fake worker")
    assert f"worker {raw.headers['x-dplb-worker-id']}" in chat.choices[0].message.content

    with c.chat.completions.with_streaming_response.create(model=MODEL, messages=MSG, stream=True) as resp:
        assert resp.headers["x-dplb-worker-id"] in {"0", "1", "2", "3"}
        assert resp.headers["content-type"].startswith("text/event-stream")
        parts = [ch.choices[0].delta.content for ch in resp.parse() if ch.choices]
    assert parts == ["t0 ", "t1 ", "t2 "]

    raw = c.completions.with_raw_response.create(model=MODEL, prompt="once upon a time", max_tokens=5)
    assert raw.headers["x-dplb-worker-id"] in {"0", "1", "2", "3"}
    assert raw.parse().choices[0].text.startswith("hello")
    texts = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="x", stream=True)]
    assert texts == ["t0 ", "t1 ", "t2 "]

    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]

    r = httpx.post(cluster4.base + "/generate", json={"text": "a b c", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["text"].startswith("hello") and "x-dplb-worker-id" in r.headers


def test_headers_and_unknown_fields_reach_the_worker(cluster4):
    body = {"model": MODEL, "messages": MSG, "vendor_extension": {"a": [1, 2]}, "top_k": 7}
    r = httpx.post(cluster4.base + "/v1/chat/completions", json=body,
                   headers={"Authorization": "Bearer user-token", "X-Request-Id": "req-123", "X-Custom": "yes"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-123"
    seen = r.json()["fake"]
    assert seen["body"] == body
    assert seen["headers"]["authorization"] == "Bearer user-token"
    assert seen["headers"]["x-request-id"] == "req-123"
    assert seen["headers"]["x-custom"] == "yes"
    assert str(seen["worker_id"]) == r.headers["x-dplb-worker-id"]


def test_request_id_minted_when_absent(cluster4):
    r = httpx.post(cluster4.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    rid = r.headers["x-request-id"]
    assert len(rid) >= 16 and r.json()["fake"]["headers"]["x-request-id"] == rid


def test_status_health_and_metrics(cluster4):
    st = status(cluster4.base)
    assert st["policy"] == "dplb" and len(st["workers"]) == 4
    for w in st["workers"]:
        assert w["state"] == "ready" and w["eligible"] and w["circuit"] == "closed"
        assert w["endpoint"].endswith(f"fake-{w['id']}.sock")
        for k in ("inflight", "running", "waiting", "kv_cache_usage", "latency_ms"):
            assert k in w
        # the agent's pid (``pid`` kept as its old name) and the engine's: none for a fake worker
        assert w["agent_pid"] == w["pid"] > 0 and w["engine_pid"] is None and w["model"] == MODEL
    assert httpx.get(cluster4.base + "/health").status_code == 200
    httpx.post(cluster4.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    text = httpx.get(cluster4.base + "/metrics").text
    for fam in ("dplb_router_requests_total", "dplb_router_request_errors_total",
                "dplb_router_request_duration_seconds_bucket", "dplb_router_time_to_first_token_seconds",
                "dplb_worker_requests_in_flight", "dplb_worker_kv_cache_usage_ratio", "dplb_build_info",
                "dplb_router_routing_decisions_total", "dplb_router_retries_total", "dplb_worker_circuit_state"):
        assert fam in text, fam
    assert 'dplb_router_routing_decisions_total{policy="dplb",reason="ttft"}' in text


# --------------------------------------------------------------------------------- balancing


def test_burst_of_100_spreads_over_4_idle_workers(cluster4):
    reset(cluster4)
    for f in cluster4.fakes:
        f.client().set_mode("slow", delay=0.3)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster4.base, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as ac:
            rs = await asyncio.gather(*(ac.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
                                        for _ in range(100)))
        assert all(r.status_code == 200 for r in rs)
        return [r.headers["x-dplb-worker-id"] for r in rs]

    try:
        share = Counter(asyncio.run(burst()))
    finally:
        reset(cluster4)
    assert set(share) == {"0", "1", "2", "3"}, share
    assert max(share.values()) <= 35, share
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="in-flight back to 0")


def test_route_dry_run_agrees_with_serving_worker(make_cluster):
    # different queue lengths make the kernel's choice unique: worker 2 is the least loaded
    c = make_cluster(3, None, [["--waiting", "30"], ["--waiting", "20"], ["--waiting", "2"]])
    for _ in range(3):
        body = {"model": MODEL, "messages": MSG}
        d = httpx.post(c.base + "/dplb/route", json=body).json()
        assert d["policy"] == "dplb" and d["worker_id"] == 2
        assert {s["worker_id"] for s in d["scores"]} == {0, 1, 2}
        best = max(d["scores"], key=lambda s: s["score"])
        assert best["worker_id"] == 2 and set(best) >= {"est_s", "prefill_s", "decode_s", "kv_s", "queue_tokens"}
        r = httpx.post(c.base + "/v1/chat/completions", json=body)
        assert r.headers["x-dplb-worker-id"] == str(d["worker_id"])
    assert sum(f.client().stats()["requests"] for f in c.fakes[:2]) == 0   # dry runs sent nothing


# ------------------------------------------------------------------------------- accounting


def _stream(base: str, headers: dict | None = None, n_read: int | None = None) -> tuple[str, list[bytes]]:
    """Open a chat stream; read ``n_read`` chunks (all when None); return worker id and chunks."""
    chunks = []
    with httpx.Client(base_url=base, timeout=30) as hc, \
            hc.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "stream": True},
                      headers=headers or {}) as r:
        wid = r.headers["x-dplb-worker-id"]
        for ch in r.iter_raw():
            chunks.append(ch)
            if n_read is not None and len(chunks) >= n_read:
                break
    return wid, chunks


def test_stream_inflight_lasts_until_end_and_is_released_once(cluster4):
    reset(cluster4)
    seen: list[list[int]] = []
    done = {}

    async def run() -> None:
        async with httpx.AsyncClient(base_url=cluster4.base, timeout=30) as ac, \
                ac.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "stream": True},
                          headers={"x-fake-mode": "stream", "x-fake-chunks": "5", "x-fake-delay": "0.3"}) as r:
            done["wid"] = int(r.headers["x-dplb-worker-id"])
            async for _ in r.aiter_raw():
                seen.append(cluster4.router_inflight())
    asyncio.run(run())
    wid = done["wid"]
    assert len(seen) >= 5
    # held while the stream runs: chunks 0..3 arrive 0.3 s before the stream's end
    assert all(s[wid] == 1 for s in seen[:4]), seen
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="release after the stream")
    time.sleep(0.3)
    assert cluster4.router_inflight() == [0, 0, 0, 0]          # released exactly once: never negative


def test_broken_stream_ends_with_sse_error_and_releases(cluster4):
    reset(cluster4)
    _, chunks = _stream(cluster4.base, {"x-fake-mode": "break"})
    body = b"".join(chunks)
    assert body.count(b"chat.completion.chunk") == 2
    assert b'data: {"error":' in body and b'"type":"upstream_error"' in body
    assert b"[DONE]" not in body
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="release after a broken stream")


def test_a_broken_stream_and_an_answer_are_counted_on_their_worker_in_dump_status_and_metrics(cluster4):
    """Issue 32: the dump's ``fail`` and ``dplb_worker_requests_failed_total`` stayed 0 when the
    router recorded a 502 stream_broken on that worker: the router's lease now counts each
    attempt's outcome in the worker's router stats line, the one count all three read."""
    from dplb_shm import dump

    reset(cluster4)
    before = {i: (s.completed, s.failed) for i, s in enumerate(cluster4.seg.snapshot()[:4])}
    wid, _ = _stream(cluster4.base, {"x-fake-mode": "break"})
    w = int(wid)
    wait_until(lambda: cluster4.seg.read_slot(w).failed == before[w][1] + 1, 10, what="the failure counted")
    r = httpx.post(cluster4.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=30)
    ok = int(r.headers["x-dplb-worker-id"])
    wait_until(lambda: cluster4.seg.read_slot(ok).completed == before[ok][0] + 1, 10,
               what="the answer counted")
    s = cluster4.seg.read_slot(w)
    row = next(x for x in dump.render_table(cluster4.seg).splitlines()[2:] if x.split()[0] == wid)
    cols = dump.COLUMNS
    assert row.split()[cols.index("fail")] == str(s.failed), (cols, row)
    def row_of_status() -> dict:
        return next(x for x in status(cluster4.base)["workers"] if x["id"] == w)

    # /dplb/status reads the snapshot the router synced at its last health tick
    wait_until(lambda: row_of_status()["failed"] == s.failed, 10, what="the failure in /dplb/status")
    assert row_of_status()["last_exit_code"] is None                       # the engine never exited
    text = httpx.get(cluster4.base + "/metrics").text
    line = next(x for x in text.splitlines()
                if x.startswith("dplb_worker_requests_failed_total{") and f'worker="{w}"' in x)
    assert float(line.rsplit(" ", 1)[1]) == s.failed >= 1
    assert "at the worker's agent" not in text


def test_client_disconnect_closes_upstream_and_releases(cluster4):
    reset(cluster4)
    wid, chunks = _stream(cluster4.base, {"x-fake-mode": "stream", "x-fake-chunks": "50", "x-fake-delay": "0.1"},
                          n_read=2)
    assert len(chunks) == 2
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="release after disconnect")
    fake = cluster4.fakes[int(wid)].client()
    wait_until(lambda: fake.stats()["active"] == 0, 10, what="upstream request closed")
    assert fake.stats()["completed"] == 0      # the worker did not stream all 50 chunks


def test_client_disconnect_while_waiting_for_head_closes_upstream(cluster4):
    reset(cluster4)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(cluster4.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                   headers={"x-fake-mode": "hang"}, timeout=1.0)
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="release after disconnect")
    wait_until(lambda: sum(f.client().stats()["active"] for f in cluster4.fakes) == 0, 10,
               what="hanging upstream request closed")


def test_clients_that_close_after_each_answer_get_it_counted_as_served_not_as_gone(cluster4):
    """A whole answer leaves from the engine connection's callback, before the request's task
    wakes; a client that closes its connection right after it (``Connection: close``, HTTP/1.0)
    must not turn the task's bookkeeping into a client disconnect."""
    reset(cluster4)
    before = httpx.get(cluster4.base + "/metrics").text
    for version in (b"1.1", b"1.0"):
        for _ in range(5):
            body = b'{"model":"fake-model","messages":[{"role":"user","content":"hi"}]}'
            raw = _raw(cluster4.base, b"POST /v1/chat/completions HTTP/" + version + b"\r\nhost: x\r\n"
                       b"connection: close\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                       % (len(body), body))
            head, _, answer = raw.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower(), head
            assert b"chat.completion" in answer
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="release")

    def served(text: str) -> float:
        return sum(metric(text, "dplb_router_requests_total", worker=str(w), status="200") or 0 for w in range(4))

    wait_until(lambda: served(httpx.get(cluster4.base + "/metrics").text) - served(before) == 10, 10,
               what="10 answers counted")
    after = httpx.get(cluster4.base + "/metrics").text
    for w in range(4):
        assert (metric(after, "dplb_router_request_errors_total", worker=str(w), kind="client_disconnect") or 0) == \
            (metric(before, "dplb_router_request_errors_total", worker=str(w), kind="client_disconnect") or 0)


def test_a_pipelining_client_keeps_its_prefix_affinity(cluster4):
    """Each pipelined request is decided after the one before it gave its load back: a client
    pipelining the same long conversation stays on the worker that holds its prefix."""
    import socket
    from urllib.parse import urlsplit

    reset(cluster4)
    body = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "the same long prompt " * 1000}]})
    one = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(body), body))
    u = urlsplit(cluster4.base)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(one * 8)
        raw = b""
        while raw.count(b"HTTP/1.1 200") < 8 or not raw.endswith(b"}"):
            chunk = s.recv(65536)
            assert chunk, raw[-500:]
            raw += chunk
    workers = [line.split(b":", 1)[1].strip() for line in raw.split(b"\r\n")
               if line.lower().startswith(b"x-dplb-worker-id:")]
    assert len(workers) == 8 and len(set(workers)) == 1, workers


def _raw(base: str, request: bytes) -> bytes:
    """Send ``request`` on a fresh connection to the router and read until it closes."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(base)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _post_raw(base: str, target: bytes, headers: bytes, body: bytes) -> bytes:
    """:func:`_raw` of a JSON POST to ``target`` with ``headers`` (CRLF-terminated lines) and a
    Content-Length."""
    return _raw(base, b"POST " + target + b" HTTP/1.1\r\nhost: x\r\n" + headers + b"content-type: application/json"
                b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def test_an_encoded_line_break_in_the_path_reaches_the_engine_still_encoded(cluster4):
    """The engine gets the request target as the client sent it: a ``%0d%0a`` in the path does not
    become a line break of the engine's request (a header, or a whole request, of the client's
    choosing); found by a helper asked to break the router."""
    reset(cluster4)
    body = orjson.dumps({"model": MODEL, "prompt": "hi"})
    out = _post_raw(cluster4.base, b"/v1/completions%0d%0aX-Evil:%20injected?a=1", b"connection: close\r\n", body)
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
    seen = orjson.loads(out.partition(b"\r\n\r\n")[2])["fake"]
    assert "x-evil" not in seen["headers"]
    assert seen["path"] == "/v1/completions\r\nX-Evil: injected"     # aiohttp decodes it: one path


def test_a_chunked_body_over_the_limit_is_413_even_when_it_arrives_whole(make_cluster):
    """The limit holds for a body without a Content-Length that came in one read (the request's
    first ``receive()`` has all of it); found by a helper asked to break the router."""
    c = make_cluster(1, {"router": {"max_body_bytes": 2048}})
    body = orjson.dumps({"model": MODEL, "prompt": "x" * 3000})
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    out = _raw(c.base, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                       b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n" + chunked)
    assert out.startswith(b"HTTP/1.1 413"), out[:300]
    assert c.fakes[0].client().stats()["requests"] == 0


def test_a_request_asking_to_upgrade_the_connection_is_answered_and_the_connection_closed(cluster4):
    """The router upgrades nothing: a POST with ``Connection: upgrade`` (whose body HTTP's parser
    hands to the other protocol) gets an OpenAI-shaped 400 saying so, a GET is answered as usual
    (``curl --http2`` on http:// asks for h2c), and either connection then closes instead of
    waiting for more (the client's socket would hang on a WebSocket handshake or a paused parser)."""
    reset(cluster4)
    body = orjson.dumps({"model": MODEL, "prompt": "hi"})
    out = _post_raw(cluster4.base, b"/v1/completions", b"connection: Upgrade\r\nupgrade: websocket\r\n", body)
    assert out.startswith(b"HTTP/1.1 400"), out[:300]
    err = orjson.loads(out.partition(b"\r\n\r\n")[2])["error"]
    assert "does not upgrade connections (Upgrade: websocket)" in err["message"]
    out = _raw(cluster4.base, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings\r\n"
                              b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200"), out[:300]
    assert sum(f.client().stats()["requests"] for f in cluster4.fakes) == 0


# ------------------------------------------------------------------------------------ faults


def test_worker_dropping_the_connection_is_502_naming_it_when_the_operator_turns_retries_off(make_cluster):
    """With ``retries.retry_on_disconnect: false``, a connection dropped after the request was sent
    is answered 502, OpenAI-shaped, with the worker's id, and not run again elsewhere."""
    c = make_cluster(2, {"routing_policy": {"policy": "round_robin"}, "retries": {"retry_on_disconnect": False}})
    bad = c.fakes[1].client()
    bad.set_mode("drop")
    codes = []
    for _ in range(8):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=30)
        codes.append(r.status_code)
        if r.status_code != 200:
            assert r.status_code == 502 and r.headers["x-dplb-worker-id"] == "1"
            assert r.json()["error"]["type"] == "upstream_error"
    assert codes.count(502) == bad.stats()["requests"] >= 1
    assert sum(f.client().stats()["requests"] for f in c.fakes) == 8    # each request ran once


def test_a_status_that_is_not_an_http_status_is_a_502_and_the_connection_stays_usable(cluster4):
    """A made-up status (600+) is no answer: uvicorn cannot write a status line above 599 (it
    dropped the connection with no answer)."""
    reset(cluster4)
    with httpx.Client(base_url=cluster4.base, timeout=30) as hc:
        r = hc.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG}, headers={"x-fake-mode": "600"})
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        assert "HTTP status 600" in r.json()["error"]["message"]
        assert r.headers["x-dplb-worker-id"] in {"0", "1", "2", "3"}
        assert hc.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG}).status_code == 200
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="in-flight back to 0")


def test_an_interim_answer_is_skipped_and_the_final_one_relayed(cluster4):
    """An engine's 103 Early Hints (or a 100 Continue) is not its answer: the router waits for
    the final one on the same connection and relays that, streamed or not, without the hints."""
    reset(cluster4)
    with httpx.Client(base_url=cluster4.base, timeout=30) as hc:
        for _ in range(3):
            r = hc.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                        headers={"x-fake-mode": "103"})
            assert r.status_code == 200 and r.json()["object"] == "chat.completion" and "link" not in r.headers
        with hc.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "stream": True},
                       headers={"x-fake-mode": "103"}) as r:
            assert r.status_code == 200 and "data: [DONE]" in r.read().decode()
    wait_until(lambda: cluster4.router_inflight() == [0, 0, 0, 0], 10, what="in-flight back to 0")


def test_worker_dropping_the_connection_is_retried_elsewhere_by_default(make_cluster):
    """The client had no byte of its answer yet: another worker serves it (issue 27, item 1)."""
    c = make_cluster(2, {"routing_policy": {"policy": "round_robin"}})
    bad = c.fakes[1].client()
    bad.set_mode("drop")
    served = Counter()
    for _ in range(12):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=30)
        assert r.status_code == 200
        served[r.headers["x-dplb-worker-id"]] += 1
    assert served["1"] == 0
    assert bad.stats()["requests"] > 0          # it was tried, failed before the first byte, retried
    assert 'dplb_router_retries_total{reason="connect"}' in httpx.get(c.base + "/metrics").text


def test_an_engine_that_answers_499_to_a_connected_client_is_retried_elsewhere(make_cluster):
    """An engine's 499 ("client closed request") to a client still connected means it dropped
    the request (a sim engine did so while shutting down, CI of stop 42): never relayed, the
    request goes to another worker; with no attempt left it is a 502, OpenAI-shaped."""
    c = make_cluster(2, {"routing_policy": {"policy": "round_robin"}})
    bad = c.fakes[1].client()
    bad.set_mode("499")
    served = Counter()
    for _ in range(8):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=30)
        assert r.status_code == 200, r.text
        served[r.headers["x-dplb-worker-id"]] += 1
    assert served["1"] == 0 and bad.stats()["requests"] >= 1
    text = httpx.get(c.base + "/metrics").text
    assert metric(text, "dplb_router_retries_total", reason="engine_abort") == bad.stats()["requests"]
    assert metric(text, "dplb_router_request_errors_total", worker="1", kind="engine_abort") == bad.stats()["requests"]
    assert not metric(text, "dplb_router_requests_total", status="499")    # nobody left

    one = make_cluster(1, {"retries": {"max_attempts": 1}})
    one.fakes[0].client().set_mode("499")
    r = httpx.post(one.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG}, timeout=30)
    assert r.status_code == 502 and r.headers["x-dplb-worker-id"] == "0", (r.status_code, r.text)
    assert r.json()["error"]["type"] == "upstream_error" and "499" in r.json()["error"]["message"]


def test_breaker_ignores_4xx_and_opens_on_5xx(make_cluster):
    c = make_cluster(2, {"circuit_breaker": {"open_time_s": 30}, "retries": {"max_attempts": 1}})
    for code in ("400", "429"):
        for _ in range(25):
            r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                           headers={"x-fake-mode": code})
            assert r.status_code == int(code)
            assert r.json()["error"]["message"] == f"fake {code}"
    assert [w["circuit"] for w in status(c.base)["workers"]] == ["closed", "closed"]

    def errors_5xx() -> float:
        text = httpx.get(c.base + "/metrics").text
        return sum(metric(text, "dplb_router_request_errors_total", worker=str(w), kind="status_5xx") or 0
                   for w in (0, 1))

    assert errors_5xx() == 0                    # a 4xx is the client's error, not the worker's
    relayed = 0
    for _ in range(60):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                       headers={"x-fake-mode": "500"})
        assert r.status_code in (500, 503)
        relayed += r.status_code == 500
    # every engine 500 relayed is counted as the worker's error (a whole answer can leave before its
    # task counts it, hence the wait)
    assert relayed > 0
    wait_until(lambda: errors_5xx() == relayed, 10, what=f"{relayed} status_5xx errors counted")
    ws = status(c.base)["workers"]
    assert [w["circuit"] for w in ws] == ["open", "open"]
    assert [c.seg.read_slot(i).circuit for i in (0, 1)] == [1, 1]       # shared through the segment
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 503 and "retry-after" in r.headers


@pytest.mark.parametrize("method,path,body,code", [
    ("POST", "/v1/chat/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b"[]", 400),
    ("POST", "/v1/chat/completions", b"", 400),
    ("POST", "/v1/chat/completions", b'{"model": "fake-model"}', 400),
    ("POST", "/v1/chat/completions", b'{"model": 5, "messages": []}', 400),
    ("POST", "/v1/chat/completions", b'{"model": "fake-model", "stream": 1, "messages": [{"role":"user","content":"x"}]}', 400),
    ("POST", "/v1/chat/completions", b'{"model": "gpt-nonexistent", "messages": [{"role":"user","content":"x"}]}', 404),
    ("POST", "/v1/completions", b'{"model": "fake-model"}', 400),
    ("POST", "/v1/completions", b'\xff\xfe', 400),
    ("POST", "/generate", b'{"nothing": 1}', 400),
    ("POST", "/v1/chat/completions", b'{"messages": [{"role":"user","content":"' + b"x" * 70000 + b'"}]}', 413),
    ("POST", "/dplb/route", b"{oops", 400),
    ("GET", "/v1/nowhere", b"", 404),
    ("GET", "/v1/chat/completions", b"", 405),
    ("PUT", "/generate", b"{}", 405),
    ("DELETE", "/dplb/workers/notanumber", b"", 400),
    ("DELETE", "/dplb/workers/12", b"", 404),
])
def test_malformed_inputs_get_openai_shaped_4xx(cluster4, method, path, body, code):
    r = httpx.request(method, cluster4.base + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == code, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code and err["message"]


def test_a_get_on_a_post_path_names_the_method_it_takes(cluster4):
    r = httpx.get(cluster4.base + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.headers["x-dplb-worker-id"] == "none"
    assert int(r.headers["content-length"]) == len(r.content)
    assert r.json()["error"]["message"] == "method GET not allowed on /v1/completions; use POST"


def test_no_worker_gives_503_with_retry_after(make_cluster):
    c = make_cluster(0)
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(c.base + "/health").status_code == 503


# ----------------------------------------------------------------------------------- health


def test_failed_probes_take_a_worker_out_and_it_comes_back(make_cluster):
    c = make_cluster(2)
    bad = c.fakes[0].client()
    bad.set_mode("unhealthy")
    wait_until(lambda: [w["eligible"] for w in status(c.base)["workers"]] == [False, True], 20,
               what="worker 0 out after 3 failed probes")
    assert status(c.base)["workers"][0]["routing"] == "unhealthy"
    for _ in range(10):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
        assert r.headers["x-dplb-worker-id"] == "1"
    bad.set_mode("ok")
    wait_until(lambda: all(w["eligible"] for w in status(c.base)["workers"]), 20, what="worker 0 back")


def test_stale_heartbeat_and_not_ready_workers_get_nothing(make_cluster):
    c = make_cluster(3, None, [[], ["--no-heartbeat"], []], ready=2)
    wait_until(lambda: [w["eligible"] for w in status(c.base)["workers"]] == [True, False, True], 20,
               what="stale worker 1 out")
    c.fakes[2].client().set_mode(state=1)   # STARTING
    wait_until(lambda: [w["eligible"] for w in status(c.base)["workers"]] == [True, False, False], 20,
               what="worker 2 not ready")
    for _ in range(8):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
        assert r.headers["x-dplb-worker-id"] == "0"


def test_control_answers_carry_worker_header(cluster4):
    for path in ("/health", "/metrics", "/dplb/status", "/v1/models"):
        r = httpx.get(cluster4.base + path)
        assert r.status_code == 200 and r.headers["x-dplb-worker-id"] == "none", path


@pytest.mark.parametrize("policy", ["round_robin", "random", "shortest_queue", "power_of_two", "cache_aware"])
def test_every_baseline_policy_serves_through_the_router(make_cluster, policy):
    c = make_cluster(2, None, None, ("--policy", policy))
    assert status(c.base)["policy"] == policy
    served = Counter()
    for i in range(10):
        r = httpx.post(c.base + "/v1/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}]})
        assert r.status_code == 200
        served[r.headers["x-dplb-worker-id"]] += 1
    d = httpx.post(c.base + "/dplb/route", json={"model": MODEL, "messages": MSG}).json()
    assert d["policy"] == policy and {s["worker_id"] for s in d["scores"]} == {0, 1}
    if policy == "round_robin":
        assert served == Counter({"0": 5, "1": 5})
    text = httpx.get(c.base + "/metrics").text
    assert f'dplb_router_routing_decisions_total{{policy="{policy}"' in text


def test_burst_sharing_a_long_system_prompt_does_not_pile_onto_its_worker(cluster4):
    reset(cluster4)
    system = "You are the support assistant of a large online shop; follow the policy below. " * 25
    for f in cluster4.fakes:
        f.client().set_mode("slow", delay=0.3)

    def body(i: int) -> dict:
        return {"model": MODEL, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": f"customer question {i}"}]}

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster4.base, timeout=60,
                                     limits=httpx.Limits(max_connections=100)) as ac:
            first = await ac.post("/v1/chat/completions", json=body(-1))   # the prefix now lives on one worker
            assert first.status_code == 200
            rs = await asyncio.gather(*(ac.post("/v1/chat/completions", json=body(i)) for i in range(100)))
        assert all(r.status_code == 200 for r in rs)
        return [r.headers["x-dplb-worker-id"] for r in rs]

    try:
        share = Counter(asyncio.run(burst()))
    finally:
        reset(cluster4)
    assert set(share) == {"0", "1", "2", "3"} and max(share.values()) <= 35, share
    text = httpx.get(cluster4.base + "/metrics").text
    assert 'reason="prefix"' in text  # the holder still took its share because of the prefix


def test_open_circuit_half_opens_and_closes_on_a_successful_probe(make_cluster):
    # open 4 s: a busy machine's stall between the 20th 500 and the next request must not turn that
    # request into the half-open probe
    c = make_cluster(1, {"circuit_breaker": {"open_time_s": 4.0}, "retries": {"max_attempts": 1}})
    for _ in range(20):
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                       headers={"x-fake-mode": "500"})
        assert r.status_code == 500
    assert status(c.base)["workers"][0]["circuit"] == "open"
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 503 and r.headers["retry-after"]
    time.sleep(4.2)
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 200                     # the half-open probe
    w = status(c.base)["workers"][0]
    assert w["circuit"] == "closed" and w["failure_rate"] == 0.0
    assert c.seg.read_slot(0).circuit == 0
