"""Issue 27 item 7, admin races on a remote worker: one test per failure, named after it; scenario
code in :mod:`bench.faultsuite.scen_remote_admin` (rows ``27.7`` and ``27.7w`` of ``bench/results/faults.md``)."""
from __future__ import annotations

import pytest

from bench.faultsuite import scen_remote_admin as sc
from bench.faultsuite.load import lost_details

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def _check(r) -> None:
    e = r.extra
    assert e["one_at_a_time"] == {(201, 200): 6}, e             # one at a time: a slot each, released each
    assert e["nonempty_slots"] == [0, 1], e                  # only the two local workers' slots
    assert e["dead_slots"] == [] and e["remote_rows"] == [], e
    assert e["post_2xx_without_id"] == 0 and e["unexpected"] == [], e
    assert e["calls"]["POST"].get(201, 0) >= 1 and e["calls"]["DELETE"].get(200, 0) >= 1, e
    assert e["delete_removed"] == (404, "not_found_error"), e
    assert r.lost == 0 and r.honest == 0 and r.ok == r.sent >= 1, lost_details(r.outcomes)


def test_concurrent_add_remove_of_a_remote_worker_leaves_only_the_local_workers():
    """Item 7 ("a DEAD slot is left in the dump, and DELETE of it answers 200 'removed' and changes
    nothing"): 4 threads x 50 add/remove cycles of one remote endpoint while requests flow."""
    _check(sc.run_concurrent_add_remove(threads=4, cycles=50, budget_s=90))


def test_concurrent_add_remove_through_two_router_processes_leaves_only_the_local_workers():
    """The same cycles through ``--workers 2``: the calls land on both processes, only one of
    which writes mirror slots; the other's answers wait until that one applied them."""
    _check(sc.run_concurrent_add_remove(threads=4, cycles=30, router_workers=2, budget_s=90))


def test_a_remove_waiting_for_a_killed_mirror_owner_is_applied_by_the_next_one_and_leaves_no_slot():
    """No slot without an owner: the router process that writes mirror slots is stopped while a
    DELETE answered by the other process waits for it, then killed; the other process takes the
    slots over, releases the removed one and answers 200."""
    r = sc.run_mirror_owner_killed()
    e = r.extra
    assert e["post"][0] == 201 and e["owner_is_a_router"], e
    assert e["answered_while_owner_stopped"] is False, e       # it waited for the owner
    assert e["delete"] == 200 and e["slot_state_after"] == 0, e
    assert e["readded"][0] == 201 and e["new_owner_differs"], e
    assert r.lost == 0 and r.honest == 0 and r.ok == r.sent, lost_details(r.outcomes)
