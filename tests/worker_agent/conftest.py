"""Fixtures for agent tests: start a ``python -m worker_agent`` process and talk to it over its socket."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import httpx
import pytest

from launcher.stack import agent_argv
from tests.helpers import wait_until


@dataclass
class AgentProc:
    """A running agent process plus what tests need to reach it."""

    proc: object
    uds: str
    worker_id: int
    run_dir: str
    log: str

    def client(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds), base_url="http://agent", timeout=timeout)

    def aclient(self, timeout: float = 30.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.uds), base_url="http://agent",
                                 timeout=timeout)

    def log_text(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()
        except FileNotFoundError:
            return ""


@pytest.fixture
def start_agent(procs, segment, run_dir):
    """``start_agent(worker_id=0, engine="sim", *args, engine_args=[...])`` → :class:`AgentProc` once READY."""

    def start(worker_id: int = 0, *args: str, engine: str = "sim", engine_args: list[str] | None = None,
              wait_ready: bool = True, interval_ms: int = 100, env: dict | None = None) -> AgentProc:
        uds = os.path.join(run_dir, f"agent-{worker_id}.sock")
        log = os.path.join(run_dir, f"agent-{worker_id}.log")
        argv = agent_argv(worker_id, segment.name, uds, engine=engine, state_interval_ms=interval_ms,
                          run_dir=run_dir, extra=args, engine_args=engine_args or ())
        p = procs.start(argv, log=log, env=env)
        a = AgentProc(p, uds, worker_id, run_dir, log)
        if wait_ready:
            try:
                wait_until(lambda: segment.read_slot(worker_id).state.name == "READY" or p.poll() is not None,
                           timeout=60, what=f"agent {worker_id} READY")
            except TimeoutError:
                raise AssertionError("agent did not become ready:\n" + a.log_text()) from None
            assert p.poll() is None, "agent exited:\n" + a.log_text()
        return a

    return start


def slot_wait(segment, worker_id: int, pred, timeout: float, what: str):
    """Poll slot ``worker_id`` until ``pred(snapshot)``; return the snapshot."""
    box = {}

    def ok():
        s = segment.read_slot(worker_id)
        box["s"] = s
        return pred(s)

    try:
        wait_until(ok, timeout=timeout, interval=0.01, what=what)
    except TimeoutError as e:
        raise AssertionError(f"{e}; last slot: {box.get('s')}") from None
    return box["s"]


def now() -> float:
    return time.monotonic()


async def aslot_wait(segment, worker_id: int, pred, timeout: float, what: str):
    """:func:`slot_wait` for async tests: yields to the event loop between polls."""
    import asyncio

    deadline = time.monotonic() + timeout
    s = segment.read_slot(worker_id)
    while not pred(s):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last slot: {s}")
        await asyncio.sleep(0.01)
        s = segment.read_slot(worker_id)
    return s
