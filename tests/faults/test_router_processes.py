"""Issue 27 item 4: a dead router process's share of the accounting is given back; scenario code
in :mod:`bench.faultsuite.scen_router_procs` (row ``27.4`` of ``bench/results/faults.md``)."""
from __future__ import annotations

import pytest

from bench.faultsuite.scen_router_procs import run_router_process_killed

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_a_killed_router_process_leaves_no_phantom_load_and_its_death_is_logged():
    """"A dead router process leaves phantom load for ever": the in-flight and outstanding
    prefill counts it held stayed in the segment (8 and 13 k), a later burst of 40 went 38/2, and
    its replacement appeared with no log line."""
    r = run_router_process_killed()
    at_kill = r.extra["at_kill"]
    assert at_kill["router_inflight"] == 40 and at_kill["prefill_tokens"] > 0 and at_kill["decode_reqs"] > 0
    assert 1 <= r.extra["cut_by_the_kill"] < 40      # both processes held streams; only the victim's broke
    assert r.extra["cut_by_the_kill"] == r.extra["victim_held"]
    assert r.detection_s is not None, "the killed process's share never left the segment"
    assert r.extra["after_streams"] == dict.fromkeys(("router_inflight", "prefill_tokens", "decode_reqs",
                                                      "decode_ctx_tokens"), 0)
    assert r.extra["burst_lost"] == 0
    split = sorted(r.extra["burst_split"].values())
    assert len(split) == 2 and split[1] <= 1.5 * split[0], r.extra["burst_split"]
    assert len(r.extra["processes_after"]) == 2      # the parent replaced the victim
    assert r.extra["death_logged"]
