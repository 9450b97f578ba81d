"""A disposable DPLB stack for fault scenarios: segment, fake or real workers, routers.

    with Stack() as st:                              # fresh segment + private run dir (0700)
        st.fake(0, "--mode", "ok")                   # tests/fakes.py agent on slot 0
        st.agent(1, time_scale=1.0)                  # python -m worker_agent + sim engine on slot 1
        base = st.router({"router": {...}}, ready=2)  # python -m router on a free loopback port
        ...
    # every process group killed (SIGTERM, then SIGKILL), segment unlinked, run dir removed

Processes are started as ``[sys.executable, "-m", <package>]`` through :class:`tests.helpers.Procs`
(own session each, so ``kill -9`` of a worker takes its engine with it when asked). The same class
serves the pytest scenarios (``tests/faults``) and the counting report (``bench/faults.py``).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from tests.fakes import FakeHandle, start_fake
from tests.helpers import ROOT, Procs, free_port, unique_shm_name, wait_until

MODEL_FAKE = "fake-model"
MODEL_SIM = "sim-llama-3.1-8b"


@dataclass
class AgentHandle:
    """A real worker agent (``python -m worker_agent --engine sim``) and its sim engine.

    ``proc``: the agent's Popen (own process group, engine included); ``uds``: the agent's socket
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


@dataclass
class Stack:
    """Segment ``shm`` (``num_slots`` slots), run dir ``dir`` and every process started for a scenario."""

    num_slots: int = 16
    procs: Procs = field(default_factory=Procs)
    shm: str = field(default_factory=unique_shm_name)
    dir: str = ""
    seg: Any = None
    fakes: dict[int, FakeHandle] = field(default_factory=dict)
    agents: dict[int, AgentHandle] = field(default_factory=dict)
    routers: list[tuple[Any, str]] = field(default_factory=list)

    def __enter__(self) -> Self:
        from dplb_shm import Segment

        self.dir = tempfile.mkdtemp(prefix="dplb-f-", dir="/tmp")
        os.chmod(self.dir, 0o700)
        self.seg = Segment.create(self.shm, num_slots=self.num_slots)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- workers --------------------------------------------------------------------------------
    def fake(self, wid: int, *args: str) -> FakeHandle:
        """Start a fake agent (tests/fakes.py) claiming slot ``wid`` on ``<dir>/fake-<wid>.sock``."""
        h = start_fake(self.procs, self.shm, wid, self.dir, *args)
        wait_until(lambda: self.seg.read_slot(wid).state.name == "READY", 20, what=f"fake {wid} READY")
        self.fakes[wid] = h
        return h

    def agent(self, wid: int, *engine_args: str, time_scale: float = 1.0, interval_ms: int = 50,
              agent_args: tuple[str, ...] = (), wait: bool = True, umask: int = -1) -> AgentHandle:
        """Start ``python -m worker_agent --engine sim`` on slot ``wid`` and wait until READY
        (``umask``: the process's umask, -1 = inherit; 0 shows that modes are set explicitly)."""
        uds = os.path.join(self.dir, f"agent-{wid}.sock")
        log = os.path.join(self.dir, f"agent-{wid}.log")
        argv = [sys.executable, "-m", "worker_agent", "--worker-id", str(wid), "--shm", self.shm, "--uds", uds,
                "--engine", "sim", "--state-interval-ms", str(interval_ms), "--run-dir", self.dir,
                "--log-level", "warning", *agent_args, "--", "--time-scale", str(time_scale), *engine_args]
        p = self.procs.start(argv, log=log, cwd=str(ROOT), umask=umask)
        a = AgentHandle(p, wid, uds, os.path.join(self.dir, f"engine-{wid}.sock"), log)
        self.agents[wid] = a
        if wait:
            try:
                wait_until(lambda: self.seg.read_slot(wid).state.name == "READY" or p.poll() is not None, 60,
                           what=f"agent {wid} READY")
            except TimeoutError:
                raise AssertionError(f"agent {wid} not ready:\n{self.log(log)}") from None
            assert p.poll() is None, f"agent {wid} exited:\n{self.log(log)}"
        return a

    def agents_up(self, n: int, *engine_args: str, **kw: Any) -> list[AgentHandle]:
        """Start agents on slots ``0..n-1`` at once (start-up overlaps), then wait until all are READY."""
        hs = [self.agent(i, *engine_args, wait=False, **kw) for i in range(n)]
        for h in hs:
            p = h.proc
            try:
                wait_until(lambda h=h, p=p: self.seg.read_slot(h.worker_id).state.name == "READY" or p.poll() is not None,
                           60, what=f"agent {h.worker_id} READY")
            except TimeoutError:
                raise AssertionError(f"agent {h.worker_id} not ready:\n{self.log(h.log)}") from None
            assert p.poll() is None, f"agent {h.worker_id} exited:\n{self.log(h.log)}"
        return hs

    def kill(self, proc: Any, sig: int = signal.SIGKILL) -> float:
        """Send ``sig`` to the process group of ``proc``; returns ``time.monotonic()`` of the kill."""
        t = time.monotonic()
        self.procs.kill(proc, sig)
        return t

    # -- routers --------------------------------------------------------------------------------
    def router(self, config: dict[str, Any] | None = None, *args: str, ready: int = 1,
               port: int | None = None, timeout: float = 60.0) -> str:
        """Start ``python -m router`` on ``port`` (a free one when None; reuse one to restart a
        router in place) with ``config`` (a dplb.yaml as a dict); wait until ``/dplb/status`` lists
        ``ready`` eligible workers; returns the base URL."""
        import yaml

        port = port or free_port()
        cfg = dict(config or {})
        r = dict(cfg.get("router", {}))
        r.setdefault("state_dir", os.path.join(self.dir, "router-state"))
        cfg["router"] = r
        path = os.path.join(self.dir, f"router-{port}-{len(self.routers)}.yaml")
        with open(path, "w") as f:
            f.write(yaml.safe_dump(cfg))
        log = os.path.join(self.dir, f"router-{port}.log")
        argv = [sys.executable, "-m", "router", "--config", path, "--host", "127.0.0.1", "--port", str(port),
                "--shm", self.shm, *args]
        p = self.procs.start(argv, log=log, cwd=str(ROOT))
        base = f"http://127.0.0.1:{port}"
        self.routers.append((p, base))

        def up() -> bool:
            if p.poll() is not None:
                return True
            rows = httpx.get(base + "/dplb/status", timeout=2).json()["workers"]
            return sum(1 for w in rows if w["eligible"]) >= ready

        wait_until(up, timeout, what=f"router {base} with {ready} eligible workers")
        if p.poll() is not None:
            raise AssertionError(f"router exited with {p.returncode}:\n{self.log(log)}")
        return base

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

    def close(self) -> None:
        """Kill every process group, unlink the segment, remove the run dir."""
        try:
            self.procs.close()
        finally:
            try:
                if self.seg is not None:
                    self.seg.close()
            finally:
                if os.path.exists(f"/dev/shm/{self.shm}"):
                    os.unlink(f"/dev/shm/{self.shm}")
                if self.dir:
                    shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["MODEL_FAKE", "MODEL_SIM", "AgentHandle", "Stack", "free_port"]
