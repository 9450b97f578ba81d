"""Smaller truths, one test per lie an operator was told:

- a mirrored remote worker's ``agent_pid`` was the local router's pid (a ``kill`` of it stopped the router);
- exit statuses read 137 in the dump and -9 in ``/dplb/status``, 0 in one view and null in the
  other for an engine that never exited;
- a mirror slot reused for another remote worker kept its predecessor's request counters;
- every 503 of a drain wrote its own WARNING (144 lines in 2 s) and buried the state changes.

(An agent restart counted and logged as such: ``test_agent_dies_engine_lives.py``.)
"""
from __future__ import annotations

import asyncio
import logging
import os

import orjson
import pytest

from dplb_shm import StateReason, WorkerState, dump
from dplb_shm.exits import exit_label, exit_words
from router.access_log import AccessLog
from router.mirror import MirrorManager
from router.repeats import RepeatLimiter
from router.workers import slot_columns

pytestmark = [pytest.mark.faults]

A = "127.0.0.1:9101"
B = "127.0.0.1:9102"


class StateTransport:
    """Answers every ``/dplb/state`` fetch with a READY remote worker."""

    async def get(self, endpoint: str, path: str, timeout: float, method: str = "GET") -> tuple[int, bytes]:
        return 200, orjson.dumps({"state": "ready", "model": "m", "num_running": 0, "num_waiting": 0,
                                  "endpoint": endpoint})


def _dump_rows(segment) -> dict[str, dict[str, str]]:  # type: ignore[no-untyped-def]
    lines = dump.render_table(segment).splitlines()
    head = lines[1].split()
    return {ln.split()[0]: dict(zip(head, ln.split(), strict=False)) for ln in lines[2:]}


def test_a_mirrored_workers_agent_pid_is_not_the_local_routers_pid(segment, tmp_path):
    async def run() -> None:
        m = MirrorManager(segment, StateTransport(), str(tmp_path))
        m.wanted = {A: {"weight": 1.0}}
        assert m.leader()
        slot = m.slot_of(A)
        await m.refresh_one(A)
        s = segment.read_slot(slot)
        assert s.pid == os.getpid() and s.mirrored             # the slot's writer: this router process
        assert s.to_dict()["agent_pid"] is None                # no agent of ours: nothing to kill here
        assert _dump_rows(segment)[str(slot)]["agent_pid"] == "-"
        m.close()

    asyncio.run(run())


def test_a_local_agents_agent_pid_is_its_own(segment):
    w = segment.writer(0)
    w.claim(0, pid=4242, endpoint="/tmp/e-0.sock", control="/tmp/a-0.sock")
    s = segment.read_slot(0)
    assert not s.mirrored and s.to_dict()["agent_pid"] == 4242 and _dump_rows(segment)["0"]["agent_pid"] == "4242"


def test_exit_status_is_spelled_one_way_in_the_dump_the_status_and_the_logs(segment):
    from dplb_shm import now_ns

    killed, never, exited = segment.writer(0), segment.writer(1), segment.writer(2)
    killed.claim(0, pid=100, endpoint="/tmp/e-0.sock", control="/tmp/a-0.sock")
    killed.publish(state=WorkerState.DEAD, state_reason=StateReason.ENGINE_EXITED, last_exit_code=-9)
    never.claim(1, pid=101, endpoint="/tmp/e-1.sock", control="/tmp/a-1.sock")
    never.publish(state=WorkerState.READY)
    exited.claim(2, pid=102, endpoint="/tmp/e-2.sock", control="/tmp/a-2.sock")
    exited.publish(state=WorkerState.READY, restarts=1, last_exit_code=3)
    rows = _dump_rows(segment)
    js = {w["worker_id"]: w for w in orjson.loads(dump.render_json(segment))["workers"]}
    status = {k: slot_columns(segment.read_slot(k), now_ns()) for k in range(3)}
    # a signal: -9 as a number everywhere, SIGKILL as a word; never 137
    assert (rows["0"]["exit"], js[0]["last_exit_code"], status[0]["last_exit_code"]) == ("SIGKILL", -9, -9)
    assert exit_words(-9) == "killed by SIGKILL (-9)" and exit_label(-9) == "SIGKILL"
    # never exited: null in every JSON view, "-" in the table (the dump's JSON said 0)
    assert (rows["1"]["exit"], js[1]["last_exit_code"], status[1]["last_exit_code"]) == ("-", None, None)
    assert (rows["2"]["exit"], js[2]["last_exit_code"], status[2]["last_exit_code"]) == ("3", 3, 3)
    assert exit_words(3) == "exited with status 3" and exit_words(None) == "exited (status unknown)"


def test_a_reused_mirror_slot_starts_with_fresh_counters(segment, tmp_path):
    async def run() -> None:
        m = MirrorManager(segment, StateTransport(), str(tmp_path))
        m.wanted = {A: {"weight": 1.0}}
        assert m.leader()
        slot = m.slot_of(A)
        await m.refresh_one(A)
        segment.outcome_add(slot, completed=7, failed=2)
        segment.latency_observe(slot, ttft_s=0.5, tpot_s=0.05)
        before = segment.read_slot(slot)
        assert (before.completed, before.failed) == (7, 2) and before.router_ttft_s > 0
        m.wanted = {}
        m.reconcile()                                   # A removed: the slot released
        assert int(segment.read_slot(slot).state) == 0
        m.wanted = {B: {"weight": 1.0}}                 # B added: it takes the same slot
        m.reconcile()
        assert m.slot_of(B) == slot
        s = segment.read_slot(slot)
        assert s.control == B and (s.completed, s.failed, s.router_ttft_s, s.router_tpot_s) == (0, 0, 0.0, 0.0)
        m.close()

    asyncio.run(run())


def test_one_warning_per_503_of_a_drain_is_rate_limited_with_a_count(caplog):
    caplog.set_level(logging.WARNING, logger="dplb.router")
    clock = [0.0]
    from router import access_log

    limiter = RepeatLimiter(logging.getLogger("dplb.router"), interval_s=10.0, clock=lambda: clock[0])
    old, access_log.REPEATS = access_log.REPEATS, limiter
    try:
        a = AccessLog("off")
        for i in range(144):                            # the 503s of a drain, 2 s of them
            clock[0] = i * 2.0 / 144
            a.emit(f"r{i}".encode(), "POST", "/v1/chat/completions", "m", "-", 503, 0.001,
                   cause="every worker is draining")
        a.emit(b"x", "POST", "/v1/chat/completions", "m", "1", 502, 0.001, cause="stream broken")
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 2, warned                 # the first 503 and the one 502: the rest held back
        assert "answered 503" in warned[0] and "answered 502" in warned[1]
        clock[0] = 12.0
        limiter.flush()
        summary = caplog.records[-1].getMessage()
        assert summary.startswith('503 "every worker is draining": 143 more like it in the last'), summary
        limiter.flush()                                 # nothing more held back: no line
        assert len(caplog.records) == 3
    finally:
        access_log.REPEATS = old
