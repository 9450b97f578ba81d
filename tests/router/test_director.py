"""Request control (:class:`router.director.Director`) on its own, over a real segment, registry
and scheduler (round robin) without any edge: parse and model check, the admission step (an
admission that holds a request back, one that refuses it), admit-then-lease dispatch, and the
bookkeeping at first content and at the end (token counts, the lease, the 499 rule, the access
line)."""
from __future__ import annotations

import asyncio
import logging
import os
import time

import orjson
import pytest

from router.access_log import AccessLog
from router.config import load_config
from router.director import CLIENT_CLOSED, Director, OpenAdmission, route_of
from router.errors import BadRequest, NoEligibleWorker, NotFound, RouterError
from router.metrics import Metrics
from router.policies.base import RequestInfo
from router.policies.round_robin import RoundRobinPolicy
from router.scheduling import Scheduler
from router.stream_meter import StreamMeter
from router.workers import Registry
from tests.helpers import metric, unique_shm_name

CONTENT = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


@pytest.fixture
def seg():
    """Slots 0 and 1 READY serving model ``m``, slot 2 READY serving ``n``."""
    from dplb_shm import Segment, WorkerState

    name = unique_shm_name()
    s = Segment.create(name, num_slots=4)
    try:
        for i, model in enumerate(("m", "m", "n")):
            w = s.writer(i)
            w.claim(i, pid=os.getpid(), endpoint=f"127.0.0.1:{9000 + i}", model=model)
            w.publish(state=WorkerState.READY, kv_cache_usage=0.1, heartbeat_ns=time.monotonic_ns())
        yield s
    finally:
        s.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def build(seg, access: AccessLog | None = None, admission=None) -> Director:  # type: ignore[no-untyped-def]
    reg = Registry(seg, load_config(None, {"health_check.enabled": False}))
    reg.sync(seg.snapshot())
    metrics = Metrics()
    sched = Scheduler(reg, RoundRobinPolicy(), seg, metrics)
    metrics.attach(reg, seg, "round_robin", sched.routing_state)
    return Director(sched, metrics, needs_text=True, access=access, admission=admission)


def text(d: Director) -> str:
    return d.metrics.render()[0].decode()


def body(model: str | None = "m", stream: bool = True) -> bytes:
    req: dict[str, object] = {"stream": stream, "messages": [{"role": "user", "content": "hello there"}]}
    if model is not None:
        req["model"] = model
    return orjson.dumps(req)


# -- parse and model check ---------------------------------------------------------------------------
def test_parse_reads_what_routing_needs_and_the_session(seg):
    d = build(seg)
    info = d.parse("/v1/chat/completions", body(), b"s-1")
    assert (info.model, info.stream, info.session, info.path) == ("m", True, "s-1", "/v1/chat/completions")
    assert "hello there" in info.text
    with pytest.raises(BadRequest) as e:
        d.parse("/v1/chat/completions", b"[1, 2]", None)
    assert e.value.status == 400


def test_the_model_check_refuses_an_unknown_model_and_an_unnamed_one_among_several(seg):
    d = build(seg)
    assert d.request("/v1/chat/completions", body("n"), None).model == "n"
    with pytest.raises(NotFound) as nf:
        d.request("/v1/chat/completions", body("no-such-model"), None)
    assert nf.value.status == 404 and "no-such-model" in nf.value.message
    with pytest.raises(BadRequest) as unnamed:
        d.request("/v1/chat/completions", body(None), None)
    assert unnamed.value.status == 400 and unnamed.value.param == "model"


def test_route_labels_stay_bounded():
    assert route_of("/v1/completions") == "/v1/completions"
    assert route_of("/v1/whatever/else") == "/v1/other"


# -- admission ------------------------------------------------------------------------------------
class HoldingAdmission(OpenAdmission):
    """Holds every request until :attr:`go` is set, then lets it through (or refuses it); the
    rest of the admission step (tag, take_pick, take_lease, kick) as :class:`OpenAdmission`'s."""

    __slots__ = ("go", "refuse", "waited")

    def __init__(self, refuse: RouterError | None = None) -> None:
        self.go = asyncio.Event()
        self.refuse = refuse
        self.waited: list[str | None] = []

    def ready(self, info: RequestInfo) -> bool:
        return self.go.is_set()

    async def wait(self, info: RequestInfo) -> None:
        self.waited.append(info.model)
        await self.go.wait()
        if self.refuse is not None:
            raise self.refuse


class TooMany(RouterError):
    status = 429
    type = "rate_limit_error"


async def test_open_admission_lets_every_request_through_at_once(seg):
    d = build(seg)
    assert isinstance(d.admission, OpenAdmission)
    info = d.request("/v1/chat/completions", body(), None)
    assert d.may_dispatch(info)
    await d.admit(info)     # returns at once


async def test_a_request_admission_holds_back_waits_until_it_is_let_through(seg):
    adm = HoldingAdmission()
    d = build(seg, admission=adm)
    info = d.request("/v1/chat/completions", body(), None)
    assert not d.may_dispatch(info)
    task = asyncio.ensure_future(d.admit(info))
    for _ in range(20):
        await asyncio.sleep(0)
    assert adm.waited == ["m"] and not task.done()       # waiting, nothing dispatched
    assert [seg.router_line(i)["router_inflight"] for i in range(3)] == [0, 0, 0]
    adm.go.set()
    await asyncio.wait_for(task, 10)
    assert d.may_dispatch(info)


async def test_admission_may_refuse_a_request_with_its_own_status(seg):
    adm = HoldingAdmission(refuse=TooMany("waited too long", headers={"retry-after": "1"}))
    d = build(seg, admission=adm)
    info = d.request("/v1/chat/completions", body(), None)
    task = asyncio.ensure_future(d.admit(info))
    await asyncio.sleep(0)
    adm.go.set()
    with pytest.raises(TooMany) as e:
        await asyncio.wait_for(task, 10)
    d.refused(e.value, "/v1/chat/completions", time.perf_counter())
    assert metric(text(d), "dplb_router_requests_total", worker="none", status="429") == 1


# -- dispatch ----------------------------------------------------------------------------------------
def test_dispatch_leases_the_chosen_worker_and_503s_when_none_is_left(seg):
    d = build(seg)
    info = d.request("/v1/chat/completions", body(), None)
    h, lease = d.dispatch(info)
    assert h.worker_id in (0, 1) and lease.handle is h
    assert seg.router_line(h.worker_id)["router_inflight"] == 1
    with pytest.raises(NoEligibleWorker) as e:
        d.pick(info, {0, 1})            # model m has no other worker
    assert e.value.status == 503 and "retry-after" in {k.lower() for k in e.value.headers}
    assert lease.finish(True)
    assert seg.router_line(h.worker_id)["router_inflight"] == 0


# -- bookkeeping -----------------------------------------------------------------------------------
def test_a_streams_first_content_and_end_keep_the_books(seg):
    d = build(seg)
    info = d.request("/v1/chat/completions", body(), None)
    t0 = time.perf_counter()
    h, lease = d.dispatch(info)
    meter = StreamMeter(True)
    assert meter.feed(CONTENT)
    ttft = d.first_content("/v1/chat/completions", t0, lease)
    assert ttft >= 0
    assert seg.router_line(h.worker_id)["decode_reqs"] == 1          # the lease left prefill
    meter.feed(CONTENT * 4 + b"data: [DONE]\n\n")
    prompt, out = d.stream_end(meter, lease, complete=True) or (None, None)
    assert out == 5 and prompt == lease.account.prompt_tokens
    assert seg.router_line(h.worker_id)["router_inflight"] == 0      # released
    lease.finish(True)
    d.finished(h.label, 200, "/v1/chat/completions", t0)
    t = text(d)
    assert metric(t, "dplb_router_generation_tokens_total", worker=str(h.worker_id), model="m") == 5
    assert metric(t, "dplb_router_requests_total", worker=str(h.worker_id), status="200", model="m") == 1
    assert metric(t, "dplb_router_time_to_first_token_seconds_count", route="/v1/chat/completions",
                  model="m") == 1


def test_a_non_streamed_answer_counts_its_usage(seg):
    d = build(seg)
    info = d.request("/v1/chat/completions", body(stream=False), None)
    h, lease = d.dispatch(info)
    answer = orjson.dumps({"choices": [{"text": "hi"}], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    assert d.answer(lease, answer) == (7, 3)
    lease.finish(True)
    assert metric(text(d), "dplb_router_prompt_tokens_total", worker=str(h.worker_id), model="m") == 7


def test_a_client_that_left_is_counted_499_with_a_disconnect_error(seg, caplog):
    d = build(seg, access=AccessLog("text"))
    info = d.request("/v1/chat/completions", body(), None)
    h, lease = d.dispatch(info)
    lease.finish(None)
    with caplog.at_level(logging.INFO, logger="dplb.router.access"):
        d.client_left(h.label, "/v1/chat/completions", time.perf_counter(), b"rid-9", "POST", info.path, info.model,
                      None, info.prompt_len, 2)
    t = text(d)
    assert metric(t, "dplb_router_requests_total", worker=h.label, status=str(CLIENT_CLOSED)) == 1
    assert metric(t, "dplb_router_request_errors_total", worker=h.label, kind="client_disconnect") == 1
    [line] = [r.getMessage() for r in caplog.records if "rid=rid-9 " in r.getMessage()]
    assert "status=499 " in line and "output_tokens=2 " in line and "model=m " in line


def test_a_refusal_is_counted_under_no_worker_and_logged_only_where_the_edge_keeps_a_log(seg, caplog):
    quiet = build(seg)
    with caplog.at_level(logging.INFO, logger="dplb.router.access"):
        quiet.refused(NotFound("no such model"), "/v1/chat/completions", time.perf_counter(), b"rid-q")
        build(seg, access=AccessLog("text")).refused(NotFound("no such model"), "/v1/chat/completions",
                                                    time.perf_counter(), b"rid-l", "POST", "/v1/chat/completions")
    assert metric(text(quiet), "dplb_router_requests_total", worker="none", status="404") == 1
    logged = [r.getMessage() for r in caplog.records if r.name == "dplb.router.access"]
    assert not any("rid=rid-q " in m for m in logged)
    assert any("rid=rid-l " in m and "attempts=0" in m for m in logged)
