"""The router's drain limit cut long streams and counted them 499 (issue 46, item 2).

The failure: a router stopped (SIGTERM) with streams still running at its drain limit
(``--drain-timeout``) cut them without their body's end and counted them 499
``client_disconnect``, as if their clients had left; the client read a truncated answer with
no error. Now a stream already started ends with an OpenAI-shaped SSE error event (503
``service_unavailable``) and a whole chunked body, a request not yet answered gets a 503 with
``Retry-After``, and both are counted 503 (``kind="drain_cut"``), never 499. The scenario is
:func:`bench.faultsuite.scen_contained.run_drain_cut` (row ``46.2d`` of ``bench/results/faults.md``).
"""
from __future__ import annotations

import pytest

from bench.faultsuite.scen_contained import run_drain_cut

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_the_drain_limit_cut_of_a_stream_is_a_503_with_an_error_event_not_a_499():
    r = run_drain_cut(streams=3, drain_timeout_s=1.0)
    x = r.extra
    print(x)
    # every stream: the head's 200, a whole chunked body, its last event an OpenAI error (503)
    assert x["streams"] == {"200/whole/error_event/503/service_unavailable": 3}, x
    assert x["non_streamed"] == (503, "1", "service_unavailable", None), x
    assert x["access_statuses"] == {"503": 4}, x       # counted 503, never 499 (nor 200)
    assert x["drain_cut_lines"] >= 1, x               # the 503's WARNING line says why
    assert r.lost == 0
