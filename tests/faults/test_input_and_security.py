"""Scenarios 10 and 11 of issue 8: bad input never becomes a 500 or a breaker failure; files,
sockets, tokens and admin-supplied endpoints are locked down."""
from __future__ import annotations

import pytest

from tests.faults import scenarios as sc

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
    assert r.extra["drained_after"] == "ready"       # the unauthenticated drain did nothing
