"""Scenarios 10 and 11 of issue 8: bad input never becomes a 500 or a breaker failure; files,
sockets, tokens and admin-supplied endpoints are locked down."""
from __future__ import annotations

import httpx
import pytest

from bench.faultsuite import scenarios as sc

pytestmark = [pytest.mark.faults, pytest.mark.timeout(180)]


def test_bad_input_gets_openai_shaped_4xx_and_never_touches_the_breaker():
    r = sc.run_bad_input()
    assert r.extra["mismatches"] == []
    assert r.sent == len(sc.BAD_INPUTS) and r.honest == r.sent and r.lost == 0
    assert r.extra["worker"] == {"circuit": "closed", "failure_rate": 0.0, "failed": 0, "eligible": True}
    assert r.extra["good_after"] == 200


def test_files_sockets_tokens_and_admin_endpoints_are_locked_down():
    r = sc.run_security()
    assert r.extra["segment_mode_cli"] == "0o600" and r.extra["segment_mode"] == "0o600"
    assert r.extra["agent_socket_mode"] == "0o660" and r.extra["engine_socket_mode"] == "0o600"
    c = r.extra["checks"]
    for label, (code, shaped) in c.items():
        assert shaped, label
        want = 200 if label in ("admin list, token header", "admin list, bearer token", "chat, key") else 401
        assert code == want, (label, code)
    assert r.extra["bad_endpoints"] == {ep: 400 for ep in sc.BAD_ENDPOINTS}
    assert r.extra["claimed_slots"] == [0]           # no mirror slot was claimed for a refused endpoint
    assert r.extra["drained_after"] == "eligible"    # the unauthenticated drain did nothing


def test_fuzzed_bodies_never_get_a_5xx():
    """Random bytes, random JSON values and near-miss chat bodies: always an answer or an
    OpenAI-shaped 4xx, never a 5xx (the fake worker answers whatever is forwarded with 200)."""
    import orjson
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st_

    from bench.faultsuite.cluster import Stack
    from bench.faultsuite.load import openai_error

    json_values = st_.recursive(st_.none() | st_.booleans() | st_.integers(-(2**63), 2**63 - 1)
                                | st_.floats(allow_nan=False, allow_infinity=False)
                                | st_.text(max_size=20),
                                lambda kids: st_.lists(kids, max_size=4) | st_.dictionaries(st_.text(max_size=8), kids,
                                                                                            max_size=4),
                                max_leaves=12)
    near_chat = st_.fixed_dictionaries({"messages": st_.one_of(json_values, st_.lists(st_.fixed_dictionaries(
        {"role": st_.sampled_from(["user", "system", 7, None]), "content": json_values}), max_size=3))},
        optional={"model": json_values, "stream": json_values, "max_tokens": json_values})
    bodies = st_.one_of(st_.binary(max_size=200), json_values.map(orjson.dumps), near_chat.map(orjson.dumps))
    with Stack() as stack:
        stack.fake(0)
        base = stack.router({}, ready=1)
        seen: set[int] = set()
        calls = []
        with httpx.Client(base_url=base, timeout=30) as c:

            @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(body=bodies, path=st_.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]))
            def probe(body: bytes, path: str) -> None:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                seen.add(r.status_code)
                calls.append(r.status_code)
                assert r.status_code < 500, (body, r.status_code, r.text[:200])
                if r.status_code >= 400:
                    assert openai_error(r.json()), r.text[:200]

            probe()
        assert len(calls) >= 50 and 400 in seen
        row = stack.row(base, 0)
        assert row is not None and row["circuit"] == "closed" and row["failure_rate"] == 0.0
