"""Shared test helpers: free ports, child processes that are always reaped, waiting for sockets.

Every process started through :class:`Procs` (the launcher's :class:`launcher.stack.ProcessGroup`)
runs in its own session (process group) and is killed with its whole group at teardown, even when
the test fails.
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from bench.trace import DEFAULT_TRACE as TRACE  # noqa: F401  (the in-repository Mooncake trace)
from launcher.stack import (  # noqa: F401  (one of each for the launcher, the harness and the tests)
    ProcessGroup,
    free_port,
    wait_for_port,
    wait_for_unix_socket,
)
from launcher.stack import unique_shm_name as _unique_shm_name

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def unique_shm_name(prefix: str = "dplb-test") -> str:
    """A segment name no other test uses (``dplb-test-<8 hex>``)."""
    return _unique_shm_name(prefix)


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


#: every process a test starts goes through the launcher's process-group manager (own session each,
#: the whole group SIGTERMed then SIGKILLed at ``close()``); the ``procs`` fixture closes it at teardown
Procs = ProcessGroup


def shm_leftovers(prefix: str = "dplb-test") -> list[str]:
    """Names in /dev/shm that start with ``prefix``."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except FileNotFoundError:
        return []


def metric(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples ``name`` whose labels include ``labels`` in Prometheus exposition
    ``text``; None when there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    total = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total = (total or 0.0) + float(s.value)
    return total


def promtool() -> str | None:
    """Path of Prometheus's ``promtool`` (Debian package ``prometheus``; ``.ci/run`` installs it)."""
    import shutil

    return shutil.which("promtool")


class FakeClient:
    """A client transport as the native relay (router._relay.ChunkRelay) sees it: ``write`` (its
    chunk frames collect in ``out``), ``disconnected`` and ``write_paused`` (uvicorn's cycle and
    flow control)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.disconnected = False
        self.write_paused = False

    def write(self, b: bytes) -> None:
        self.out.append(b)

    def body(self) -> bytes:
        """The payload of every chunk frame written (each write is exactly one frame)."""
        got = b""
        for w in self.out:
            size, _, rest = w.partition(b"\r\n")
            n = int(size, 16)
            assert n > 0 and rest[n:] == b"\r\n" and len(rest) == n + 2
            got += rest[:n]
        return got


class RecordingTransport(asyncio.Transport):
    """The client side of an in-process connection to the router's protocol: keeps what the
    protocol writes (``writes``, one bytes object per write)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def get_extra_info(self, name, default=None):  # type: ignore[no-untyped-def]
        return {"sockname": ("127.0.0.1", 1), "peername": ("127.0.0.1", 2)}.get(name, default)

    def write(self, data) -> None:  # type: ignore[no-untyped-def]
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass
