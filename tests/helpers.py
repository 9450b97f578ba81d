"""Shared test helpers: free ports, child processes that are always reaped, waiting for sockets.

Every process started through :class:`Procs` (the launcher's :class:`launcher.stack.ProcessGroup`)
runs in its own session (process group) and is killed with its whole group at teardown, even when
the test fails.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dplb_trace.mooncake import DEFAULT_TRACE as TRACE  # noqa: F401  (the in-repository Mooncake trace)
from launcher.stack import (  # noqa: F401  (one of each for the launcher, the harness and the tests)
    ProcessGroup,
    free_port,
    wait_for,
    wait_for_port,
    wait_for_unix_socket,
)
from launcher.stack import unique_shm_name as _unique_shm_name

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def unique_shm_name(prefix: str = "dplb-test") -> str:
    """A segment name no other test uses (``dplb-test-<8 hex>``)."""
    return _unique_shm_name(prefix)


@contextlib.contextmanager
def ready_segment(workers: int, heartbeat_ns: int, num_slots: int = 8, endpoint: str = "/tmp/dplb-t/{}.sock") -> Iterator[Any]:
    """A fresh segment whose first ``workers`` slots are claimed and READY (KV usage 0.1, the given
    heartbeat time), unlinked on the way out even when the test failed."""
    from dplb_shm import Segment, WorkerState

    name = unique_shm_name()
    s = Segment.create(name, num_slots=num_slots)
    try:
        for i in range(workers):
            w = s.writer(i)
            w.claim(i, endpoint=endpoint.format(i))
            w.publish(state=WorkerState.READY, kv_cache_usage=0.1, heartbeat_ns=heartbeat_ns)
        yield s
    finally:
        s.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


@contextlib.contextmanager
def sim_agents_and_router(workers: int, engine_args: list[str], config: dict[str, Any] | None = None,
                          prefix: str = "dplb-rs-") -> Iterator[tuple[str, Any]]:
    """A segment, ``workers`` worker agents driving simulated engines (``engine_args``) and a router
    over them (``config``: a dplb.yaml as a dict); yields ``(base url, segment)`` once every worker
    is eligible. Every process, the segment and the directory go on the way out."""
    import shutil
    import tempfile

    from bench.fakes import start_router
    from dplb_shm import Segment
    from launcher.stack import agent_argv

    procs = Procs()
    shm = unique_shm_name()
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    seg = Segment.create(shm, num_slots=16)
    try:
        for i in range(workers):
            procs.start(agent_argv(i, shm, os.path.join(d, f"agent-{i}.sock"), engine="sim", state_interval_ms=100,
                                   run_dir=d, engine_args=engine_args), log=os.path.join(d, f"agent-{i}.log"))
        wait_until(lambda: all(seg.read_slot(i).state.name == "READY" for i in range(workers)), 90,
                   what=f"{workers} agents READY")
        cfg = {"router": {"log_level": "warning"}, **(config or {})}
        yield start_router(procs, shm, d, cfg, ready_workers=workers, timeout=60), seg
    finally:
        procs.close()
        seg.close()
        if os.path.exists(f"/dev/shm/{shm}"):
            os.unlink(f"/dev/shm/{shm}")
        shutil.rmtree(d, ignore_errors=True)


def script(name: str) -> str:
    """Path of a console script installed in the running interpreter's environment."""
    p = BIN / name
    return str(p) if p.exists() else name


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``pred()`` until it returns a truthy value (:func:`launcher.stack.wait_for`, the one
    polling loop, with the tests' defaults); raises ``TimeoutError`` after ``timeout`` s."""
    return wait_for(pred, timeout, what, interval=interval)


async def until(pred, timeout: float = 20.0, what: str = "condition", interval: float = 0.005) -> None:
    """:func:`wait_until` for a test's event loop: await ``asyncio.sleep(interval)`` until ``pred()``
    is truthy (bounded, busy-machine friendly); raises ``AssertionError`` naming ``what`` after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)


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


@contextlib.contextmanager
def in_process_router(loop: asyncio.AbstractEventLoop, endpoint: str) -> Iterator[tuple[Any, Any, Callable[..., Any]]]:
    """The real router app, started on ``loop`` (lifespan on) over a fresh segment with one ready
    worker (slot 0, model ``m``, at ``endpoint``), health checks off. Yields ``(app, segment,
    make)``, ``make(client_transport)`` → a connected :class:`router.server.LimitedHttpToolsProtocol`
    driven by hand on ``loop``. Shuts the app down and removes the segment on the way out."""
    import uvicorn
    from uvicorn.lifespan.on import LifespanOn
    from uvicorn.server import ServerState

    from dplb_shm import Segment, WorkerState
    from router.app import create_app
    from router.config import load_config
    from router.server import LimitedHttpToolsProtocol

    name = unique_shm_name()
    seg = Segment.create(name, num_slots=4)
    lifespan = None
    try:
        w = seg.writer(0)
        w.claim(worker_id=0, pid=os.getpid(), endpoint=endpoint, model="m", max_num_seqs=64)
        w.set_state(WorkerState.READY)
        w.heartbeat()
        # the slot is beaten once: a long heartbeat timeout keeps it routable on a loaded machine
        cfg = load_config(None, {"router.shm": name, "health_check.enabled": False,
                                 "health_check.heartbeat_timeout_ms": 600_000})
        app = create_app(cfg, seg)
        ucfg = uvicorn.Config(app, http=LimitedHttpToolsProtocol, lifespan="on", log_level="critical",
                              access_log=False, proxy_headers=False)
        ucfg.load()
        lifespan = LifespanOn(ucfg)
        loop.run_until_complete(lifespan.startup())

        def make(client: asyncio.Transport) -> LimitedHttpToolsProtocol:
            proto = LimitedHttpToolsProtocol(config=ucfg, server_state=ServerState(), app_state={}, _loop=loop)
            proto.connection_made(client)
            return proto

        yield app, seg, make
    finally:
        if lifespan is not None:
            loop.run_until_complete(lifespan.shutdown())
        seg.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def alive(pids) -> list[int]:  # type: ignore[no-untyped-def]
    """Those of ``pids`` still running (not zombies), sorted."""
    import psutil

    out = []
    for pid in sorted(pids):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


class Launch:
    """``scripts/launch_dplb.sh`` started by :func:`launched`: ``proc`` (the launcher), ``port``,
    ``run_dir`` (its ``--run-dir``), ``log`` (its output)."""

    def __init__(self, proc: Any, port: int, run_dir: Path, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.run_dir = run_dir
        self.log = log

    @property
    def shm(self) -> str:
        """The launch's segment name."""
        return f"dplb-{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL on the launch's port."""
        return f"http://127.0.0.1:{self.port}/v1"

    def out(self) -> str:
        """The launcher's output so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tree(self) -> list[int]:
        """Pids of the launcher's descendants now."""
        import psutil

        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def logs(self) -> str:
        """The launcher's output and every log of the run dir, tails (assertion messages)."""
        parts = [f"--- launcher ---\n{self.out()[-3000:]}"]
        for p in sorted(self.run_dir.glob("*.log")):
            parts.append(f"--- {p.name} ---\n{p.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)


@contextlib.contextmanager
def launched(*args: str, port: int | None = None, ready_timeout: float = 300.0, prefix: str = "dplb-t-",
             seen: set[int] | None = None) -> Iterator[Launch]:
    """Run ``bash scripts/launch_dplb.sh --port P --run-dir D *args`` (this interpreter as
    ``DPLB_PYTHON``) and yield a :class:`Launch` once its ``DPLB ready`` banner is out (AssertionError
    with the logs when it exits before). On the way out, even when the test failed: SIGINT and up
    to 60 s for the launcher, then SIGKILL of every descendant ever seen (``seen``: the caller's
    set, which the caller may add pids to), the segment and the directories removed."""
    import shutil
    import signal
    import subprocess
    import tempfile

    port = port or free_port()
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    launch = Launch(None, port, base / "rd", base / "launch.out")
    procs = Procs()
    seen = set() if seen is None else seen
    try:
        launch.proc = procs.start(["bash", str(ROOT / "scripts" / "launch_dplb.sh"), "--port", str(port),
                                   "--run-dir", str(launch.run_dir), *args],
                                  log=launch.log, env={"DPLB_PYTHON": sys.executable}, cwd=ROOT)
        wait_until(lambda: "DPLB ready" in launch.out() or launch.proc.poll() is not None, timeout=ready_timeout,
                   interval=0.2, what="the launch's ready banner")
        assert launch.proc.poll() is None, "launch exited before ready:\n" + launch.logs()
        seen.update(launch.tree())
        yield launch
    finally:
        if launch.proc is not None:
            seen.update(launch.tree())
            if launch.proc.poll() is None:
                os.kill(launch.proc.pid, signal.SIGINT)
                try:
                    launch.proc.wait(60)
                except subprocess.TimeoutExpired:
                    pass
        for pid in alive(seen):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        procs.close()
        if os.path.exists(f"/dev/shm/dplb-{port}"):
            os.unlink(f"/dev/shm/dplb-{port}")
        shutil.rmtree(base, ignore_errors=True)


class TimingOutTransport:
    """A worker transport whose every ``get`` times out after blocking the event loop ``stall_s``
    seconds (a starved process on a busy machine: its own timer fires that late)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s

    async def get(self, endpoint: str, path: str, timeout: float, method: str = "GET") -> tuple[int, bytes]:
        import time

        from router.errors import TransportError

        time.sleep(self.stall_s)   # noqa: ASYNC251 - the stall is the point: the loop itself is blocked
        raise TransportError("timeout", endpoint, "read timeout")
