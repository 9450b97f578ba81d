"""One ext_proc stream driven message by message against a real segment (no Envoy): what the
picker answers, and that the lease is released exactly once whichever way the stream ends."""
from __future__ import annotations

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoy import HEADER
from epp.server import CHUNK, Exchange, Picker
from router.config import Config
from tests.helpers import metric

BODY = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi there"}]})
CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


def headers(eos: bool = False, duplex: bool = False, **hs: str) -> pb.ProcessingRequest:
    h = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k.replace("_", "-"), raw_value=v.encode())
                                    for k, v in hs.items()])
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=h, end_of_stream=eos))
    if duplex:
        req.protocol_config.request_body_mode = 4
    return req


def resp_headers(status: int = 200, ctype: str = "text/event-stream") -> pb.ProcessingRequest:
    h = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
                                    base_pb2.HeaderValue(key="content-type", raw_value=ctype.encode())])
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=h))


def body(data: bytes, eos: bool, response: bool = False) -> pb.ProcessingRequest:
    b = pb.HttpBody(body=data, end_of_stream=eos)
    return pb.ProcessingRequest(response_body=b) if response else pb.ProcessingRequest(request_body=b)


@pytest.fixture
async def picker(segment, tmp_path):
    w = segment.writer(0)
    w.claim(worker_id=0, pid=1, endpoint="127.0.0.1:9", model="m")
    w.publish(state=2)
    w.heartbeat()
    cfg = Config.model_validate({"health_check": {"enabled": False}, "router": {"state_dir": str(tmp_path / "st")},
                                 "routing_policy": {"policy": "round_robin"}})
    p = Picker(cfg, segment)
    await p.start()
    try:
        yield p
    finally:
        await p.stop()
        w.release()


def start(p: Picker) -> Exchange:
    ex = Exchange(p, 2)
    [r] = ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    assert r.WhichOneof("response") == "request_headers"
    [r] = ex.on_message(body(BODY, True))
    hs = {h.header.key: h.header.raw_value for h in r.request_body.response.header_mutation.set_headers}
    assert hs == {HEADER: b"127.0.0.1:9"}
    assert r.dynamic_metadata["envoy.lb"][HEADER] == "127.0.0.1:9"
    assert p.state.seg.router_line(0)["router_inflight"] == 1
    [r] = ex.on_message(resp_headers())
    assert [(h.header.key, h.header.raw_value) for h in r.response_headers.response.header_mutation.set_headers] \
        == [("x-dplb-worker-id", b"0")]
    ex.on_message(body(CONTENT, False, response=True))
    assert p.state.seg.router_line(0)["decode_reqs"] == 1     # the first content ended the prefill
    return ex


def requests(p: Picker, status: str) -> float:
    return metric(p.state.metrics.render()[0].decode(), "dplb_router_requests_total", worker="0", status=status) or 0


async def test_stream_end_releases_once(picker):
    ex = start(picker)
    ex.on_message(body(CONTENT + b"data: [DONE]\n\n", True, response=True))
    ex.close()                       # the gRPC stream's end after the response's: nothing more
    line = picker.state.seg.router_line(0)
    assert (line["router_inflight"], line["decode_reqs"], line["prefill_tokens"]) == (0, 0, 0)
    assert line["router_tpot_s"] > 0 and requests(picker, "200") == 1


async def test_stream_cut_after_done_is_complete(picker):
    # the openai client closes its connection at [DONE], before the engine's last chunk: Envoy
    # resets the ext_proc stream, which must still count the request as answered (200, TPOT)
    ex = start(picker)
    ex.on_message(body(CONTENT + b"data: [DONE]\n\n", False, response=True))
    ex.close()
    line = picker.state.seg.router_line(0)
    assert line["router_inflight"] == 0 and line["router_tpot_s"] > 0
    assert requests(picker, "200") == 1 and requests(picker, "499") == 0


async def test_stream_cut_midway_is_499_and_released(picker):
    ex = start(picker)
    ex.close()
    ex.close()                       # exactly once
    line = picker.state.seg.router_line(0)
    assert (line["router_inflight"], line["decode_reqs"]) == (0, 0)
    assert requests(picker, "499") == 1 and line["router_tpot_s"] == 0


async def test_full_duplex_body_is_sent_back_in_chunks(picker):
    ex = Exchange(picker, 2)
    assert ex.on_message(headers(duplex=True, **{":path": "/v1/completions"})) == []
    big = orjson.dumps({"model": "m", "prompt": "x " * 100_000})
    parts = [big[i:i + 50_000] for i in range(0, len(big), 50_000)]
    out = []
    for i, part in enumerate(parts):
        out += ex.on_message(body(part, i == len(parts) - 1))
    assert out[0].WhichOneof("response") == "request_headers"
    assert out[0].request_headers.response.header_mutation.set_headers[0].header.key == HEADER
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert all(len(c.body) <= CHUNK for c in chunks) and len(chunks) == -(-len(big) // CHUNK)
    assert b"".join(c.body for c in chunks) == big
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    ex.close()
    assert picker.state.seg.router_line(0)["router_inflight"] == 0


async def test_a_body_above_the_limit_is_413(picker):
    picker.state.cfg.router.max_body_bytes = 100_000
    ex = Exchange(picker, 2)
    ex.on_message(headers(duplex=True, **{":path": "/v1/completions"}))
    assert ex.on_message(body(b"x" * 60_000, False)) == []
    [r] = ex.on_message(body(b"x" * 60_000, False))
    assert r.immediate_response.status.code == 413 and not ex.body
    ex.close()
    assert picker.state.seg.router_line(0)["router_inflight"] == 0


async def test_errors_are_immediate(picker):
    ex = Exchange(picker, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions"}))
    [r] = ex.on_message(body(orjson.dumps({"model": "other", "messages": [{"role": "user", "content": "a"}]}), True))
    assert r.immediate_response.status.code == 404
    ex = Exchange(picker, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions"}))
    [r] = ex.on_message(body(b"[1]", True))
    assert r.immediate_response.status.code == 400
    ex = Exchange(picker, 2)
    [r] = ex.on_message(headers(eos=True, **{":path": "/v1/chat/completions", ":method": "POST"}))
    assert r.immediate_response.status.code == 400 and b"empty" in r.immediate_response.body
    ex = Exchange(picker, 2)
    [r] = ex.on_message(headers(eos=True, **{":path": "/v1/models", ":method": "GET"}))
    assert r.request_headers.response.header_mutation.set_headers[0].header.raw_value == b"127.0.0.1:9"
    picker.state.registry.drained = {0}
    picker.state.registry.handles[0].drained = True
    ex = Exchange(picker, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions"}))
    [r] = ex.on_message(body(BODY, True))
    assert r.immediate_response.status.code == 503
    assert picker.state.seg.router_line(0)["router_inflight"] == 0
