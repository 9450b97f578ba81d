"""One ext_proc stream driven message by message against a real segment (no Envoy): what the
picker answers, and that the lease is released exactly once whichever way the stream ends."""
from __future__ import annotations

import asyncio

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoy import HEADER, SERVED
from epp.picker import Picker
from epp.stream import ANSWER_KEEP, CHUNK, Exchange
from router.config import Config
from router.director import OpenAdmission
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


async def _judged(ex: Exchange) -> None:
    """Wait (bounded) for the probe of a cut stream to settle its lease."""
    for _ in range(500):
        if ex.lease is not None and ex.lease.judged:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the cut stream's lease was never settled")


async def test_stream_cut_midway_with_its_engine_alive_is_499_and_released(picker, monkeypatch):
    async def alive(endpoint: str, path: str, timeout: float, method: str = "GET") -> tuple[int, bytes]:
        return 200, b"ok"

    monkeypatch.setattr(picker.state.transport, "get", alive)
    ex = start(picker)
    ex.close()
    ex.close()                       # exactly once
    await _judged(ex)
    line = picker.state.seg.router_line(0)
    assert (line["router_inflight"], line["decode_reqs"]) == (0, 0)
    assert requests(picker, "499") == 1 and requests(picker, "502") == 0 and line["router_tpot_s"] == 0


async def test_stream_cut_midway_with_its_engine_gone_is_502_stream_broken(picker):
    ex = start(picker)               # its engine, 127.0.0.1:9, refuses connections
    ex.close()
    ex.close()
    await _judged(ex)
    line = picker.state.seg.router_line(0)
    assert (line["router_inflight"], line["decode_reqs"]) == (0, 0)
    assert requests(picker, "502") == 1 and requests(picker, "499") == 0
    errors = metric(picker.state.metrics.render()[0].decode(), "dplb_router_request_errors_total", worker="0",
                    kind="stream_broken")
    assert errors == 1


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


async def test_a_picker_with_only_unix_socket_workers_warns_at_start(segment, tmp_path, caplog):
    w = segment.writer(0)
    w.claim(worker_id=0, pid=1, endpoint="/tmp/dplb-engine-0.sock", model="m")
    w.publish(state=2)
    w.heartbeat()
    cfg = Config.model_validate({"health_check": {"enabled": False}, "router": {"state_dir": str(tmp_path / "st")}})
    p = Picker(cfg, segment)
    with caplog.at_level("WARNING", logger="dplb.epp"):
        await p.start()
    try:
        said = [r.getMessage() for r in caplog.records if "every worker" in r.getMessage()]
        assert len(said) == 1 and "--engine-host 127.0.0.1" in said[0], said
        assert not p.warn_unix_only()   # once
    finally:
        await p.stop()
        w.release()


async def test_no_unix_warning_with_a_tcp_worker(picker, caplog):
    with caplog.at_level("WARNING", logger="dplb.epp"):
        assert not picker.warn_unix_only()


@pytest.fixture
async def two(segment, tmp_path):
    """A picker over two TCP workers, with one fallback and an EDS file."""
    ws = []
    for i in range(2):
        w = segment.writer(i)
        w.claim(worker_id=i, pid=1, endpoint=f"127.0.0.1:{9 + i}", model="m")
        w.publish(state=2)
        w.heartbeat()
        ws.append(w)
    cfg = Config.model_validate({"health_check": {"enabled": False}, "router": {"state_dir": str(tmp_path / "st")},
                                 "routing_policy": {"policy": "round_robin"}})
    p = Picker(cfg, segment, fallbacks=1, eds_path=str(tmp_path / "eds" / "pool.json"))
    await p.start()
    try:
        yield p
    finally:
        await p.stop()
        for w in ws:
            w.release()


def served(req: pb.ProcessingRequest, endpoint: str) -> pb.ProcessingRequest:
    req.metadata_context.filter_metadata["envoy.lb"].update({SERVED: endpoint})
    return req


async def test_eds_file_lists_the_eligible_tcp_workers(two, tmp_path):
    doc = orjson.loads((tmp_path / "eds" / "pool.json").read_bytes())
    lb = doc["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert sorted(e["endpoint"]["address"]["socket_address"]["port_value"] for e in lb) == [9, 10]
    assert doc["resources"][0]["cluster_name"] == "dplb_pool"


async def test_fallback_that_served_takes_the_lease(two):
    seg = two.state.seg
    ex = Exchange(two, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    [r] = ex.on_message(body(BODY, True))
    value = {h.header.key: h.header.raw_value for h in r.request_body.response.header_mutation.set_headers}[HEADER]
    first, fallback = value.decode().split(",")
    picked, other = (0, 1) if first == "127.0.0.1:9" else (1, 0)
    assert fallback == f"127.0.0.1:{9 + other}"
    assert r.dynamic_metadata["envoy.lb"][HEADER] == value.decode()
    assert seg.router_line(picked)["router_inflight"] == 1
    # Envoy's first attempt failed; the fallback answered
    [r] = ex.on_message(served(resp_headers(), fallback))
    assert [h.header.raw_value for h in r.response_headers.response.header_mutation.set_headers] == [str(other).encode()]
    assert seg.router_line(picked)["router_inflight"] == 0 and seg.router_line(picked)["failed"] == 1
    assert seg.router_line(other)["router_inflight"] == 1
    assert not two.state.registry.handles[picked].probe_ok   # out at once, until a probe passes
    ex.on_message(body(CONTENT, False, response=True))
    ex.on_message(body(b"data: [DONE]\n\n", True, response=True))
    ex.close()
    assert seg.router_line(other)["router_inflight"] == 0 and seg.router_line(other)["completed"] == 1


async def test_served_by_the_pick_changes_nothing(two):
    ex = Exchange(two, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    [r] = ex.on_message(body(BODY, True))
    first = r.dynamic_metadata["envoy.lb"][HEADER].split(",")[0]
    lease = ex.lease
    ex.on_message(served(resp_headers(), first))
    assert ex.lease is lease and not lease.judged
    ex.close()


async def test_response_body_mode_none_settles_at_the_stream_end(picker):
    seg = picker.state.seg
    ex = Exchange(picker, 2, resp_mode=0)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    ex.on_message(body(BODY, True))
    ex.on_message(resp_headers())
    assert seg.router_line(0)["decode_reqs"] == 1 and seg.router_line(0)["prefill_tokens"] == 0
    ex.close()
    assert seg.router_line(0)["router_inflight"] == 0 and seg.router_line(0)["completed"] == 1


async def test_full_duplex_response_chunks_are_sent_back(picker):
    ex = Exchange(picker, 2, resp_mode=4)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    ex.on_message(body(BODY, True))
    ex.on_message(resp_headers())
    [r] = ex.on_message(body(CONTENT, False, response=True))
    sr = r.response_body.response.body_mutation.streamed_response
    assert sr.body == CONTENT and not sr.end_of_stream
    [r] = ex.on_message(body(b"data: [DONE]\n\n", True, response=True))
    assert r.response_body.response.body_mutation.streamed_response.end_of_stream
    assert picker.state.seg.router_line(0)["router_inflight"] == 0


class _Holding(OpenAdmission):
    """An admission that holds every request until ``go`` is set (router.director.Admission; the
    rest of the step as :class:`OpenAdmission`'s)."""

    __slots__ = ("go",)

    def __init__(self) -> None:
        self.go = asyncio.Event()

    def ready(self, info) -> bool:  # type: ignore[no-untyped-def]
        return self.go.is_set()

    async def wait(self, info) -> None:  # type: ignore[no-untyped-def]
        await self.go.wait()


async def test_a_request_admission_holds_back_waits_with_its_stream_then_goes(picker):
    # the picker's admission step is request control's (router.director): while it holds the
    # request, the ext_proc stream gets no answer but the hold and no lease is taken
    adm = _Holding()
    picker.director.admission = adm
    ex = Exchange(picker, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions"}))
    # the only answer asks Envoy to wait up to the longest queue budget (30 s) + 5 s for the next
    [hold] = ex.on_message(body(BODY, True))
    assert ex.waiting is not None and not hold.HasField("request_body") and not hold.HasField("immediate_response")
    assert hold.override_message_timeout.ToMilliseconds() == 35_000
    assert picker.state.seg.router_line(0)["router_inflight"] == 0
    task = asyncio.ensure_future(ex.admit())
    await asyncio.sleep(0.01)
    assert not task.done()
    adm.go.set()
    [r] = await asyncio.wait_for(task, 10)
    assert r.request_body.response.header_mutation.set_headers[0].header.key == HEADER
    assert picker.state.seg.router_line(0)["router_inflight"] == 1 and ex.waiting is None
    ex.close()
    assert picker.state.seg.router_line(0)["router_inflight"] == 0


async def test_a_non_streamed_answer_is_asked_for_whole_and_a_stream_chunk_by_chunk(picker):
    # the head of a JSON answer overrides the response body mode to one message (no empty end of
    # stream after its chunk, the head held until the body is known); an event stream keeps every chunk
    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ex = Exchange(picker, 2)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    ex.on_message(body(plain, True))
    [r] = ex.on_message(resp_headers(ctype="application/json"))
    assert r.HasField("mode_override") and r.mode_override.response_body_mode == 3   # BUFFERED_PARTIAL
    answer = b'{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"completion_tokens":1}}'
    [r] = ex.on_message(body(answer, True, response=True))
    assert r.WhichOneof("response") == "response_body"
    assert picker.state.seg.router_line(0)["router_inflight"] == 0   # settled at the answer's end
    assert requests(picker, "200") == 1
    ex.close()
    streamed = start(picker)   # an event stream: no override (every chunk is seen: TTFT, tokens, aborts)
    streamed.close()
    ex2 = Exchange(picker, 2)
    ex2.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    ex2.on_message(body(BODY, True))
    [r] = ex2.on_message(resp_headers())
    assert not r.HasField("mode_override")
    ex2.close()


def eager_headers(**hs: str) -> pb.ProcessingRequest:
    """Request headers from an Envoy that sends a STREAMED body without waiting for their answer."""
    req = headers(**hs)
    req.protocol_config.request_body_mode = 1
    req.protocol_config.response_body_mode = 1
    req.protocol_config.send_body_without_waiting_for_header_response = True
    return req


async def test_an_eager_body_is_answered_after_the_head_with_the_pick(picker):
    # Envoy sends the body's chunks without waiting: nothing is answered before the body's end,
    # then the head's answer (the pick) and one answer per chunk, in order
    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ex = Exchange(picker, 2)
    assert ex.on_message(eager_headers(**{":path": "/v1/chat/completions"})) == []
    assert ex.on_message(body(plain[:10], False)) == []
    assert ex.on_message(body(plain[10:], False)) == []
    assert picker.state.seg.router_line(0)["router_inflight"] == 0   # not picked before the end
    out = ex.on_message(body(b"", True))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_body", "request_body"]
    head = out[0].request_headers.response
    assert head.clear_route_cache and head.header_mutation.set_headers[0].header.key == HEADER
    assert out[0].dynamic_metadata["envoy.lb"][HEADER] == "127.0.0.1:9"
    assert picker.state.seg.router_line(0)["router_inflight"] == 1
    # a non-streamed answer: its head is held until the body's end, then answered with its chunks
    assert ex.on_message(resp_headers(ctype="application/json")) == []
    answer = b'{"choices":[{"message":{"content":"x"},"finish_reason":"stop"}],"usage":{"completion_tokens":1}}'
    assert ex.on_message(body(answer, False, response=True)) == []
    assert not ex.done
    out = ex.on_message(body(b"", True, response=True))
    assert [r.WhichOneof("response") for r in out] == ["response_headers", "response_body", "response_body"]
    assert out[0].response_headers.response.header_mutation.set_headers[0].header.raw_value == b"0"
    assert not out[0].HasField("mode_override")   # no extra exchange: the body came with the head
    assert ex.done and picker.state.seg.router_line(0)["router_inflight"] == 0
    assert requests(picker, "200") == 1
    ex.close()
    assert requests(picker, "200") == 1


async def test_an_eager_non_streamed_answer_its_engine_aborted_is_a_502_before_its_head_leaves(picker):
    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ex = Exchange(picker, 1, eager=True)
    ex.on_message(eager_headers(**{":path": "/v1/chat/completions"}))
    ex.on_message(body(plain, True))
    assert ex.on_message(resp_headers(ctype="application/json")) == []
    aborted = b'{"choices":[{"message":{"content":"x"},"finish_reason":"abort"}]}'
    assert ex.on_message(body(aborted, False, response=True)) == []
    [r] = ex.on_message(body(b"", True, response=True))
    assert r.immediate_response.status.code == 502 and b"abort" in r.immediate_response.body
    assert ex.done and requests(picker, "502") == 1
    ex.close()


async def test_an_eager_stream_head_goes_at_once_and_a_long_answer_stops_being_held(picker):
    ex = Exchange(picker, 1, eager=True)
    ex.on_message(eager_headers(**{":path": "/v1/chat/completions"}))
    ex.on_message(body(BODY, True))   # "stream": true
    [r] = ex.on_message(resp_headers())
    assert r.WhichOneof("response") == "response_headers"   # an event stream's head is never held
    [r] = ex.on_message(body(CONTENT, False, response=True))
    assert r.WhichOneof("response") == "response_body"
    ex.on_message(body(b"data: [DONE]\n\n", True, response=True))
    ex.close()
    plain = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    ex = Exchange(picker, 1, eager=True)
    ex.on_message(eager_headers(**{":path": "/v1/chat/completions"}))
    ex.on_message(body(plain, True))
    assert ex.on_message(resp_headers(ctype="application/json")) == []
    part = b"x" * (ANSWER_KEEP // 2 + 1)
    assert ex.on_message(body(part, False, response=True)) == []
    out = ex.on_message(body(part, False, response=True))   # past ANSWER_KEEP: the head goes on
    assert [r.WhichOneof("response") for r in out] == ["response_headers", "response_body", "response_body"]
    [r] = ex.on_message(body(b"}", True, response=True))
    assert r.WhichOneof("response") == "response_body" and ex.done
    ex.close()
