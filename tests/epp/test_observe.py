"""The observed response side (epp.observe) message by message against a real segment (no
Envoy): the pick hands its lease off under a token, the observer's stream takes it over and ends
it; a lease no observer adopts ends after the claim time; a stream without a known token accounts
nothing. The fixtures and builders are tests/epp/test_exchange.py's."""
from __future__ import annotations

import time

from epp.envoy import LEASE_HEADER
from epp.observe import Observer, new_exchange
from epp.picker import Picker
from tests.epp.test_exchange import (  # noqa: F401
    BODY,
    CONTENT,
    body,
    headers,
    picker,
    requests,
    resp_headers,
)

DONE = b"data: [DONE]\n\n"


def pick(p: Picker) -> str:
    """A request through the first filter's exchange (``x-dplb-side: request``); its token."""
    ex = new_exchange(p, 2, 0, "request")
    assert ex.observed and not isinstance(ex, Observer)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    [r] = ex.on_message(body(BODY, True))
    hs = {h.header.key: h.header.raw_value for h in r.request_body.response.header_mutation.set_headers}
    assert r.dynamic_metadata["envoy.lb"]["x-dplb-worker-id"] == "0"
    ex.close()   # Envoy ends the first stream once the request went upstream: the lease lives on
    assert p.state.seg.router_line(0)["router_inflight"] == 1
    return hs[LEASE_HEADER].decode()


def observe(p: Picker, token: str) -> Observer:
    ob = new_exchange(p, 2, 1, "response")
    assert isinstance(ob, Observer)
    assert ob.on_message(headers(**{":path": "/v1/chat/completions", LEASE_HEADER: token})) == []
    return ob


async def test_the_observer_takes_the_lease_over_and_ends_it(picker):  # noqa: F811
    token = pick(picker)
    ob = observe(picker, token)
    assert ob.on_message(resp_headers()) == []
    ob.on_message(body(CONTENT, False, response=True))
    line = picker.state.seg.router_line(0)
    assert line["router_inflight"] == 1 and line["decode_reqs"] == 1   # the first content ended the prefill
    assert ob.on_message(body(DONE, True, response=True)) == []
    assert ob.done
    ob.close()
    assert picker.state.seg.router_line(0)["router_inflight"] == 0
    assert requests(picker, "200") == 1
    assert picker.handoffs.open == {}


async def test_a_lease_no_observer_adopts_ends_after_the_claim_time(picker):  # noqa: F811
    pick(picker)
    assert picker.handoffs.expire() == 0   # within the claim time: kept
    assert picker.handoffs.expire(time.monotonic() + picker.handoffs.claim_s) == 1
    assert picker.state.seg.router_line(0)["router_inflight"] == 0
    assert requests(picker, "499") == 1 and picker.handoffs.expired == 1


async def test_an_unknown_token_accounts_nothing(picker):  # noqa: F811
    token = pick(picker)
    ob = observe(picker, "another-replica.1")
    ob.on_message(resp_headers(ctype="application/json"))
    ob.on_message(body(b'{"choices": []}', True, response=True))
    ob.close()
    assert picker.handoffs.foreign == 1
    assert picker.state.seg.router_line(0)["router_inflight"] == 1   # still the pick's, waiting for its own observer
    observe(picker, token).close()   # its stream ends before any response: the client left
    assert picker.state.seg.router_line(0)["router_inflight"] == 0
    assert requests(picker, "200") == 0 and requests(picker, "499") == 1


async def test_a_stream_without_the_side_header_keeps_its_response_side(picker):  # noqa: F811
    ex = new_exchange(picker, 2, 1, None)
    assert not ex.observed and not isinstance(ex, Observer)
    ex.on_message(headers(**{":path": "/v1/chat/completions", "content-type": "application/json"}))
    [r] = ex.on_message(body(BODY, True))
    assert LEASE_HEADER not in {h.header.key for h in r.request_body.response.header_mutation.set_headers}
    assert picker.handoffs.open == {}
    ex.on_message(resp_headers())
    ex.on_message(body(CONTENT + DONE, True, response=True))
    assert picker.state.seg.router_line(0)["router_inflight"] == 0 and requests(picker, "200") == 1
