"""The ext_proc stream's answers without a gateway (epp/stream.py): immediate errors, the destination."""
from __future__ import annotations

import orjson

from epp.envoy import HEADER
from epp.picker import envoy_target
from epp.stream import CHUNK, Exchange, destination, immediate, route_answer
from router.errors import NoEligibleWorker


def test_immediate_response_is_openai_shaped():
    r = immediate(NoEligibleWorker("no worker can take the request now")).immediate_response
    assert r.status.code == 503
    hs = {h.header.key: h.header.raw_value.decode() for h in r.headers.set_headers}
    assert hs == {"content-type": "application/json", "x-dplb-worker-id": "none", "retry-after": "1"}
    assert orjson.loads(r.body)["error"] == {"message": "no worker can take the request now",
                                             "type": "service_unavailable", "param": None, "code": 503}


def test_destination_sets_header_and_envoy_lb_metadata():
    mutation, md = destination("10.1.2.3:8000")
    assert [(h.header.key, h.header.raw_value) for h in mutation.set_headers] == [(HEADER, b"10.1.2.3:8000")]
    assert md["envoy.lb"][HEADER] == "10.1.2.3:8000"


def test_envoy_targets_are_ip_literals():
    assert envoy_target("0.0.0.0:8000") == "127.0.0.1:8000"
    assert envoy_target("localhost:8000") == "127.0.0.1:8000"
    assert envoy_target("[::]:8000") == "[::1]:8000"
    assert envoy_target("10.0.0.5:8000") == "10.0.0.5:8000"
    assert destination("0.0.0.0:9")[1]["envoy.lb"][HEADER] == "127.0.0.1:9"


def test_an_exchange_without_a_lease_releases_nothing():
    ex = Exchange(None, 2)  # type: ignore[arg-type]
    ex.close()              # a stream that ended before any pick: nothing to give back
    assert CHUNK == 62_000


def test_route_answer_routes_down_the_endpoints_and_is_shared_per_destination():
    head = route_answer(("0.0.0.0:9", "10.0.0.5:8000"), False)
    body = route_answer(("0.0.0.0:9", "10.0.0.5:8000"), True)
    for resp, common in ((head, head.request_headers.response), (body, body.request_body.response)):
        assert [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers] == [
            (HEADER, b"127.0.0.1:9,10.0.0.5:8000")]
        assert common.clear_route_cache
        assert resp.dynamic_metadata["envoy.lb"][HEADER] == "127.0.0.1:9,10.0.0.5:8000"
    assert head.WhichOneof("response") == "request_headers" and body.WhichOneof("response") == "request_body"
    assert route_answer(("0.0.0.0:9", "10.0.0.5:8000"), False) is head   # built once per destination
    assert route_answer(("10.0.0.5:8000",), False) is not head


def test_serve_freezes_start_up_objects_out_of_the_collector(segs, tmp_path):
    """Once serving, what start-up built is frozen (gc.freeze): the collector's full passes walk
    only what requests allocate (a pass over the start-up objects stalled the loop 160-180 ms)."""
    import asyncio
    import gc

    from epp.picker import Picker
    from epp.server import serve
    from router.config import Config

    cfg = Config.model_validate({"health_check": {"enabled": False}, "router": {"state_dir": str(tmp_path / "st")}})
    gc.unfreeze()

    async def run() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(serve(Picker(cfg, segs()), "127.0.0.1", 0, 0, None, stop=stop))
        try:
            for _ in range(600):   # start-up done within 30 s even on a loaded machine
                if gc.get_freeze_count() or task.done():
                    break
                await asyncio.sleep(0.05)
            return gc.get_freeze_count()
        finally:
            stop.set()
            await task

    try:
        assert asyncio.run(run()) > 1000
    finally:
        gc.unfreeze()
