"""Shared test helpers: free ports, child processes that are always reaped, waiting for sockets.

Every process started through :class:`Procs` runs in its own session (process group) and is
SIGKILLed with its whole group at teardown, even when the test fails.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
from bench.trace import DEFAULT_TRACE as TRACE  # noqa: E402  (the in-repository Mooncake trace)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def unique_shm_name(prefix: str = "dplb-test") -> str:
    """A segment name no other test uses (``dplb-test-<8 hex>``)."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def script(name: str) -> str:
    """Path of a console script installed in the running interpreter's environment."""
    p = BIN / name
    return str(p) if p.exists() else name


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``pred()`` until it returns a truthy value; raise TimeoutError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - polled predicates may fail while things start
            last_exc = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else ""))


def wait_for_unix_socket(path: str | os.PathLike, timeout: float = 15.0) -> None:
    """Wait until something accepts connections on the Unix socket ``path``."""
    def ok() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            s.connect(str(path))
            return True
    wait_until(ok, timeout, what=f"unix socket {path}")


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    """Wait until something accepts TCP connections on ``host:port``."""
    def ok() -> bool:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    wait_until(ok, timeout, what=f"{host}:{port}")


class Procs:
    """Starts child processes in their own process groups and kills them all on ``close()``.

    Use as a context manager or through the ``procs`` fixture in ``tests/conftest.py``.
    """

    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def start(self, args: Sequence[str], log: str | os.PathLike | None = None, env: dict | None = None,
              **kw) -> subprocess.Popen:
        out = open(log, "ab") if log else subprocess.DEVNULL
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        p = subprocess.Popen(list(args), stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                             start_new_session=True, env=full_env, **kw)
        self.children.append(p)
        return p

    def kill(self, p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        for p in self.children:
            if p.poll() is None:
                self.kill(p, signal.SIGTERM)
        deadline = time.monotonic() + 3
        for p in self.children:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # the group may still hold grandchildren (engines under agents): kill it whole
            self.kill(p, signal.SIGKILL)
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                pass
        self.children.clear()

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def shm_leftovers(prefix: str = "dplb-test") -> list[str]:
    """Names in /dev/shm that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []
