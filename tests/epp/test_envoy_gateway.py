"""Requests through a real Envoy whose endpoint picker is ``dplb-epp`` (issue 30): the OpenAI SDK
(chat, completions, a stream relayed chunk by chunk), DPLB's round_robin spreading the requests
over the engines (not Envoy's balancing: the ORIGINAL_DST cluster goes where the picker says), the
accounting back to zero, a client that leaves mid-stream, and the picker's own answers (400, 404,
503) as immediate OpenAI-shaped errors. The stack is the module's (tests/epp/conftest.py)."""
from __future__ import annotations

import time

import grpc
import httpx
import openai
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from launcher.stack import wait_for
from tests.helpers import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello there"}]}


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=30, max_retries=0)


def wid(headers: httpx.Headers) -> str:
    return headers["x-dplb-worker-id"]


def test_chat_and_completions_spread_by_round_robin(gateway):
    c = sdk(gateway.envoy)
    seen = []
    for i in range(6):
        if i % 2:
            raw = c.completions.with_raw_response.create(model="fake-model", prompt="once upon a time", max_tokens=4)
            assert raw.parse().choices[0].text
        else:
            raw = c.chat.completions.with_raw_response.create(**CHAT)
            assert raw.parse().choices[0].message.content.startswith("hello from fake worker")
        seen.append(wid(raw.headers))
    # round_robin over the three engines: every one of them, in a fixed cycle, whatever Envoy does
    assert len(set(seen)) == 3, seen
    assert seen[3:] == seen[:3], seen
    wait_for(gateway.idle, 10, "router lines back to zero")
    # each engine got two requests; the picker's dispatch counts agree
    slots = gateway.slots()
    for f in gateway.fakes:
        assert f.client().stats()["requests"] >= 2
        assert gateway.seg.router_line(slots[f.endpoint].worker_id)["dispatched"] >= 2
    # Envoy saw the pick in the envoy.lb dynamic metadata as well as in the header
    lines = wait_for(lambda: [ln.split() for ln in gateway.access_log.read_text().splitlines()
                              if ln.startswith("200 ")], 10, "access log lines")
    assert all(ln[1] == ln[3] for ln in lines), lines   # metadata's endpoint == the upstream Envoy connected to


def test_a_body_sent_without_waiting_for_the_heads_answer_is_picked_whole(gateway):
    """The eager gateway (``STREAMED`` request body, Envoy's ``send_body_without_waiting_for_header_response``:
    two exchanges with the picker per tiny request instead of four): the head is answered with the
    pick at the body's end, a body of many chunks reaches the engine whole (chunked: Envoy drops
    its length), answers and streams come back, the accounting returns to zero."""
    c = sdk(gateway.early)
    seen = {wid(c.chat.completions.with_raw_response.create(**CHAT).headers) for _ in range(3)}
    assert len(seen) == 3, seen   # round_robin: the picker chose, not Envoy
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 60_000}]}   # 300 KB: many chunks
    r = httpx.post(gateway.early + "/v1/chat/completions", json=long, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.content[:300]
    text = [ch.choices[0].delta.content for ch in c.chat.completions.create(
        **CHAT, stream=True, extra_headers={"x-fake-mode": "stream", "x-fake-chunks": "3"})
        if ch.choices and ch.choices[0].delta.content]
    assert text == [f"t{i} " for i in range(3)]
    assert c.completions.create(model="fake-model", prompt="once", max_tokens=2).choices[0].text
    wait_for(gateway.idle, 10, "router lines back to zero")


def test_stream_is_relayed_chunk_by_chunk_and_accounted(gateway):
    c = sdk(gateway.envoy)
    arrivals = []
    text = []
    with c.chat.completions.with_streaming_response.create(
            **CHAT, stream=True, extra_headers={"x-fake-mode": "stream", "x-fake-delay": "0.3",
                                                "x-fake-chunks": "5"}) as resp:
        w = wid(resp.headers)
        for chunk in resp.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                arrivals.append(time.monotonic())
                text.append(chunk.choices[0].delta.content)
    assert text == [f"t{i} " for i in range(5)]
    # relayed as the engine wrote it: the first token reached the client ~1.2 s before the last
    # (4 gaps of 0.3 s), not all at the end (a buffered answer's chunks arrive together)
    assert arrivals[-1] - arrivals[0] >= 0.6, arrivals
    wait_for(gateway.idle, 10, "router lines back to zero")
    # the lease saw the first content and the end: the TTFT and TPOT were learned on that worker
    line = gateway.seg.router_line(int(w))
    assert line["router_ttft_s"] > 0 and line["router_tpot_s"] > 0, line


def test_client_leaving_mid_stream_releases_the_lease_and_aborts_the_engine(gateway):
    f = gateway.fakes[0]
    fc = f.client()
    before = fc.stats()["disconnects"]
    wid_of = {s.endpoint: s.worker_id for s in gateway.slots().values()}[f.endpoint]
    # round_robin: send until this fake takes one (one cycle, unless a probe took a worker out meanwhile)
    took = []
    for _ in range(9):
        with httpx.Client(timeout=30) as h, h.stream(
                "POST", gateway.envoy + "/v1/chat/completions",
                headers={"x-fake-mode": "stream", "x-fake-delay": "0.5", "x-fake-chunks": "40"},
                content=orjson.dumps({**CHAT, "stream": True})) as r:
            chunks = r.iter_raw()         # held: a dropped generator closes the connection at once
            first = next(chunks)          # the first chunk came
            assert r.status_code == 200, (r.status_code, first)
            took.append(wid(r.headers))
            if took[-1] != str(wid_of):
                continue
            assert gateway.seg.router_line(wid_of)["router_inflight"] == 1
        break                             # closed with 38 chunks to go
    assert took[-1] == str(wid_of), (took, gateway.log_tail())
    wait_for(lambda: gateway.seg.router_line(wid_of)["router_inflight"] == 0, 15, "lease released")
    wait_for(lambda: fc.stats()["disconnects"] > before, 15, "the engine saw the client leave")
    wait_for(gateway.idle, 10, "router lines back to zero")
    text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).text
    assert (metric(text, "dplb_router_requests_total", worker=str(wid_of), status="499") or 0) >= 1


def test_unknown_model_is_404_openai_shaped(gateway):
    with pytest.raises(openai.NotFoundError) as ei:
        sdk(gateway.envoy).chat.completions.create(**{**CHAT, "model": "no-such-model"})
    r = ei.value.response
    assert r.status_code == 404 and r.headers["x-dplb-worker-id"] == "none"
    err = r.json()["error"]
    assert err["code"] == 404 and err["type"] == "not_found_error" and err["param"] == "model"
    assert "no-such-model" in err["message"]


def test_malformed_body_is_400_openai_shaped(gateway):
    r = httpx.post(gateway.envoy + "/v1/chat/completions", content=b'{"model": "fake-model", "messages": [',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error" and "JSON" in err["message"]
    r = httpx.post(gateway.envoy + "/v1/chat/completions", json={"model": "fake-model", "messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_no_ready_endpoint_is_503_with_retry_after(gateway):
    # dead-model's only endpoint has nothing listening: its slot is known (so not a 404) but dead
    r = httpx.post(gateway.envoy + "/v1/chat/completions", json={**CHAT, "model": gateway.dead_model}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1" and r.headers["x-dplb-worker-id"] == "none"
    err = r.json()["error"]
    assert err["code"] == 503 and err["type"] == "service_unavailable"


def test_agent_slots_of_the_segment_are_routed_to(gateway):
    # a worker whose agent owns its slot (the node's segment, --shm): no endpoints-file entry needed
    raw = sdk(gateway.envoy).chat.completions.with_raw_response.create(**{**CHAT, "model": "agent-model"})
    assert wid(raw.headers) == "3" and "fake worker 3" in raw.parse().choices[0].message.content


def test_unix_socket_workers_are_left_out_with_a_clear_503(gateway):
    # Envoy's ORIGINAL_DST cluster connects to ip:port only
    r = httpx.post(gateway.envoy + "/v1/chat/completions", json={**CHAT, "model": "uds-model"}, timeout=30)
    assert r.status_code == 503 and "Unix socket" in r.json()["error"]["message"], r.text


def test_full_duplex_body_is_restreamed_whole(gateway):
    # FULL_DUPLEX_STREAMED: the picker buffers the body to its end, picks, and streams it back in
    # chunks of at most 62,000 bytes; the engine must get the very bytes the client sent
    words = " ".join(f"w{i}" for i in range(60_000))     # ~400 kB: seven chunks back
    body = {"model": "fake-model", "prompt": words, "max_tokens": 2}
    r = httpx.post(gateway.duplex + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["fake"]["body"] == body
    assert r.headers["x-dplb-worker-id"] != "none"
    wait_for(gateway.idle, 10, "router lines back to zero")
    c = sdk(gateway.duplex)
    raw = c.chat.completions.with_raw_response.create(**CHAT)
    assert raw.parse().choices[0].message.content.startswith("hello from fake worker")


def test_grpc_health_services(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for svc in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING, svc


def test_endpoints_file_changes_are_picked_up(gateway):
    # runs last: edits the module's endpoints file, then restores it
    eps = gateway.run_dir + "/endpoints.yaml"
    with open(eps) as fh:
        original = fh.read()
    dead = next(ln for ln in original.splitlines() if "dead-model" in ln)
    dead_addr = dead.split("'")[1]
    assert dead_addr in gateway.slots()
    try:
        with open(eps, "w") as fh:
            fh.write("\n".join(ln for ln in original.splitlines() if ln != dead) + "\n")
        wait_for(lambda: dead_addr not in gateway.slots(), 15, "the dropped endpoint's slot given back")
        assert dead_addr not in gateway.slots() and len(gateway.slots()) == 5
    finally:
        with open(eps, "w") as fh:
            fh.write(original)
    wait_for(lambda: dead_addr in gateway.slots(), 15, "the endpoint listed again has a slot")


def _raw_post(base: str, body: bytes) -> tuple[int, bytes, bytes]:
    """POST ``body`` on a raw connection, sending until the server stops reading (Envoy answers a
    body over its limit and closes while the client still sends); (status, head, body) of the answer."""
    import socket

    host, port = base.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(body))
        try:
            s.sendall(head)
            for i in range(0, len(body), 1 << 16):
                s.sendall(body[i:i + (1 << 16)])
        except OSError:
            pass   # the answer came first
        data = b""
        try:
            while b"\r\n\r\n" not in data or b"}}" not in data.split(b"\r\n\r\n", 1)[1]:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    head_b, _, rest = data.partition(b"\r\n\r\n")
    return int(head_b.split(b" ", 2)[1]), head_b.lower(), rest


def test_envoys_own_413_for_a_large_body_is_openai_shaped_not_plain_text(gateway):
    """Envoy's own replies (here: a body over its 16 MiB buffer) were its plain text ("Payload Too
    Large"); now they carry the OpenAI error shape, as the picker's own replies do (the other tests
    of this module check that those keep theirs)."""
    body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "' + b"x" * (17 << 20) + b'"}]}'
    status, head, rest = _raw_post(gateway.envoy, body)
    assert status == 413 and b"content-type: application/json" in head, (head, rest[:200])
    err = orjson.loads(rest[rest.index(b"{"):rest.rindex(b"}") + 1])["error"]
    assert err["code"] == 413 and err["type"] == "invalid_request_error" and "limit" in err["message"]


def test_an_engine_side_abort_mid_stream_ends_with_an_error_event_and_counts_502(gateway):
    """A stream the engine aborted (``finish_reason: "abort"``) after content went out was relayed
    whole and counted 200; now the picker adds an OpenAI-shaped SSE error event and counts it 502
    ``engine_abort``, as the HTTP router does."""
    def count(wid: str, name: str, **labels: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).text
        return metric(text, name, worker=wid, **labels) or 0.0

    for base in (gateway.envoy, gateway.duplex, gateway.early):
        r = httpx.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30,
                       headers={"x-fake-mode": "abort", "x-fake-chunks": "3"})
        events = [e for e in r.content.split(b"\n\n") if e.strip()]
        assert r.status_code == 200 and b'"finish_reason":"abort"' in r.content, r.content[:300]
        err = orjson.loads(next(e for e in events if b'"error"' in e)[len(b"data: "):])["error"]
        assert err["code"] == 502 and err["type"] == "upstream_error" and "abort" in err["message"]
        w = wid(r.headers)
        wait_for(lambda w=w: count(w, "dplb_router_requests_total", status="502") >= 1, 10, "the 502")
        assert count(w, "dplb_router_request_errors_total", kind="engine_abort") >= 1


def test_a_non_streamed_answer_the_engine_aborted_is_a_502_through_envoy_not_a_200(gateway):
    """A non-streamed answer the engine aborted (``finish_reason: "abort"``) was counted 502 by the
    picker while its 200 head had already left through Envoy: the client took a truncated answer
    as a success. Now the picker asks for the body whole at the head (a mode override to
    ``BUFFERED``; Envoy holds the head) and answers the abort 502 in the OpenAI shape, naming the
    worker. A stream aborted by its engine ends with the error event before the engine's
    ``data: [DONE]``, never after it."""
    from bench.faultsuite.scen_contained import stream_ending

    for base in (gateway.envoy, gateway.duplex, gateway.early):
        r = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=30, headers={"x-fake-mode": "abort"})
        assert r.status_code == 502, (base, r.status_code, r.content[:300])
        err = r.json()["error"]
        assert err["code"] == 502 and err["type"] == "upstream_error" and "abort" in err["message"], err
        assert wid(r.headers) not in ("", "none")
        ok = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=30)   # a whole answer still passes
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] != "abort", ok.content[:300]
        s = httpx.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30,
                       headers={"x-fake-mode": "abort", "x-fake-chunks": "1", "x-fake-delay": "0"})
        assert s.status_code == 200 and stream_ending(s.content) == "error_event", s.content[-400:]
