"""Child processes of the launcher: start each in its own process group, stop whole trees.

Every child (router, worker agents) runs in a new session (``start_new_session=True``), so its
process group holds it and whatever it forks that stays in the group. Engines an agent starts in
a session of their own are found through the process tree instead: the launcher makes itself a
*child subreaper* (Linux ``prctl(PR_SET_CHILD_SUBREAPER)``), so an engine orphaned by a crashed
agent is re-parented to the launcher rather than to init and is still stopped at shutdown.

Children also get SIGTERM when the launcher itself dies (``PR_SET_PDEATHSIG``).

Stopping (:func:`stop_tree`): SIGTERM to every group and every descendant, wait up to a grace
period, then SIGKILL whatever is left — the order ``docker stop`` and systemd use.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

PR_SET_PDEATHSIG = 1  # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux only); True on success."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _term_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    """A started child: ``name`` (e.g. ``"worker 2"``), its ``Popen``, ``log_path`` (None when its
    output is discarded) and ``argv``."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None
    argv: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """The child's pid (also its process-group id)."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once reaped (by :meth:`poll` or :meth:`wait`), else None."""
        return self.popen.returncode

    @property
    def log(self) -> str | None:
        """``log_path`` as a string (None when output is discarded)."""
        return str(self.log_path) if self.log_path is not None else None

    def poll(self) -> int | None:
        """Exit status, or None while it runs."""
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit status; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        return self.popen.wait(timeout)

    def alive(self) -> bool:
        """True while the process has not exited."""
        return self.popen.poll() is None

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child itself (not its group); no-op once it has been reaped."""
        self.popen.send_signal(sig)


def start_child(name: str, argv: list[str], log_path: Path, env: dict[str, str],
                cwd: str | os.PathLike[str] | None = None) -> Child:
    """Start ``argv`` in a new session with stdout+stderr appended to ``log_path``.

    The child also gets SIGTERM if the launcher itself dies (``PR_SET_PDEATHSIG``), so a
    SIGKILLed launcher does not leave a router holding the port. The launcher is single-threaded,
    which makes ``preexec_fn`` safe here. A log that cannot be written (a full file system) does
    not keep the child from starting: its output is lost instead.

    Raises ``OSError`` when the program cannot be executed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        log = open(log_path, "ab", buffering=0)  # noqa: SIM115 - closed below; unbuffered: nothing left to flush
    except OSError:   # the run dir refuses a new file: the child runs, its output is lost
        log = open(os.devnull, "ab", buffering=0)  # noqa: SIM115
    with log:
        try:
            log.write(f"=== {name}: {' '.join(argv)}\n".encode())
        except OSError:   # a full file system (ENOSPC): logging degrades, the child starts anyway
            pass
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                             cwd=cwd, start_new_session=True,
                             preexec_fn=_term_with_parent)  # noqa: PLW1509 - the launcher is single-threaded
    return Child(name=name, popen=p, log_path=log_path, argv=list(argv))


def descendants(pid: int | None = None) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (default: this process), deepest last; [] if it is gone."""
    try:
        return psutil.Process(pid if pid is not None else os.getpid()).children(recursive=True)
    except psutil.Error:
        return []


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_tree(children: Iterable[Child], grace_s: float = 10.0) -> list[int]:
    """Stop ``children`` with their process groups and every descendant of this process.

    SIGTERM first, SIGKILL after ``grace_s`` seconds for whatever is still alive; reaps the
    ``Popen`` objects. Returns the pids that needed SIGKILL (empty when all stopped in time).
    """
    kids = [c for c in children]
    procs: dict[int, psutil.Process] = {}
    for c in kids:
        for p in [*_as_proc(c.pid), *descendants(c.pid)]:
            procs[p.pid] = p
    for p in descendants():  # orphans re-parented to us (subreaper) and anything else we started
        procs[p.pid] = p
    for c in kids:
        if c.poll() is None:
            _signal_group(c.pid, signal.SIGTERM)
    for p in procs.values():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=grace_s)
    killed = []
    for c in kids:
        _signal_group(c.pid, signal.SIGKILL)
    for p in alive:
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    for c in kids:
        try:
            c.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    reap_orphans({c.pid for c in kids})
    return killed


def reap_orphans(ours: set[int]) -> None:
    """Collect exit statuses of zombie descendants that are not our own ``Popen`` children.

    Needed because a subreaper inherits orphans it never started; without ``waitpid`` they would
    stay zombies. Our ``Popen`` children (``ours``) are left to ``Popen.poll``.
    """
    try:
        me = psutil.Process()
        kids = me.children()
    except psutil.Error:
        return
    for p in kids:
        if p.pid in ours:
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(p.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError):
            pass


def recorded_engine(pid_path: Path) -> psutil.Process | None:
    """The engine a worker's pid file names (``engine-<K>.pid``: ``<pid> <start time> [address]``,
    written by the agent) while that process still runs: its start time matches (10 ms, as the
    agent checks it on re-attach), so a reused pid is never taken for it. None otherwise (no
    file, unreadable, exited, a zombie, another process)."""
    try:
        pid_s, started_s = pid_path.read_text().split()[:2]
        p = psutil.Process(int(pid_s))
        if abs(p.create_time() - float(started_s)) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
            return None
    except (OSError, ValueError, psutil.Error):
        return None
    return p


def stop_recorded_engine(pid_path: Path) -> int | None:
    """SIGTERM to the process group of the engine a worker's pid file names when that process
    still runs (:func:`recorded_engine`). Returns its pid, or None when none runs. For an engine
    whose agent is not restarted any more; whatever is left is stopped at the launch's end."""
    p = recorded_engine(pid_path)
    if p is None:
        return None
    _signal_group(p.pid, signal.SIGTERM)
    return p.pid


def _as_proc(pid: int) -> list[psutil.Process]:
    try:
        return [psutil.Process(pid)]
    except psutil.Error:
        return []
