"""A truncated answer is a failure (issue 46, item 2).

The failure: an engine that aborted a request (vLLM's ``finish_reason: "abort"``: its drain limit,
a stop, an agent's death taking it down) had its answer relayed as HTTP 200 and counted 200, after
5-11 of 256 tokens; nothing was retried. Now an abort before any content goes to another worker,
and one after content ends the stream with an OpenAI-shaped SSE error event, counted 502
``engine_abort``; a non-streamed abort with no other worker is a 502.
"""
from __future__ import annotations

import pytest

from bench.faultsuite.scen_contained import run_engine_abort

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_an_engine_side_abort_is_retried_or_counted_5xx_never_200():
    """With worker 1 starved (stopped 2 s) as the aborted streams begin: a heavy-load run once saw
    a stream end with neither an error event nor ``[DONE]`` (a 503 in JSON: worker 1 out of
    routing, worker 0's breaker open on its aborts; see :func:`run_engine_abort`)."""
    n = 6
    r = run_engine_abort(n, starve_s=1.0)
    x = r.extra
    assert x["early"] == {"200/1/whole": 2 * n}, x["early"]       # retried on worker 1, whole
    assert x["cut"] == {"200/error_event": 2 * n}, (x["cut"], x.get("odd_endings"))   # ends with an error event
    assert x["non_streamed_everywhere"] == (502, "upstream_error")
    assert x["requests_502"] == 2 * n + 1, x                       # counted 5xx, not 200
    assert x["engine_abort_errors"] >= 2 * n + 2 * n, x
    assert r.lost == 0
