"""The engine adapter interface and the process handling every spawning adapter shares.

An adapter answers five questions for the agent: how to start (or attach to) its engine
(:meth:`EngineAdapter.start`), when the engine is ready (:meth:`EngineAdapter.wait_ready`: its
health endpoint answers and a warm-up request succeeds), where to forward requests
(:attr:`EngineAdapter.address`), what the engine's live state is (:meth:`EngineAdapter.probe`), and
how to stop it (:meth:`EngineAdapter.stop`). Command line and environment are pure functions of
the config (:meth:`EngineAdapter.command`, :meth:`EngineAdapter.env_overrides`) so tests check them
without starting anything.

Spawned engines run in their own session (so stopping one stops its whole process tree, e.g. vLLM's
EngineCore processes) and **outlive their agent**: an agent that dies (kill -9, a crash) leaves its
engine serving, since requests never pass through the agent (routers forward to the engine's own
address). Each spawned engine's pid, start time and address are kept in ``<run-dir>/engine-<K>.pid``
(``<pid> <start time, s since the epoch> <address>``). An agent started in a dead one's place (the
launcher restarts it) re-attaches to that engine when it still runs — same pid, same start time (a
pid reused by another process is not mistaken for it) — instead of starting a fresh one
(:meth:`EngineAdapter.start`): the requests the engine is serving go on, its KV cache and loaded
model are kept. Only an engine that is gone (or does not answer within the start timeout) is
started again. An agent that stops cleanly (SIGTERM) stops its engine, as before.

Writes to the run dir are best effort: on a full file system (``ENOSPC``) the pid file or the
engine's log may be missing, the engine is started all the same (logging degrades, serving does
not); without its pid file the engine cannot be re-attached after another agent death.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from abc import ABC, abstractmethod
from typing import ClassVar

import orjson
import psutil

from ..config import ENGINE_STOP_GRACE_S, AgentConfig
from ..errors import EngineExitedError, EngineStartError, UpstreamError
from ..metrics import EngineMetrics, MetricNames, parse_engine_metrics
from ..upstream import EngineAddress, Upstream

log = logging.getLogger("worker_agent.engine")


def parse_address(text: str) -> EngineAddress | None:
    """An :class:`EngineAddress` from its ``str()`` form (``unix:/path`` or ``http://host:port``);
    None for anything else."""
    if text.startswith("unix:/"):
        return EngineAddress(uds=text[len("unix:"):])
    if text.startswith("http://"):
        return EngineAddress(url=text)
    return None


def _same_process(pid: int, started: float) -> psutil.Process | None:
    """The running process ``pid`` when it started at ``started`` (s since the epoch, as
    ``psutil`` reports it; 10 ms tolerance); None when it exited, is a zombie, or the pid now names
    another process (reused)."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - started) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
            return None
    except psutil.Error:
        return None
    return p


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the engine binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineAdapter(ABC):
    """One engine behind one agent. Subclasses set :attr:`name` and :attr:`metric_names`.

    Args:
        cfg: the agent's config (model, GPUs, TP size, run dir, pass-through engine args).

    Attributes:
        address: where requests go (set by the constructor or by :meth:`start`).
        upstream: the pooled client to :attr:`address`.
        served_model: model name the engine serves (learned from ``/v1/models`` during readiness).
    """

    name: ClassVar[str] = "?"
    #: metric families read from ``/metrics`` (None: the engine has none)
    metric_names: ClassVar[MetricNames | None] = None
    #: path polled for readiness before the warm-up request
    health_path: ClassVar[str] = "/health"
    #: seconds between readiness polls
    poll_interval_s: ClassVar[float] = 0.5
    #: the engine's TCP port (adapters whose engine listens on TCP set it)
    port: int = 0

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.proc: asyncio.subprocess.Process | None = None
        self.address: EngineAddress = self._make_address()
        self.upstream = Upstream(self.address)
        self.served_model: str | None = cfg.model
        self._log_file: int | None = None
        self._metrics_missing = False
        self._adopted: psutil.Process | None = None   # a previous agent's engine, re-attached
        self._adopted_started = 0.0

    # -- pure description (tested without starting anything) ------------------------------
    @abstractmethod
    def _make_address(self) -> EngineAddress:
        """The address the engine will listen on (chooses a private port or socket path)."""

    def command(self) -> list[str] | None:
        """argv that starts the engine, or None for adapters that attach to a running server."""
        return None

    def simulated_gpu_memory(self) -> tuple[int, int] | None:
        """``(used, total)`` bytes of a simulated device, for an engine without a GPU (the sim
        engine); None for real engines (their memory comes from NVML or is unknown)."""
        return None

    def env_overrides(self) -> dict[str, str]:
        """Environment variables set for the engine on top of the agent's own environment."""
        env: dict[str, str] = {}
        if self.cfg.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.cfg.gpus)
        return env

    def environment(self) -> dict[str, str]:
        """The engine's full environment: the agent's plus :meth:`env_overrides`."""
        env = dict(os.environ)
        env.update(self.env_overrides())
        return env

    @property
    def log_path(self) -> str:
        """File the engine's stdout and stderr go to (``<run-dir>/engine-<K>.log``)."""
        return os.path.join(self.cfg.run_dir, f"engine-{self.cfg.worker_id}.log")

    @property
    def pid_path(self) -> str:
        """``<run-dir>/engine-<K>.pid``: ``<pid> <start time, s since the epoch>`` of the spawned
        engine while it runs (module docstring)."""
        return os.path.join(self.cfg.run_dir, f"engine-{self.cfg.worker_id}.pid")

    def _write_pid_file(self, pid: int) -> None:
        """Record the spawned engine (``<pid> <start time> <address>``) for an agent started in
        this one's place; best effort (a full file system only costs the re-attachment)."""
        try:
            started = psutil.Process(pid).create_time()
        except psutil.Error:
            return   # already gone: wait_ready reports its exit
        tmp = self.pid_path + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{pid} {started!r} {self.address}\n")
            os.replace(tmp, self.pid_path)
        except OSError as e:
            log.warning("worker %d: cannot record the engine's pid in %s (%s): a later agent cannot re-attach "
                        "to it", self.cfg.worker_id, self.pid_path, e)
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def _remove_pid_file(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.pid_path)

    def _read_pid_file(self) -> tuple[int, float, EngineAddress | None] | None:
        """``(pid, start time, address)`` from the pid file (address None in a file without
        one); None when there is no readable file."""
        try:
            with open(self.pid_path) as f:
                parts = f.read().split()
            pid, started = int(parts[0]), float(parts[1])
        except (OSError, ValueError, IndexError):
            return None
        return pid, started, parse_address(parts[2]) if len(parts) > 2 else None

    def previous_engine(self) -> psutil.Process | None:
        """The engine a previous agent of this worker started, when it still runs (the pid file
        names it and the process of that pid started at the recorded time); else None."""
        rec = self._read_pid_file()
        if rec is None:
            return None
        pid, started, _ = rec
        if self.proc is not None and pid == self.proc.pid:
            return None   # our own engine
        return _same_process(pid, started)

    def _can_adopt(self, addr: EngineAddress | None) -> bool:
        """True when an engine recorded at ``addr`` is where this agent's config would put its own
        (the same socket path; a TCP address on the same host)."""
        if addr is None:
            return False
        mine = self.address
        if mine.uds or addr.uds:
            return mine.uds == addr.uds
        from yarl import URL

        return URL(str(mine.url)).host == URL(str(addr.url)).host

    def adopt_previous(self) -> bool:
        """Re-attach to the engine a previous (dead) agent of this worker started, when it still
        runs at the address this agent would use (module docstring). Returns True when adopted:
        :attr:`address` is the engine's, :attr:`engine_pid` its pid, :meth:`stop` stops it."""
        rec = self._read_pid_file()
        if rec is None:
            return False
        pid, started, addr = rec
        p = _same_process(pid, started)
        if p is None or not self._can_adopt(addr):
            return False
        assert addr is not None
        self._adopted = p
        self._adopted_started = started
        if addr != self.address:
            self.address = addr
            self.upstream = Upstream(addr)
            if addr.url:
                from yarl import URL

                self.port = int(URL(addr.url).port or 80)
        log.warning("worker %d: re-attaching to engine %s (pid %d) that a previous agent started; it kept "
                    "serving while no agent ran", self.cfg.worker_id, self.name, pid)
        return True

    @property
    def adopted(self) -> bool:
        """True when the engine is one a previous agent started (:meth:`adopt_previous`)."""
        return self._adopted is not None

    def _adopted_alive(self) -> bool:
        p = self._adopted
        return p is not None and _same_process(p.pid, self._adopted_started) is not None

    async def stop_previous(self, timeout_s: float = 15.0) -> bool:
        """Stop what still runs of the engine a previous (dead) agent of this worker started when
        it cannot be re-attached (another address): SIGTERM to its process group, SIGKILL after
        ``timeout_s`` seconds. Returns True when there was one. The pid file is removed either way."""
        p = self.previous_engine()
        if p is None:
            self._remove_pid_file()
            return False
        log.warning("worker %d: the engine a previous agent started (pid %d) still runs; stopping it before "
                    "starting a fresh one", self.cfg.worker_id, p.pid)
        self._signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.previous_engine() is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.previous_engine() is not None:
            log.warning("worker %d: previous engine (pid %d) ignored SIGTERM for %.0fs; killing it",
                        self.cfg.worker_id, p.pid, timeout_s)
        self._signal_group(p.pid, signal.SIGKILL)   # and whatever it left in its group
        self._remove_pid_file()
        return True

    def _before_spawn(self) -> None:
        """Hook run right before a fresh engine is spawned (e.g. remove a stale socket file)."""

    def _open_log(self) -> int:
        """The engine's log file, opened for appending; ``/dev/null`` when the run dir refuses it."""
        try:
            return os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        except OSError as e:
            log.warning("worker %d: cannot open the engine log %s (%s); the engine's output is discarded",
                        self.cfg.worker_id, self.log_path, e)
            return os.open(os.devnull, os.O_WRONLY)

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Re-attach to a previous agent's engine that still runs (:meth:`adopt_previous`), else
        spawn the engine (no-op for attaching adapters), after stopping what still runs of a
        previous agent's engine at another address (:meth:`stop_previous`).

        Raises:
            EngineStartError: the executable cannot be started.
        """
        argv = self.command()
        if argv is None:
            return
        with contextlib.suppress(OSError):
            os.makedirs(self.cfg.run_dir, exist_ok=True)
        if self.adopt_previous():
            return
        await self.stop_previous()
        self._before_spawn()
        self._log_file = self._open_log()
        log.info("starting engine %s: %s (log %s)", self.name, " ".join(argv), self.log_path)
        try:
            # its own session: stopping it stops its whole tree; no PR_SET_PDEATHSIG: it outlives
            # a dead agent and the next one re-attaches (module docstring)
            self.proc = await asyncio.create_subprocess_exec(
                *argv, env=self.environment(), stdin=asyncio.subprocess.DEVNULL, stdout=self._log_file,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        except OSError as e:
            raise EngineStartError(f"cannot start {argv[0]}: {e}", engine=self.name,
                                   worker_id=self.cfg.worker_id) from e
        self._write_pid_file(self.proc.pid)

    @property
    def engine_pid(self) -> int:
        """pid of the engine process this adapter spawned while it runs; 0 when there is none
        (an attaching adapter, not started yet, or exited)."""
        if self._adopted is not None:
            return int(self._adopted.pid) if self._adopted_alive() else 0
        if self.proc is None or self.proc.returncode is not None:
            return 0
        return int(self.proc.pid)

    @property
    def returncode(self) -> int | None:
        """Exit code of the engine process; None while it runs (or when there is no process)."""
        return None if self.proc is None else self.proc.returncode

    async def wait_exit(self) -> int | None:
        """Wait until the engine process exits and return its exit code (negative: signal); None
        for a re-attached engine (not this agent's child: its status goes to its reaper).

        Attaching adapters have no process: this waits forever (cancel it).
        """
        if self._adopted is not None:
            while self._adopted_alive():
                await asyncio.sleep(0.1)
            return None
        if self.proc is None:
            await asyncio.Event().wait()
        assert self.proc is not None
        return await self.proc.wait()

    def _check_alive(self) -> None:
        if self._adopted is not None and not self._adopted_alive():
            raise EngineExitedError(None, engine=self.name, worker_id=self.cfg.worker_id)
        if self.proc is not None and self.proc.returncode is not None:
            raise EngineExitedError(self.proc.returncode, engine=self.name, worker_id=self.cfg.worker_id)

    async def wait_ready(self, timeout_s: float) -> str:
        """Wait until the engine answers its health path, learn its model name, send a warm-up.

        Args:
            timeout_s: overall bound in seconds.

        Returns:
            The served model name (``/v1/models`` ``data[0].id``, else ``--model``, else ``""``).

        Raises:
            EngineStartError: timed out, or the warm-up request failed.
            EngineExitedError: the engine process exited meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            self._check_alive()
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine not healthy after {timeout_s:.0f}s ({last})",
                                       engine=self.name, worker_id=self.cfg.worker_id)
            try:
                status, _ = await self.upstream.get(self.health_path, timeout_s=5.0)
                if status == 200:
                    break
                last = f"{self.health_path} answered {status}"
            except UpstreamError as e:
                last = str(e)
            await asyncio.sleep(self.poll_interval_s)
        self.served_model = await self._served_model()
        await self.warm_up(max(1.0, deadline - time.monotonic()))
        return self.served_model or ""

    async def _served_model(self) -> str | None:
        try:
            status, body = await self.upstream.get("/v1/models", timeout_s=10.0)
            if status == 200:
                data = orjson.loads(body).get("data") or []
                if data and isinstance(data[0], dict) and data[0].get("id"):
                    return str(data[0]["id"])
        except (UpstreamError, orjson.JSONDecodeError, AttributeError):
            pass
        return self.cfg.model

    def warm_up_request(self) -> tuple[str, dict]:
        """``(path, json body)`` of the warm-up request: a one-token completion."""
        body: dict = {"prompt": "Hello", "max_tokens": 1, "temperature": 0.0}
        if self.served_model:
            body["model"] = self.served_model
        return "/v1/completions", body

    async def warm_up(self, timeout_s: float) -> None:
        """Send the warm-up request; the first request also pays one-off costs (graphs, kernels).

        Raises:
            EngineStartError: the engine answered with an error or not at all.
        """
        self._check_alive()
        path, body = self.warm_up_request()
        try:
            status, resp = await self.upstream.get(path, timeout_s=timeout_s, json_body=body, method="POST")
        except UpstreamError as e:
            self._check_alive()
            raise EngineStartError(f"warm-up request failed: {e}", engine=self.name,
                                   worker_id=self.cfg.worker_id) from e
        if status != 200:
            raise EngineStartError(f"warm-up {path} answered {status}: {resp[:300]!r}", engine=self.name,
                                   worker_id=self.cfg.worker_id)

    async def probe(self) -> EngineMetrics:
        """Read the engine's live state from ``/metrics``.

        Returns:
            :class:`EngineMetrics`; all ``None`` when the engine has no metrics endpoint (the
            agent then falls back on its own counters).

        Raises:
            UpstreamError: the engine did not answer within the timeout.
        """
        if self.metric_names is None or self._metrics_missing:
            return EngineMetrics()
        status, body = await self.upstream.get("/metrics", timeout_s=max(1.0, 5 * self.cfg.state_interval_s))
        if status == 404:
            self._metrics_missing = True
            log.warning("engine %s has no /metrics; using the agent's own counters", self.name)
            return EngineMetrics()
        if status != 200:
            return EngineMetrics()
        try:
            return parse_engine_metrics(body.decode("utf-8", "replace"), self.metric_names)
        except ValueError as e:
            log.warning("cannot parse engine /metrics: %s", e)
            return EngineMetrics()

    async def stop(self, timeout_s: float = ENGINE_STOP_GRACE_S) -> int | None:
        """Stop the engine: SIGTERM to its process group, SIGKILL after ``timeout_s``.

        Returns:
            The exit code, or None when there was no process (or a re-attached one: not this
            agent's child, its status is its reaper's).
        """
        await self.upstream.close()
        proc = self.proc
        rc: int | None = None
        if self._adopted is not None:
            pid = self._adopted.pid
            if self._adopted_alive():
                self._signal_group(pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout_s
                while self._adopted_alive() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                if self._adopted_alive():
                    log.warning("engine %s ignored SIGTERM for %.0fs; killing it", self.name, timeout_s)
            self._signal_group(pid, signal.SIGKILL)   # and whatever it left in its group
            self._adopted = None
            self._remove_pid_file()
        elif proc is not None:
            if proc.returncode is None:
                self._signal_group(proc.pid, signal.SIGTERM)
                try:
                    rc = await asyncio.wait_for(proc.wait(), timeout_s)
                except TimeoutError:
                    log.warning("engine %s ignored SIGTERM for %.0fs; killing it", self.name, timeout_s)
                    rc = None
            # whatever it left in its group (vLLM's EngineCore, SGLang's scheduler) goes too
            self._signal_group(proc.pid, signal.SIGKILL)
            if rc is None:
                rc = await proc.wait()
            else:
                rc = proc.returncode
            self._remove_pid_file()
        if self._log_file is not None:
            os.close(self._log_file)
            self._log_file = None
        return rc

    @staticmethod
    def _signal_group(pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
