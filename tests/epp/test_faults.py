"""Faults under load through a real Envoy (issue 30): kill -9 of an engine, and kill -9 of the
picker then its restart, with ``failure_mode_allow`` false and true. Three simulated engines, the
pool cluster (EDS written by the picker, ``override_host`` + retries: :mod:`epp.envoy`).

- An engine killed with requests in flight on it: Envoy retries each (connect failure, reset
  before the response head) down the picker's fallbacks; every request is answered 200, the
  picker moves the lease to the worker that served, takes the dead one out at its first refusal,
  and picks it no more.
- The picker killed: FailClose answers 500 (an OpenAI-shaped body) for what needed it during the
  gap, FailOpen lets those through to Envoy's round robin over the pool (200, no
  ``x-dplb-worker-id``); nothing hangs; the restarted picker picks again and gives back the
  killed one's share of the router lines (its ledger), which return to zero.

Every wait and the whole load are bounded; the ``procs``/``segment`` fixtures kill every process
and remove the segment even when a test fails."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter

import httpx
import orjson
import pytest

from launcher.stack import wait_for
from tests.epp import faults_stack as fs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_engine_killed_under_load_loses_nothing(procs, run_dir, segment, shm_name, monkeypatch):
    st = fs.start_stack(procs, run_dir, shm_name, segment)
    monkeypatch.setattr(fs, "chat_body", lambda i, max_tokens=64, body=fs.chat_body: body(i, max_tokens))
    dead = st.endpoints[0]
    dead_wid = next(s.worker_id for s in segment.snapshot() if s.endpoint == dead)
    killed: list[float] = []

    async def kill_at_20(n: int, _answers: list) -> None:
        # from the 20th answer on, at the first one that finds requests in flight on the engine (on
        # a busy machine it may have none at the 20th: then the kill would test nothing)
        if n >= 20 and not killed and segment.router_line(dead_wid)["router_inflight"] > 0:
            os.kill(st.engines[0].pid, signal.SIGKILL)
            killed.append(time.monotonic())

    answers = asyncio.run(fs.load(st.url, 120, 40, timeout=60, on_progress=kill_at_20))
    retried = st.envoy_stat("cluster.dplb_pool.upstream_rq_retry")
    dead_line = segment.router_line(dead_wid)
    print(f"kill -9 of one engine of 3 under 40 concurrent requests: {fs.counts(answers)}, Envoy retried "
          f"{retried}; the dead worker's line: {dead_line['completed']} completed, {dead_line['failed']} failed")
    assert killed and len(answers) == 120
    assert fs.counts(answers) == Counter({200: 120}), ([a.detail for a in answers if a.status != 200][:5], st.logs())
    assert retried >= 1, "no request was in flight on the killed engine: the test proved nothing"
    # each failed attempt on the dead worker was judged a failure there, its lease moved on
    assert dead_line["failed"] >= 1, dead_line
    # the dead endpoint leaves the picks at once: none of the next requests is picked for it
    before = segment.router_line(dead_wid)["dispatched"]
    after = asyncio.run(fs.load(st.url, 12, 1, timeout=60))
    assert fs.counts(after) == Counter({200: 12}), [a.detail for a in after]
    assert str(dead_wid) not in {a.worker for a in after}
    assert segment.router_line(dead_wid)["dispatched"] == before
    wait_for(st.idle, 15, "router lines back to zero")


@pytest.mark.parametrize("fail_open", [False, True], ids=["FailClose", "FailOpen"])
def test_picker_killed_and_restarted_under_load(procs, run_dir, segment, shm_name, fail_open):
    st = fs.start_stack(procs, run_dir, shm_name, segment, fail_open=fail_open)
    ev: dict[str, float] = {}

    async def restart() -> None:
        await asyncio.sleep(1.0)
        await asyncio.to_thread(st.epp.wait, 10)
        await asyncio.to_thread(st.start_epp)
        ev["up"] = time.monotonic()

    async def kill_at_40(n: int, _answers: list) -> None:
        if n == 40 and "kill" not in ev:
            procs.kill(st.epp)
            ev["kill"] = time.monotonic()
            asyncio.get_running_loop().create_task(restart())

    # 8 clients, paced, until 3 s after the restart (at most 6,000 requests, each within 30 s)
    answers = asyncio.run(fs.load(st.url, 6000, 8, timeout=30, pace_s=0.01, on_progress=kill_at_40,
                                  stop=lambda: "up" in ev and time.monotonic() > ev["up"] + 3.0))
    assert "up" in ev, st.logs()
    gap = [a for a in answers if a.t_end >= ev["kill"] and a.t_sent <= ev["up"]]
    failed = [a for a in answers if a.status != 200]
    print(f"picker killed for {ev['up'] - ev['kill']:.2f} s, failure_mode_allow={fail_open}: {len(answers)} requests, "
          f"{len(gap)} during the gap, {fs.counts(answers)}; failed {len(failed)}/{len(gap)} of the gap's "
          f"({len(failed) / max(1, len(gap)):.0%}), {sum(a.status == 200 and a.worker is None for a in gap)} "
          "answered without a pick")
    # nothing hangs: every request has an answer
    assert all(a.status is not None for a in answers), [a.detail for a in answers if a.status is None][:5]
    # only the gap fails
    assert all(a.t_end >= ev["kill"] and a.t_sent <= ev["up"] + 0.5 for a in failed), st.logs()
    if fail_open:
        assert not failed, [a.detail for a in failed][:5]
        # what the picker could not pick went to Envoy's own round robin over the pool
        assert any(a.worker is None for a in gap)
    else:
        assert failed and {a.status for a in failed} == {500}, Counter(a.status for a in failed)
        err = orjson.loads(failed[0].detail)["error"]
        assert err["type"] == "gateway_error" and err["code"] == 500 and "dplb-epp" in err["message"], err
    # the restarted picker picks again
    late = [a for a in answers if a.t_sent > ev["up"] + 0.5]
    assert len(late) >= 8 and all(a.status == 200 and (a.worker or "").isdigit() for a in late), late[:3]
    # the killed picker's share of the router lines is given back: they return to zero
    wait_for(st.idle, 20, f"router lines back to zero: {st.lines()}")
    assert httpx.get(f"http://127.0.0.1:{st.epp_ports[2]}/metrics", timeout=5).status_code == 200
