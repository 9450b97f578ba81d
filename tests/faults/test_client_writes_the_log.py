"""A client cannot write the router's log (issue 46, item 5).

The failure: CR/LF in a model name or an ``X-Request-Id`` landed raw in the router's log (a client
forged a ``WARNING ... worker 0: ready -> dead`` line), a request id carrying ``worker=9
status=500`` made the access line lie, and a 4 MiB model name was written whole (three requests
grew the log by 12 MiB). Now every client-supplied value is escaped, quoted when it could pose as
a field, and cut to 256 characters; the JSON access log stays one valid object per line.
"""
from __future__ import annotations

import logging

import pytest

from bench.faultsuite.scen_contained import (
    FORGED,
    hostile_requests,
    parse_access,
    run_log_injection,
)
from router.logtext import MAX_FIELD, OneLineFilter, field, text

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.mark.parametrize("mode", ["text", "json"])
def test_no_client_bytes_add_a_log_line_or_field_and_a_4mib_model_stays_small(mode):
    r = run_log_injection(mode)
    x = r.extra
    n = len(hostile_requests())
    assert x["bad_access_lines"] == [], x["bad_access_lines"]
    assert x["forged_lines"] == [] and x["other_lines"] == [], (x["forged_lines"], x["other_lines"])
    # exactly one line per request, each the router's own access line
    assert x["access_lines"] == n == x["lines"], x
    assert all(s is not None for s in x["statuses"].values()), x["statuses"]
    # three requests naming a 4 MiB model: three short lines, not 12 MiB
    assert x["big_lines"] == 3 and x["big_growth_bytes"] < 3 * 4096, x["big_growth_bytes"]
    assert r.lost == 0


def test_the_escapes_keep_values_readable_and_bounded():
    assert text("plain-model") == "plain-model"
    assert text("a\r\nb\x85c\u2028d\x1be\\") == "a\\x0d\\x0ab\\x85c\\u2028d\\x1be\\\\"
    assert field("abc worker=9 status=500") == '"abc worker=9 status=500"'
    assert field('q" x="') == '"q\\" x=\\""' and field("") == '""'
    long = text("M" * (4 << 20))
    assert long == "M" * MAX_FIELD + f"...(+{(4 << 20) - MAX_FIELD} chars)"
    # a forged field inside a quoted value parses as part of the one field
    bare, fields = parse_access(f"rid={field('x worker=9 status=500')} POST /p model={field(chr(10) + FORGED)} "
                                "worker=0 status=200")
    assert fields["worker"] == "0" and fields["status"] == "200" and bare == ["POST", "/p"]


def test_the_handler_filter_keeps_any_record_on_one_line():
    rec = logging.LogRecord("dplb.x", logging.WARNING, __file__, 1, "got %s", ("a\nb\r\x00" + "y" * 20000,), None)
    assert OneLineFilter().filter(rec)
    msg = rec.getMessage()
    assert "\n" not in msg and "\r" not in msg and msg.startswith("got a\\u000ab\\u000d\\u0000")
    assert len(msg) < 16500 and msg.endswith("chars)")
