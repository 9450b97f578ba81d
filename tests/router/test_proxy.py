"""What router/proxy.py sends upstream: the request target."""
from __future__ import annotations

import pytest


def test_the_request_target_is_the_raw_path_and_query():
    from router.errors import BadRequest
    from router.exchange import request_target

    assert request_target({"path": "/v1/a\r\nb", "raw_path": b"/v1/a%0D%0Ab", "query_string": b"x=1"}) == \
        "/v1/a%0D%0Ab?x=1"
    assert request_target({"path": "/v1/a b\n"}) == "/v1/a%20b%0A"      # a server without raw_path
    with pytest.raises(BadRequest):
        request_target({"path": "/v1/x", "raw_path": b"/v1/x y", "query_string": b""})
    with pytest.raises(BadRequest):
        request_target({"path": "/v1/x", "raw_path": b"/v1/x", "query_string": b"a=\r\n"})
