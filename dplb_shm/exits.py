"""One spelling of a process's exit status, for every view: the dump, ``/dplb/status``, the
metrics, the launcher's and the agents' logs.

- As a number (the slot's ``last_exit_code``, JSON, metrics): Python's ``Popen.returncode``
  convention — ``3`` for ``exit(3)``, ``-9`` for a process killed by SIGKILL. Never the shell's
  ``128 + signal`` (137).
- Never exited, or its status is unknown: ``null`` in JSON, ``-`` in a table, no metric sample
  (a slot holds 0 then: :attr:`dplb_shm.WorkerSnapshot.exit_code` tells the two apart).
- In words (logs): ``exited with status 3``, ``killed by SIGKILL (-9)``.
- In a table column (``dplb-shm-dump``): ``3``, ``SIGKILL``, ``-``.
"""
from __future__ import annotations

import signal


def signal_name(sig: int) -> str:
    """``SIGKILL`` for 9; ``signal 77`` for a number with no name here."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def exit_words(code: int | None) -> str:
    """``code`` (``Popen.returncode`` convention; None: unknown) in words: ``exited with status 3``,
    ``killed by SIGKILL (-9)``, ``exited (status unknown)``."""
    if code is None:
        return "exited (status unknown)"
    if code < 0:
        return f"killed by {signal_name(-code)} ({code})"
    return f"exited with status {code}"


def exit_label(code: int | None) -> str:
    """``code`` as a table cell: ``3``, ``SIGKILL``, or ``-`` (never exited / unknown)."""
    if code is None:
        return "-"
    return signal_name(-code) if code < 0 else str(code)


__all__ = ["exit_label", "exit_words", "signal_name"]
