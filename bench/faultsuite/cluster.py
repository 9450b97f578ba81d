"""A disposable DPLB stack for fault scenarios: segment, fake or real workers, routers.

    with Stack() as st:                              # fresh segment + private run dir (0700)
        st.fake(0, "--mode", "ok")                   # bench/fakes.py agent on slot 0
        st.agent(1, time_scale=1.0)                  # python -m worker_agent + sim engine on slot 1
        base = st.router({"router": {...}}, ready=2)  # python -m router on a free loopback port
        ...
    # every process group killed (SIGTERM, then SIGKILL), segment unlinked, run dir removed

Built on :class:`launcher.stack.Stack` (the launcher's own command lines and process groups: own
session each, so ``kill -9`` of a worker takes its engine with it when asked). The same class
serves the pytest scenarios (``tests/faults``), the counting report (``bench/faults.py``) and the
soak (``bench/soak.py``).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.fakes import FakeHandle, start_fake
from launcher.stack import Stack as BaseStack
from launcher.stack import free_port, wait_for

MODEL_FAKE = "fake-model"
MODEL_SIM = "sim-llama-3.1-8b"


@dataclass
class AgentHandle:
    """A real worker agent (``python -m worker_agent --engine sim``) and its sim engine.

    ``proc``: the agent's :class:`launcher.children.Child` (own process group, engine included); ``uds``: the agent's socket
    (the slot endpoint); ``engine_uds``: the sim engine's private socket (``<run_dir>/engine-K.sock``)."""

    proc: Any
    worker_id: int
    uds: str
    engine_uds: str
    log: str

    def engine_pid(self) -> int:
        """PID of the sim engine (the agent's child); raises LookupError while it has none."""
        import psutil

        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "sim_engine" in " ".join(c.cmdline()):
                    return c.pid
            except psutil.NoSuchProcess:
                continue
        raise LookupError(f"agent {self.worker_id} has no engine process")

    def engine_state(self, timeout: float = 2.0) -> dict[str, Any]:
        """``GET /sim/state`` of the engine, over its own socket (the engine's own view)."""
        with httpx.Client(transport=httpx.HTTPTransport(uds=self.engine_uds), base_url="http://engine",
                          timeout=timeout) as c:
            return c.get("/sim/state").json()


class Stack(BaseStack):
    """:class:`launcher.stack.Stack` (segment, private run dir, process group, routers) plus the fault
    suite's workers: fake agents (:mod:`bench.fakes`) and sim agents wrapped in :class:`AgentHandle`."""

    def __init__(self, num_slots: int = 16) -> None:
        super().__init__(num_slots=num_slots, shm_prefix="dplb-test")
        self.fakes: dict[int, FakeHandle] = {}
        self.agents: dict[int, AgentHandle] = {}

    # -- workers --------------------------------------------------------------------------------
    def fake(self, wid: int, *args: str) -> FakeHandle:
        """Start a fake agent (bench/fakes.py) claiming slot ``wid`` on ``<dir>/fake-<wid>.sock``."""
        h = start_fake(self.procs, self.shm, wid, self.dir, *args)
        wait_for(lambda: self.slot_state(wid) == "READY", 20, f"fake {wid} READY")
        self.fakes[wid] = h
        return h

    def agent(self, wid: int, *engine_args: str, time_scale: float = 1.0, interval_ms: int = 50,
              agent_args: tuple[str, ...] = (), wait: bool = True, umask: int = -1) -> AgentHandle:
        """Start ``python -m worker_agent --engine sim`` on slot ``wid`` and wait until READY
        (``umask``: the process's umask, -1 = inherit; 0 shows that modes are set explicitly)."""
        c = self.start_agent(wid, engine="sim", state_interval_ms=interval_ms, extra=agent_args,
                             engine_args=["--time-scale", str(time_scale), *engine_args], wait=False, umask=umask)
        a = AgentHandle(c, wid, self.path(f"agent-{wid}.sock"), self.path(f"engine-{wid}.sock"), c.log or "")
        self.agents[wid] = a
        if wait:
            self._ready(a)
        return a

    def _ready(self, a: AgentHandle) -> None:
        try:
            self.wait_ready([a.worker_id], 60)
        except (TimeoutError, ChildProcessError) as e:
            raise AssertionError(f"agent {a.worker_id} not ready ({e}):\n{self.log(a.log)}") from None

    def agents_up(self, n: int, *engine_args: str, **kw: Any) -> list[AgentHandle]:
        """Start agents on slots ``0..n-1`` at once (start-up overlaps), then wait until all are READY."""
        hs = [self.agent(i, *engine_args, wait=False, **kw) for i in range(n)]
        for h in hs:
            self._ready(h)
        return hs

    def kill(self, proc: Any, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to the process group of ``proc``; returns ``time.monotonic()`` of the kill."""
        t = time.monotonic()
        self.procs.kill(proc, sig)
        return t

    # -- routers --------------------------------------------------------------------------------
    def router(self, config: dict[str, Any] | None = None, *args: str, ready: int = 1,  # type: ignore[override]
               port: int | None = None, timeout: float = 60.0) -> str:
        """:meth:`launcher.stack.Stack.router`, with the router log's tail in the assertion message
        when it does not come up."""
        try:
            return super().router(config, *args, ready=ready, port=port, timeout=timeout)
        except (TimeoutError, ChildProcessError) as e:
            log = self.routers[-1][0].log if self.routers else None
            raise AssertionError(f"router did not come up ({e}):\n{self.log(log or '')}") from None

    def status(self, base: str) -> list[dict[str, Any]]:
        """Rows of ``GET /dplb/status`` (every worker the router knows)."""
        return httpx.get(base + "/dplb/status", timeout=10).json()["workers"]

    def row(self, base: str, wid: int) -> dict[str, Any] | None:
        """The status row of worker ``wid`` (None when the router does not list it)."""
        for w in self.status(base):
            if w["id"] == wid:
                return w
        return None

    # -- housekeeping ---------------------------------------------------------------------------
    @staticmethod
    def log(path: str) -> str:
        """The tail of a log file (for assertion messages)."""
        try:
            with open(path, errors="replace") as f:
                return f.read()[-4000:]
        except FileNotFoundError:
            return ""


__all__ = ["MODEL_FAKE", "MODEL_SIM", "AgentHandle", "Stack", "free_port"]
