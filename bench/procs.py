"""Child processes of the harness: started in their own process groups, stopped by PID, measured.

Every process the harness starts goes through :class:`ProcessSet`. Each child is the leader of a
new session (``start_new_session=True``), so stopping it means signalling its whole group
(``os.killpg``): an agent's engine or a uvicorn worker dies with its parent. Peers rename
themselves after start (``sglang::router``, ``vllm::router``), which is why nothing here looks a
process up by name: the PID from ``Popen`` is the only handle.

CPU time comes from :mod:`psutil` (user + system seconds of the process and all its live
descendants, threads included).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import psutil

from bench.errors import StartupError

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    """One started process: its name (for messages), the ``Popen`` handle and its log path."""

    name: str
    popen: subprocess.Popen
    log: str | None

    @property
    def pid(self) -> int:
        """PID of the group leader (the process the harness started)."""
        return self.popen.pid

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.popen.poll() is None


@dataclass
class ProcessSet:
    """A set of child processes that are always stopped together.

    ``log_dir`` receives one ``<name>.log`` per child (stdout and stderr) and ``pids.txt`` (one
    ``<pid> <name>`` line per child started, for audits and tests). Use as a context
    manager: leaving the block stops every child (SIGTERM to the group, then SIGKILL after
    ``grace_s``).
    """

    log_dir: Path
    grace_s: float = 3.0
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, args: Sequence[str], env: dict[str, str] | None = None,
              cwd: str | None = None) -> Child:
        """Start ``args`` as the leader of a new session; output goes to ``<log_dir>/<name>.log``.

        Raises :class:`StartupError` if the executable cannot be run at all.
        """
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = str(self.log_dir / f"{name}.log")
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        with open(log, "ab") as out:
            try:
                p = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env=full_env, cwd=cwd)
            except OSError as e:
                raise StartupError(name, f"cannot start {args[0]!r}: {e}") from e
        child = Child(name, p, log)
        self.children.append(child)
        with open(self.log_dir / "pids.txt", "a") as f:  # audit trail: every PID this set started
            f.write(f"{p.pid} {name}\n")
        return child

    def stop(self, child: Child) -> None:
        """Stop one child and its process group: SIGTERM, wait ``grace_s``, then SIGKILL."""
        _signal_group(child.pid, signal.SIGTERM)
        try:
            child.popen.wait(self.grace_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(child.pid, signal.SIGKILL)
        try:
            child.popen.wait(5)
        except subprocess.TimeoutExpired:
            pass
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        """Stop every child (newest first, all SIGTERMed before any is waited for)."""
        self.stop_many(list(self.children))

    def stop_many(self, kids: Sequence[Child]) -> None:
        """Stop ``kids`` together: SIGTERM every group (newest first), wait up to ``grace_s`` for
        all of them at once, then SIGKILL what is left of each group."""
        kids = list(reversed(kids))
        for c in kids:
            _signal_group(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for c in kids:
            try:
                c.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in kids:
            _signal_group(c.pid, signal.SIGKILL)
            try:
                c.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
            if c in self.children:
                self.children.remove(c)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` and their live descendants.

    Processes that have gone away count as 0 (their time is lost, which is why the harness reads
    this while the system is still running).
    """
    total = 0.0
    seen: set[int] = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.1,
               children: Sequence[Child] = ()) -> object:
    """Poll ``pred()`` until truthy; raise :class:`StartupError` on timeout or if a child dies.

    ``children``: processes that must stay alive while waiting (their log is quoted on failure).
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for c in children:
            if not c.alive():
                raise StartupError(c.name, f"exited with code {c.popen.returncode} while waiting for {what}", c.log)
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - polled predicates fail while things start
            last = e
        time.sleep(interval)
    log = children[0].log if children else None
    raise StartupError(what, f"not ready after {timeout:.0f} s" + (f" (last error: {last!r})" if last else ""), log)
