"""Aborts reach queued streams (issue 46, item 6).

The failure: a streamed request whose client left while it waited in the engine's queue was never
aborted (the engine still queued or ran it 10 s later), while a non-streamed one was aborted at
once: the router, cancelled while waiting for the stream's first byte, kept the engine connection
open. Now it closes it, and the engine drops the request while the long one ahead of it still runs.
"""
from __future__ import annotations

import pytest

from bench.faultsuite.scen_contained import run_queued_client_leaves

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_while_queued_is_aborted_at_the_engine(stream):
    r = run_queued_client_leaves(stream=stream)
    assert r.extra["aborted_while_queued"], r.extra
    assert r.extra["long_still_running"] and r.ok == 1 and r.lost == 0
