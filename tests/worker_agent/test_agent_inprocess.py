"""The agent run in-process (so pynvml can be monkeypatched): NVML figures land in the slot, and a
missing NVML leaves them unknown without stopping the agent."""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import pytest

from tests.worker_agent.conftest import aslot_wait
from tests.worker_agent.test_nvml import GiB, fake_pynvml
from worker_agent.agent import Agent
from worker_agent.config import parse_args


async def run_agent(segment, run_dir, *args):
    cfg = parse_args(["--worker-id", "0", "--shm", segment.name, "--uds", os.path.join(run_dir, "agent-0.sock"),
                      "--engine", "sim", "--state-interval-ms", "50", "--run-dir", run_dir, *args])
    agent = Agent(cfg, segment=segment)
    return agent, asyncio.create_task(agent.run())


async def stop(agent, task):
    agent.request_stop()
    assert await asyncio.wait_for(task, 30) == 0


async def test_fake_nvml_memory_lands_in_slot(segment, run_dir, monkeypatch):
    fake = fake_pynvml({0: (10 * GiB, 80 * GiB), 1: (20 * GiB, 80 * GiB), 2: (70 * GiB, 80 * GiB)})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    agent, task = await run_agent(segment, run_dir, "--gpus", "0,1")
    try:
        s = await aslot_wait(segment, 0, lambda s: s.state.name == "READY", 30, "READY")
        s = await aslot_wait(segment, 0, lambda s: s.gpu_mem_total_bytes > 0, 2, "NVML memory in the slot")
        assert (s.gpu_mem_used_bytes, s.gpu_mem_total_bytes) == (30 * GiB, 160 * GiB)
        assert s.gpu_ids == [0, 1]
        fake.nvmlDeviceGetMemoryInfo = lambda h: type("M", (), {"used": 40 * GiB, "total": 80 * GiB})()
        s = await aslot_wait(segment, 0, lambda s: s.gpu_mem_used_bytes == 80 * GiB, 2, "updated figures")
    finally:
        await stop(agent, task)
    assert "shutdown" in fake.calls
    assert segment.read_slot(0).state.name == "EMPTY"


@pytest.mark.parametrize("module", [None, "driver-missing"])
async def test_missing_nvml_is_unknown_and_agent_still_ready(segment, run_dir, monkeypatch, caplog, module):
    monkeypatch.setitem(sys.modules, "pynvml", None if module is None else fake_pynvml({}, fail_init=True))
    with caplog.at_level(logging.WARNING, logger="worker_agent.nvml"):
        agent, task = await run_agent(segment, run_dir, "--gpus", "0")
        try:
            s = await aslot_wait(segment, 0, lambda s: s.state.name == "READY", 30, "READY")
            h = s.heartbeat_ns
            s = await aslot_wait(segment, 0, lambda s: s.heartbeat_ns > h, 2, "heartbeat keeps going")
            assert (s.gpu_mem_used_bytes, s.gpu_mem_total_bytes) == (-1, -1)
            await asyncio.sleep(0.2)
        finally:
            await stop(agent, task)
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1


async def test_sim_engine_without_gpus_publishes_the_simulated_device(segment, run_dir):
    # no --gpus: the simulated engine's device (80 GiB, 90 % held as vLLM holds it), so the GPU
    # memory series have data without a GPU; with --gpus NVML is read (tests above)
    agent, task = await run_agent(segment, run_dir)
    try:
        s = await aslot_wait(segment, 0, lambda s: s.state.name == "READY" and s.gpu_mem_total_bytes > 0, 30,
                             "READY with memory")
        assert (s.gpu_mem_used_bytes, s.gpu_mem_total_bytes) == (int(0.9 * 80 * GiB), 80 * GiB)
    finally:
        await stop(agent, task)


async def test_a_control_api_that_cannot_load_is_logged_and_refuses_callers(segment, run_dir, monkeypatch, caplog):
    # the control API's modules load in a thread after the claim: a failure there must say so and
    # close the sockets (a caller refused), not leave connections waiting in a backlog forever
    import worker_agent.agent as agent_mod

    def broken() -> None:
        raise ImportError("no module named 'fastapi'")

    monkeypatch.setattr(agent_mod, "load_control_modules", broken)
    with caplog.at_level(logging.ERROR, logger="worker_agent"):
        agent, task = await run_agent(segment, run_dir)
        try:
            await aslot_wait(segment, 0, lambda s: s.state.name == "READY", 30, "READY")
            for _ in range(100):
                if any("control API cannot be served" in r.message for r in caplog.records):
                    break
                await asyncio.sleep(0.1)
            assert any("control API cannot be served" in r.message and r.exc_info and r.exc_info[0] is ImportError
                       for r in caplog.records)
            with pytest.raises(OSError):
                await asyncio.open_unix_connection(os.path.join(run_dir, "agent-0.sock"))
        finally:
            await stop(agent, task)
