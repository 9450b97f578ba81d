"""Issue 27 item 5: a dead agent is never replaced. kill -9 of a worker agent left its worker out
until the whole stack restarted, its slot READY with a heartbeat growing past 45 s in
``dplb-shm-dump``, and ``POST /dplb/workers/2/restart`` answering 502."""
from __future__ import annotations

import pytest

from bench.faultsuite.load import lost_details
from bench.faultsuite.scen_agent_restart import run_killed_agent_restarted
from dplb_shm import HEARTBEAT_TIMEOUT_MS, WorkerState, dump, heartbeat_stale, now_ns

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_a_killed_agent_is_restarted_and_its_worker_serves_again():
    r = run_killed_agent_restarted()
    x = r.extra
    # back in routing by itself, within a bounded time (2 s backoff + an agent and a sim engine start)
    assert r.recovery_s is not None and r.recovery_s < 60, (r.recovery_s, x)
    assert x["first_served_s"] is not None and x["served_by_victim_after"] >= 1, x["by_worker"]
    assert r.lost == 0, lost_details(r.outcomes)
    # the slot went DEAD at once (not READY with a stale heartbeat), then the new agent claimed it
    seen = x["slot_seen"]
    assert seen[0] == ("READY", "none", x["old_pid"]) and seen[1] == ("DEAD", "agent_exited", x["old_pid"]), seen
    assert seen[-1] == ("READY", "none", x["new_pid"]) and x["new_pid"] != x["old_pid"], seen
    assert x["generation"][1] > x["generation"][0]
    assert r.detection_s is not None and r.detection_s < 5, r.detection_s
    # the launcher said so, one line each: the death, the restart, READY again
    lines = x["launcher_lines"]
    assert any(ln.startswith("dplb: worker 2 killed by SIGKILL (-9); restarting its agent in 2.0s") for ln in lines), lines
    assert any(ln.startswith(f"dplb: worker 2: agent restarted (restart 1, pid {x['new_pid']})") for ln in lines), lines
    assert any(ln.startswith("dplb: worker 2: READY again after agent restart 1, agent pid "
                             f"{x['new_pid']}, engine pid ") for ln in lines), lines
    # the admin restart answered 502 while the agent was down: now 503 + Retry-After, 202 once back
    status, retry_after = x["admin_restart_while_down"]
    assert status == 503 and retry_after is not None and int(retry_after) >= 1, x["admin_restart_while_down"]
    assert x["admin_restart"] == 202 and x["dump_state"] == "ready" and x["launcher_rc"] == 0


def test_the_dump_shows_a_stale_heartbeat_as_stale_by_the_routers_rule(segment, shm_name):
    """The dump said ``ready`` for a slot whose agent was gone (heartbeat 45 s old); it now says
    ``stale`` by the rule and threshold ``/dplb/status`` uses (:func:`dplb_shm.heartbeat_stale`)."""
    now = now_ns()
    for wid, age_ms, state in ((0, 45_000, WorkerState.READY), (1, 10, WorkerState.READY),
                               (2, 45_000, WorkerState.DEAD)):
        w = segment.writer(wid)
        w.claim(wid, pid=100 + wid, endpoint=f"/tmp/e-{wid}.sock")
        w.publish(state=state, heartbeat_ns=now - age_ms * 1_000_000)
    states = {ln.split()[0]: ln.split()[1] for ln in dump.render_table(segment).splitlines()[2:]}
    assert states == {"0": "stale", "1": "ready", "2": "dead"}
    # the threshold is the router's (health_check.heartbeat_timeout_ms), given when not the default
    relaxed = {ln.split()[0]: ln.split()[1] for ln in
               dump.render_table(segment, heartbeat_timeout_ms=60_000).splitlines()[2:]}
    assert relaxed["0"] == "ready"
    # one rule: the router's eligibility reads the same function
    from router.config import HealthCheck

    assert HealthCheck().heartbeat_timeout_ms == HEARTBEAT_TIMEOUT_MS
    s0 = segment.read_slot(0)
    assert heartbeat_stale(s0.state, s0.heartbeat_age_ms) and dump.state_label(s0) == "stale"
