"""The parent of ``--workers K`` router processes: uvicorn's process manager, saying what it does.

uvicorn's :class:`~uvicorn.supervisors.Multiprocess` checks its processes every 0.5 s and replaces
one that died or stopped answering its health pipe, logging that at INFO only, so at the router's
default level (warning) a replacement appeared with no line (issue 27, item 4). This subclass logs
each death (with the exit status or signal) and its replacement's pid at WARNING. The share of the
segment's accounting that the dead process held is given back by the surviving processes' health
ticks (:mod:`router.ledger`), not here: the parent holds no segment.
"""
from __future__ import annotations

import logging
import os
import signal
import socket

from uvicorn.config import Config
from uvicorn.supervisors.multiprocess import Multiprocess

from dplb_shm.exits import exit_words

log = logging.getLogger("dplb.router")


#: signals with no documented meaning to a router process: logged at WARNING, never fatal (their
#: default action killed the process). ``--workers`` > 1: the parent is uvicorn's process manager,
#: which gives SIGHUP a meaning (restart the processes) and ignores SIGUSR1/SIGUSR2 itself
IGNORED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def ignore_undocumented_signals() -> None:
    """Install a handler for each of :data:`IGNORED_SIGNALS` in this process that logs one
    WARNING line and does nothing else (SIGTERM and SIGINT keep uvicorn's graceful stop). Call
    from the main thread, before serving."""
    def handler(signum: int, frame: object) -> None:
        log.warning("router process %d ignores %s (no meaning to the router; SIGTERM or SIGINT stop it)",
                    os.getpid(), signal.Signals(signum).name)

    for s in IGNORED_SIGNALS:
        signal.signal(s, handler)


def describe_exit(code: int | None) -> str:
    """``multiprocessing`` exit code → words (:func:`dplb_shm.exits.exit_words`: ``exited with
    status 3``, ``killed by SIGKILL (-9)``), ``hung`` for None (it stopped answering)."""
    return "hung" if code is None else exit_words(code)


class RouterProcesses(Multiprocess):
    """uvicorn's :class:`Multiprocess` with a warning line for each router process replaced."""

    def keep_subprocess_alive(self) -> None:
        before = list(self.processes)
        super().keep_subprocess_alive()
        for old, new in zip(before, self.processes, strict=True):
            if new is not old:
                log.warning("router process %s died (%s); router process %s replaces it",
                            old.pid, describe_exit(old.exitcode), new.pid)


def serve_processes(config: Config) -> None:
    """Bind ``config``'s socket once and run ``config.workers`` router processes on it until a
    signal stops them (what ``uvicorn.run(..., workers=K)`` does, with :class:`RouterProcesses`)."""
    sock: socket.socket = config.bind_socket()
    try:
        RouterProcesses(config, sockets=[sock]).run()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()


__all__ = ["IGNORED_SIGNALS", "RouterProcesses", "describe_exit", "ignore_undocumented_signals", "serve_processes"]
