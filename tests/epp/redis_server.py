"""A real ``redis-server`` (Debian's package, installed by .ci/run) for the tests of the picker
replicas' shared state: loopback only, a free port, no persistence (``--save ''``, ``--appendonly
no``), its working directory a test's own; started and stopped through the tests' process group, so
it is killed at teardown even when a test fails."""
from __future__ import annotations

import shutil
import socket
import time

from launcher.stack import ProcessGroup, free_port, wait_for


def redis_argv(port: int, workdir: str) -> list[str]:
    """The command line of a throwaway Redis on ``127.0.0.1:port``."""
    return ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", workdir, "--daemonize", "no", "--protected-mode", "yes", "--loglevel", "warning"]


def ping(port: int) -> bool:
    """True when a Redis answers PING on ``127.0.0.1:port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` in ``procs`` (:meth:`start`, :meth:`stop`, :meth:`start` again on the
    same port); ``url``: its ``redis://`` URL. Raises RuntimeError when redis-server is not installed."""

    def __init__(self, procs: ProcessGroup, workdir: str, port: int | None = None) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server; .ci/run does)")
        self.procs = procs
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.child = None

    def start(self) -> RedisServer:
        """Start it and wait (bounded) until it answers PING."""
        self.child = self.procs.start(redis_argv(self.port, self.workdir), log=f"{self.workdir}/redis-{self.port}.log")
        wait_for(lambda: ping(self.port), 30, f"redis-server on port {self.port}", children=[self.child])
        return self

    def stop(self) -> None:
        """Kill it (SIGKILL: as a crash) and wait until its port refuses connections."""
        if self.child is not None:
            self.procs.kill(self.child)
            self.child.popen.wait(timeout=30)
            self.procs.children.remove(self.child)
            self.child = None
        deadline = time.monotonic() + 30
        while ping(self.port) and time.monotonic() < deadline:
            time.sleep(0.05)
