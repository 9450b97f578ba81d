"""Starting a DPLB stack from Python: the one place that builds the agent's and the router's
command lines, starts child processes in process groups of their own, and stops them all.

Three users share it: the launch script's supervisor (:mod:`launcher.supervisor`), the benchmark
harness (``bench/``) and the tests. Each used to carry its own copy of the command lines, its own
process-group manager and its own ``free_port``; a flag added to the agent now reaches all of them.

::

    with Stack(num_slots=16) as st:                       # segment + private run dir (0700)
        st.start_agent(0, engine_args=["--time-scale", "20"])  # python -m worker_agent --engine sim, READY
        st.start_agent(1, engine="openai", engine_url="http://127.0.0.1:8001", model="m")
        base = st.router({"routing_policy": {"policy": "dplb"}}, ready=2)   # http://127.0.0.1:<port>
        ...
    # every process group stopped (SIGTERM, then SIGKILL), segment unlinked, run dir removed

Lower level: :func:`agent_argv`, :func:`router_argv`, :class:`ProcessGroup`, :func:`free_port`.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import orjson
import psutil

from launcher.children import Child, recorded_engine
from worker_agent.logtail import log_tail

LOOPBACK = "127.0.0.1"
ROOT = Path(__file__).resolve().parent.parent


#: lowest port :func:`free_port` hands out (above the registered ports most services listen on)
PORT_FLOOR = 20000
_handed: set[int] = set()


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """First port of the kernel's ephemeral range (the local ports ``connect()`` picks); 32768 when
    the file cannot be read (Linux's default, ``Documentation/networking/ip-sysctl.rst``)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that was free a moment ago and that this process has not handed out.

    Picked at random *below* the kernel's ephemeral range (``[PORT_FLOOR, ip_local_port_range low)``,
    20000-32767 on a default Linux), not with ``bind(port 0)``: a port the OS picks comes from the
    ephemeral range, and in the second or so before the child that was given it binds, any outgoing
    connection on the machine may take it as its local port, so the child fails with ``EADDRINUSE``
    (seen in CI: a simulated engine's port taken while other tests were connecting). Falls back to an
    OS-picked port when the range below is empty or 200 draws find nothing.
    """
    low = _ephemeral_low()
    if low - PORT_FLOOR >= 1000:
        if len(_handed) > (low - PORT_FLOOR) // 2:
            _handed.clear()
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(PORT_FLOOR, low)
            if port not in _handed and _bindable(host, port):
                _handed.add(port)
                return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def unique_shm_name(prefix: str = "dplb") -> str:
    """A segment name nobody else uses: ``<prefix>-<8 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ------------------------------------------------------------------------------ command lines
def agent_argv(worker_id: int, shm: str, uds: str | os.PathLike[str], *, engine: str = "sim",
               model: str | None = None, gpus: Sequence[int] = (), tp_size: int | None = None,
               engine_url: str | None = None, state_interval_ms: int | None = None,
               run_dir: str | os.PathLike[str] | None = None, latency_window_s: float | None = None,
               log_level: str | None = None, extra: Sequence[str] = (), engine_args: Sequence[str] = (),
               python: str = sys.executable, module: str = "worker_agent") -> list[str]:
    """Command line of worker ``worker_id``'s agent (``dplb-worker-agent``, docs/INTERFACES.md).

    ``None`` leaves a flag to the agent's own default; ``extra`` are more agent flags; ``engine_args``
    go after ``--`` to the engine; ``module`` is what ``python -m`` runs (tests swap in a stand-in
    that speaks the same command line)."""
    argv = [python, "-m", module, "--worker-id", str(worker_id), "--shm", shm, "--uds", str(uds),
            "--engine", engine]
    if state_interval_ms is not None:
        argv += ["--state-interval-ms", str(state_interval_ms)]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    if model:
        argv += ["--model", model]
    if latency_window_s is not None:
        argv += ["--latency-window-s", f"{latency_window_s:g}"]
    if gpus:
        argv += ["--gpus", ",".join(map(str, gpus)), "--tp-size", str(tp_size or len(gpus))]
    if engine_url is not None:
        argv += ["--engine-url", engine_url]
    if log_level is not None:
        argv += ["--log-level", log_level]
    argv += list(extra)
    if engine_args:
        argv += ["--", *engine_args]
    return argv


def router_argv(*, port: int, shm: str, host: str = LOOPBACK, config: str | os.PathLike[str] | None = None,
                policy: str | None = None, workers: int | None = None, log_level: str | None = None,
                extra: Sequence[str] = (), python: str = sys.executable, module: str = "router") -> list[str]:
    """Command line of the router (``dplb-router``, docs/INTERFACES.md); ``None`` leaves a field to
    the config file, then to the router's default."""
    argv = [python, "-m", module, "--host", host, "--port", str(port), "--shm", shm]
    if config is not None:
        argv += ["--config", str(config)]
    if policy:
        argv += ["--policy", policy]
    if workers:
        argv += ["--workers", str(workers)]
    if log_level:
        argv += ["--log-level", log_level]
    return argv + list(extra)


def write_router_config(path: str | os.PathLike[str], config: Mapping[str, object]) -> Path:
    """Write ``config`` (a ``dplb.yaml`` as a dict) to ``path`` as YAML; returns the path."""
    import yaml

    p = Path(path)
    p.write_text(yaml.safe_dump(config))
    return p


# ------------------------------------------------------------------------------ processes
def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class ProcessGroup:
    """Child processes that are always stopped together.

    Every child leads a session of its own (``start_new_session=True``), so stopping it signals its
    whole process group (a uvicorn worker dies with its parent); its descendants in sessions of
    their own (an agent's engine, which outlives a dead agent by design) are collected when the stop
    begins and killed with it if still alive after the grace period. Nothing is looked up by name
    (peer routers rename themselves): the ``Popen`` pid is the only handle.

    ``log_dir``: when set, a child started without ``log=`` writes to ``<log_dir>/<name>.log`` and
    every start is appended to ``<log_dir>/pids.txt`` (``<pid> <name>``). ``grace_s``: how long
    :meth:`stop_many` waits after SIGTERM before SIGKILL. A context manager: leaving it stops all.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, grace_s: float = 3.0) -> None:
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.grace_s = grace_s
        self.children: list[Child] = []

    def start(self, argv: Sequence[str], *, name: str | None = None, log: str | os.PathLike[str] | None = None,
              env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
              umask: int = -1) -> Child:
        """Start ``argv`` (environment: ours updated with ``env``) with stdout and stderr appended to
        ``log`` (or ``<log_dir>/<name>.log``; discarded when neither is given).

        Raises ``OSError`` when the program cannot be executed."""
        name = name or Path(argv[0]).name
        if log is None and self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = self.log_dir / f"{name}.log"
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - closed below
        try:
            p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
                                 start_new_session=True, env=full_env, cwd=cwd, umask=umask)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        child = Child(name=name, popen=p, log_path=Path(log) if log is not None else None, argv=list(argv))
        self.children.append(child)
        if self.log_dir is not None:
            with open(self.log_dir / "pids.txt", "a") as f:  # audit trail: every pid this group started
                f.write(f"{p.pid} {name}\n")
        return child

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``child``'s whole process group (no wait)."""
        _signal_group(child.pid, sig)

    def stop(self, child: Child) -> None:
        """Stop one child and its group: SIGTERM, up to ``grace_s``, then SIGKILL; reaps it."""
        self.stop_many([child])

    def stop_many(self, kids: Iterable[Child]) -> None:
        """Stop ``kids`` together: SIGTERM every group (newest first), wait up to ``grace_s`` for all
        of them at once, then SIGKILL what is left of each group (grandchildren included)."""
        kids = list(reversed(list(kids)))
        below: list[psutil.Process] = []   # engines in sessions of their own, under their agents
        for c in kids:
            with contextlib.suppress(psutil.Error):
                below += psutil.Process(c.pid).children(recursive=True)
        for c in kids:
            if c.poll() is None:
                _signal_group(c.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for c in kids:
            try:
                c.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for c in kids:
            _signal_group(c.pid, signal.SIGKILL)  # the group may still hold an engine under an agent
            try:
                c.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
            if c in self.children:
                self.children.remove(c)
        _, left = psutil.wait_procs(below, timeout=max(0.0, deadline - time.monotonic()))
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def close(self) -> None:
        """Stop every child."""
        self.stop_many(list(self.children))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChildExited(ChildProcessError):
    """A child :func:`wait_for` was told to watch exited while it waited; ``child`` is that child."""

    def __init__(self, message: str, child: Child) -> None:
        super().__init__(message)
        self.child = child


class WaitTimeout(TimeoutError):
    """:func:`wait_for` ran out of time; ``last`` is the last exception ``pred`` raised (or None)."""

    def __init__(self, message: str, last: BaseException | None) -> None:
        super().__init__(message)
        self.last = last


def wait_for(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.05,
             children: Sequence[Child] = ()) -> object:
    """Poll ``pred()`` every ``interval`` seconds until it is truthy and return its value: the one
    polling loop of the launcher, the harness (``bench.procs.wait_until``) and the tests
    (``tests.helpers.wait_until``). Exceptions from ``pred`` count as "not yet" (the last one is
    quoted on timeout).

    Raises:
        WaitTimeout: (a ``TimeoutError``) ``pred`` was not truthy within ``timeout`` seconds.
        ChildExited: one of ``children`` exited meanwhile (the message quotes its log's last lines).
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        for c in children:
            if c.poll() is not None:
                tail = log_tail(c.log_path, 20) if c.log_path else ""
                raise ChildExited(f"{c.name} exited with status {c.popen.returncode} while waiting for "
                                  f"{what}" + (f"; last lines of {c.log_path}:\n{tail}" if tail else ""), c)
        try:
            v = pred()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - polled predicates fail while things start
            last = e
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}"
                              + (f" (last error: {last!r})" if last else ""), last)
        time.sleep(interval)


def wait_for_unix_socket(path: str | os.PathLike[str], timeout: float = 15.0) -> None:
    """Wait until something accepts connections on the Unix socket ``path`` (``TimeoutError``)."""
    def ok() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            s.connect(str(path))
            return True
    wait_for(ok, timeout, f"unix socket {path}")


def wait_for_port(port: int, host: str = LOOPBACK, timeout: float = 15.0) -> None:
    """Wait until something accepts TCP connections on ``host:port`` (``TimeoutError``)."""
    def ok() -> bool:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    wait_for(ok, timeout, f"{host}:{port}")


# Any: an HTTP answer's JSON document (any shape); callers index it as they know it
def http_json(url: str, timeout_s: float = 2.0) -> Any:  # type: ignore[explicit-any]
    """``GET url`` → parsed JSON body (no proxy); raises ``OSError``/``urllib.error.URLError``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=timeout_s) as r:
        return orjson.loads(r.read())


# ------------------------------------------------------------------------------ a whole stack
class Stack:
    """A private segment, a run dir (mode 0700) and the agents and routers started on it.

    ``shm``: segment name (default: a fresh ``<shm_prefix>-<hex>``); ``run_dir``: where sockets,
    logs and router configs go (default: a new ``/tmp/dplb-s-*``, short enough for socket paths,
    removed at :meth:`close`). ``procs``: the :class:`ProcessGroup` holding every child.
    """

    def __init__(self, num_slots: int = 16, shm: str | None = None, run_dir: str | os.PathLike[str] | None = None,
                 shm_prefix: str = "dplb-stack", python: str = sys.executable, grace_s: float = 3.0) -> None:
        self.num_slots = num_slots
        self.shm = shm or unique_shm_name(shm_prefix)
        self._own_dir = run_dir is None
        self.dir = str(run_dir) if run_dir is not None else ""
        self.python = python
        self.procs = ProcessGroup(grace_s=grace_s)
        # Any: a dplb_shm.Segment, None until open() creates it; its readers hold it non-None without a check
        self.seg: Any = None  # type: ignore[explicit-any]
        self.agent_procs: dict[int, Child] = {}
        self.routers: list[tuple[Child, str]] = []

    def open(self) -> Self:
        """Create the run dir and the segment (``replace=True``: the name is ours)."""
        from dplb_shm import Segment

        if self._own_dir:
            self.dir = tempfile.mkdtemp(prefix="dplb-s-", dir="/tmp")
        else:
            os.makedirs(self.dir, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.seg = Segment.create(self.shm, num_slots=self.num_slots, replace=True)
        return self

    def __enter__(self) -> Self:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()

    def path(self, name: str) -> str:
        """``<run dir>/<name>``."""
        return os.path.join(self.dir, name)

    # -- workers -----------------------------------------------------------------------------
    def slot_state(self, wid: int) -> str:
        """State name of slot ``wid`` (``EMPTY``, ``STARTING``, ``READY``, ``DRAINING``, ``DEAD``)."""
        return str(self.seg.read_slot(wid).state.name)

    def start_agent(self, wid: int, *, engine: str = "sim", engine_args: Sequence[str] = (), extra: Sequence[str] = (),
              model: str | None = None, engine_url: str | None = None, state_interval_ms: int = 100,
              log_level: str = "warning", wait: bool = True, timeout: float = 90.0, umask: int = -1,
              env: dict[str, str] | None = None) -> Child:
        """Start worker ``wid``'s agent (``<dir>/agent-<wid>.sock``, log ``agent-<wid>.log``) and,
        with ``wait``, return once its slot is READY. Raises ``TimeoutError`` or
        ``ChildProcessError`` (with the log's tail) when it does not get there."""
        argv = agent_argv(wid, self.shm, self.path(f"agent-{wid}.sock"), engine=engine, model=model,
                          engine_url=engine_url, state_interval_ms=state_interval_ms, run_dir=self.dir,
                          log_level=log_level, extra=extra, engine_args=engine_args, python=self.python)
        c = self.procs.start(argv, name=f"agent-{wid}", log=self.path(f"agent-{wid}.log"), cwd=str(ROOT),
                             env={"PYTHONPATH": _pythonpath(), **(env or {})}, umask=umask)
        self.agent_procs[wid] = c
        if wait:
            self.wait_ready([wid], timeout)
        return c

    def wait_ready(self, wids: Iterable[int], timeout: float = 90.0) -> None:
        """Wait until every slot in ``wids`` is READY (their agents must stay alive meanwhile)."""
        wids = list(wids)
        kids = [self.agent_procs[w] for w in wids if w in self.agent_procs]
        wait_for(lambda: all(self.slot_state(w) == "READY" for w in wids), timeout,
                 f"workers {wids} READY", children=kids)

    # -- routers -----------------------------------------------------------------------------
    def router(self, config: Mapping[str, object] | None = None, *extra: str, ready: int = 1, port: int | None = None,
               timeout: float = 60.0, policy: str | None = None, workers: int | None = None) -> str:
        """Start a router on ``port`` (a free loopback one when None; reuse one to restart a router
        in place) with ``config`` (a ``dplb.yaml`` as a dict; its ``router.state_dir`` defaults to
        the run dir); wait until ``/dplb/status`` lists ``ready`` eligible workers; returns the
        base URL. Raises ``TimeoutError``/``ChildProcessError`` (with the router log's tail)."""
        port = port or free_port()
        cfg = dict(config or {})
        sect = cfg.get("router")
        r = dict(sect) if isinstance(sect, Mapping) else {}
        r.setdefault("state_dir", self.path("router-state"))
        cfg["router"] = r
        path = write_router_config(self.path(f"router-{port}-{len(self.routers)}.yaml"), cfg)
        argv = router_argv(port=port, shm=self.shm, config=path, policy=policy, workers=workers, extra=extra,
                           python=self.python)
        c = self.procs.start(argv, name=f"router-{port}", log=self.path(f"router-{port}.log"), cwd=str(ROOT),
                             env={"PYTHONPATH": _pythonpath()})
        base = f"http://{LOOPBACK}:{port}"
        self.routers.append((c, base))

        def up() -> bool:
            rows = http_json(base + "/dplb/status")["workers"]
            return sum(1 for w in rows if w["eligible"]) >= ready

        wait_for(up, timeout, f"router {base} with {ready} eligible worker(s)", children=[c])
        return base

    # -- housekeeping ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process group and every engine the run dir's ``engine-<K>.pid`` files name
        (:func:`stop_recorded_engines`: an engine outlives a killed agent and is no child of
        ours), unlink the segment, remove the run dir (when it is ours)."""
        try:
            try:
                self.procs.close()
            finally:
                if self.dir:
                    stop_recorded_engines(self.dir, self.procs.grace_s)
        finally:
            try:
                if self.seg is not None:
                    self.seg.close()
            finally:
                self.seg = None
                if os.path.exists(f"/dev/shm/{self.shm}"):
                    try:
                        os.unlink(f"/dev/shm/{self.shm}")
                    except OSError:
                        pass
                if self._own_dir and self.dir:
                    shutil.rmtree(self.dir, ignore_errors=True)


def stop_recorded_engines(run_dir: str | os.PathLike[str], grace_s: float = 3.0) -> list[int]:
    """Stop the engines that ``<run_dir>/engine-<K>.pid`` files name and that still run, checked by
    pid and start time as the agent checks them (:func:`launcher.children.recorded_engine`: a
    reused pid is left alone): SIGTERM to each one's process group (its own: the agent starts it
    in a session of its own), SIGKILL to what still runs after ``grace_s`` seconds. An engine
    whose agent was killed is reparented away from us, so :class:`ProcessGroup` cannot find it
    among its children's descendants. Returns the pids signalled."""
    procs = [p for p in (recorded_engine(f) for f in sorted(Path(run_dir).glob("engine-*.pid"))) if p is not None]
    for p in procs:
        _signal_engine(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        if p.is_running():   # still the same process (psutil compares its start time)
            _signal_engine(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in procs]


def _signal_engine(p: psutil.Process, sig: int) -> None:
    """``sig`` to engine ``p``'s process group when it leads one, else to ``p`` alone."""
    try:
        if os.getpgid(p.pid) == p.pid:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)
    except (ProcessLookupError, PermissionError, psutil.Error):
        pass


def _pythonpath() -> str:
    """``PYTHONPATH`` for children: the checkout first, so ``python -m router`` finds this tree."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


__all__ = ["LOOPBACK", "ROOT", "ProcessGroup", "Stack", "agent_argv", "free_port", "http_json", "router_argv",
           "stop_recorded_engines", "unique_shm_name", "wait_for", "wait_for_port", "wait_for_unix_socket", "write_router_config"]
