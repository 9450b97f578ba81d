"""Child processes of the harness: started in their own process groups, stopped by PID, measured.

Every process the harness starts goes through :class:`ProcessSet`, the launcher's
:class:`launcher.stack.ProcessGroup` (one process-group manager for the launcher, the harness and
the tests). Peers rename themselves after start (``sglang::router``, ``vllm::router``), which is
why nothing here looks a process up by name: the PID from ``Popen`` is the only handle.

CPU time comes from :mod:`psutil` (user + system seconds of the process and all its live
descendants, threads included).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from bench.errors import StartupError
from launcher.children import Child
from launcher.stack import (
    LOOPBACK,
    ChildExited,
    ProcessGroup,
    WaitTimeout,
    free_port,
    wait_for,
)

__all__ = ["LOOPBACK", "Child", "CorePlan", "ProcessSet", "core_plan", "cpu_seconds", "free_port", "pin",
           "start_sim_engine", "wait_until"]



class ProcessSet(ProcessGroup):
    """:class:`launcher.stack.ProcessGroup` with logs in ``log_dir`` (``<name>.log``, ``pids.txt``)
    whose :meth:`start` raises :class:`StartupError` when a program cannot be run at all."""

    def __init__(self, log_dir: Path, grace_s: float = 3.0) -> None:
        super().__init__(log_dir=log_dir, grace_s=grace_s)

    def start(self, argv: Sequence[str], **kw: Any) -> Child:  # type: ignore[override]
        """Start ``argv`` (``name=`` names its log); see :meth:`launcher.stack.ProcessGroup.start`."""
        try:
            return super().start(argv, **kw)
        except OSError as e:
            raise StartupError(kw.get("name") or str(argv[0]), f"cannot start {argv[0]!r}: {e}") from e

    def stop_all(self) -> None:
        """Stop every child (newest first, all SIGTERMed before any is waited for)."""
        self.close()


def process_trees(pids: Sequence[int]) -> list[psutil.Process]:
    """``pids`` and their live descendants, each once; processes that have gone away are skipped."""
    out: list[psutil.Process] = []
    seen: set[int] = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            continue
        for p in procs:
            if p.pid not in seen:
                seen.add(p.pid)
                out.append(p)
    return out


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` and their live descendants.

    Processes that have gone away count as 0 (their time is lost, which is why the harness reads
    this while the system is still running).
    """
    total = 0.0
    for p in process_trees(pids):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


class CorePlan:
    """Which CPUs the routing side and the rest get (issue 17: the router, and DPLB's agents, on
    one core; the load generator and the engines on the others, so the load generator does not
    steal the router's core). ``router``/``rest``: CPU ids; both empty means "do not pin"."""

    def __init__(self, router: frozenset[int], rest: frozenset[int]) -> None:
        self.router = router
        self.rest = rest

    @property
    def active(self) -> bool:
        """True when pinning is on."""
        return bool(self.router and self.rest)

    def describe(self) -> str:
        """One line for the report."""
        if not self.active:
            return "not pinned (fewer than 2 CPUs available, or --no-pin)"
        return (f"router processes (and DPLB's agents) on CPU {sorted(self.router)}; load generator and "
                f"engines on CPU {sorted(self.rest)}")


def core_plan(enabled: bool = True) -> CorePlan:
    """The :class:`CorePlan` for this machine: the lowest allowed CPU for routing, the others for
    the rest; inactive when ``enabled`` is False or fewer than two CPUs are allowed."""
    cpus = sorted(psutil.Process().cpu_affinity() or [])
    if not enabled or len(cpus) < 2:
        return CorePlan(frozenset(), frozenset())
    return CorePlan(frozenset(cpus[:1]), frozenset(cpus[1:]))


def pin(pids: Sequence[int], cpus: frozenset[int]) -> int:
    """Set the CPU affinity of every thread of ``pids`` and of their live descendants to ``cpus``.

    Each thread is pinned (``/proc/<pid>/task``): a Rust router's worker threads already exist
    when it is ready, and threads started later inherit their creator's mask. Returns how many
    threads were pinned; processes that went away are skipped. No-op for an empty ``cpus``.
    """
    import os

    if not cpus:
        return 0
    n = 0
    for p in process_trees(pids):
        try:
            tids = [t.id for t in p.threads()]
        except psutil.Error:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
                n += 1
            except OSError:
                pass
    return n


def wait_until(pred: Callable[[], object], timeout: float, what: str, interval: float = 0.1,
               children: Sequence[Child] = ()) -> object:
    """:func:`launcher.stack.wait_for` with the harness's error: :class:`StartupError` on timeout or
    when one of ``children`` (processes that must stay alive while waiting) dies, quoting its log.
    """
    try:
        return wait_for(pred, timeout, what, interval=interval, children=children)
    except ChildExited as e:
        raise StartupError(e.child.name, f"exited with code {e.child.popen.returncode} while waiting for {what}",
                           e.child.log) from None
    except WaitTimeout as e:
        raise StartupError(what, f"not ready after {timeout:.0f} s" + (f" (last error: {e.last!r})" if e.last else ""),
                           children[0].log if children else None) from None


def start_sim_engine(group: ProcessGroup, sock: str, *args: str, cpu: int | None = None,
                     timeout: float = 30.0) -> Child:
    """Start ``python -m sim_engine --uds sock *args`` in ``group`` (which stops it), pinned to CPU
    ``cpu`` when given, and wait until its socket exists.

    Raises:
        StartupError: the engine exited, or its socket did not appear within ``timeout`` seconds.
    """
    import os
    import sys

    child = group.start([sys.executable, "-m", "sim_engine", "--uds", sock, *args], name="sim-engine")
    if cpu is not None:
        os.sched_setaffinity(child.popen.pid, {cpu})
    wait_until(lambda: os.path.exists(sock), timeout, f"sim engine socket {sock}", interval=0.05, children=[child])
    return child
