"""Issue 27 item 6, "a stop under traffic cuts streams": one test, named after the failure; the
scenario is :func:`bench.faultsuite.scen_stop.run_stop_under_traffic` (row ``27.6`` of
``bench/results/faults.md``)."""
from __future__ import annotations

import pytest

from bench.faultsuite import scen_stop as sc
from bench.faultsuite.load import lost_details

pytestmark = [pytest.mark.faults, pytest.mark.timeout(400)]


@pytest.mark.parametrize("policy", ["dplb", "round_robin"])
def test_a_stop_under_traffic_ends_no_stream_with_abort(policy):
    """Ctrl-C of the launcher while 16 streams run and their clients keep sending: the default
    policy's fallback sent the new requests to the draining workers, whose engines were then stopped
    under them (HTTP 200 streams ending with ``finish_reason: "abort"``, 12 of 133 here before the
    fix). Every 200 must end normally, every refusal be a 503 with ``Retry-After`` (no reset before
    a status), no agent reach its drain limit, and the launcher exit 0 within the limit + margin.
    ``round_robin`` answered 503s already (it picks from READY snapshots): the same for every policy."""
    r = sc.run_stop_under_traffic(policy=policy, clients=16, drain_timeout_s=10.0)
    x = r.extra
    assert x["left_running"] == [], x
    assert x["launcher_rc"] == 0, x["launcher_tail"]
    assert x["stop_s"] is not None and x["stop_s"] < 10.0 + 20.0, x
    assert x["in_flight_at_stop"] >= 8, x          # the stop came mid-way through the streams
    assert x["aborted_200"] == [], x
    assert x["reset_before_status"] == [], x
    assert x["refused_without_retry_after"] == [], x
    assert r.lost == 0, lost_details(r.outcomes)
    assert x["drain_limit_hit"] == 0, x            # the workers drained on the count, not at the limit
    assert x["sent_after_stop"] >= 1 and x["refused_503"] >= 1, x   # requests did arrive while draining
    assert set(x["finish_reasons"]) <= {"stop", "length"}, x
