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
import signal
import socket

from uvicorn.config import Config
from uvicorn.supervisors.multiprocess import Multiprocess

log = logging.getLogger("dplb.router")


def describe_exit(code: int | None) -> str:
    """``multiprocessing`` exit code → words: ``exit status 3``, ``killed by SIGKILL``, ``hung``."""
    if code is None:
        return "hung"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


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


__all__ = ["RouterProcesses", "describe_exit", "serve_processes"]
