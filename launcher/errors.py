"""Errors raised by the launcher.

::

    LaunchError                 base; ``exit_code`` is what the launch exits with
    ├── UsageError              bad flags or an impossible request (exit 2)
    │   └── GpuPlanError        GPUs cannot be split into the requested worker groups
    ├── ChildStartError         a worker agent or the router exited or failed during start-up
    └── StartTimeoutError       not every worker became ready within the start-up timeout

Errors carry the fields an operator needs (which child, its log file, the log's last lines);
``str(err)`` is the message printed before the launch exits.
"""
from __future__ import annotations


class LaunchError(Exception):
    """Base of every launcher error; ``exit_code`` is the process exit status to use."""

    exit_code = 1


class UsageError(LaunchError):
    """A flag or combination of flags that cannot work (exit status 2, like argparse)."""

    exit_code = 2


class GpuPlanError(UsageError):
    """The GPU list cannot be split into ``num_workers`` equal tensor-parallel groups.

    Attributes: ``gpus`` (list[int], the GPU ids offered), ``num_workers`` (int).
    """

    def __init__(self, message: str, gpus: list[int], num_workers: int) -> None:
        super().__init__(message)
        self.gpus = list(gpus)
        self.num_workers = num_workers


class ChildStartError(LaunchError):
    """A child (``router`` or ``worker K``) exited or failed before the launch became ready.

    Attributes: ``child`` (str, e.g. ``"worker 2"``), ``returncode`` (int | None, None when it
    is still running), ``log_path`` (str), ``log_tail`` (str, the last lines of its log).
    """

    def __init__(self, child: str, returncode: int | None, log_path: str, log_tail: str,
                 reason: str = "") -> None:
        # one spelling of exit statuses (dplb_shm.exits): "killed by SIGKILL (-9)"
        from dplb_shm.exits import exit_words

        what = reason or (exit_words(returncode) if returncode is not None else "failed")
        msg = f"{child} {what} during start-up (log: {log_path})"
        if log_tail:
            msg += "\n--- last lines of " + log_path + " ---\n" + log_tail.rstrip("\n")
        super().__init__(msg)
        self.child = child
        self.returncode = returncode
        self.log_path = log_path
        self.log_tail = log_tail


class StartTimeoutError(LaunchError):
    """Start-up took longer than ``timeout_s``; ``pending`` names the children still not ready."""

    def __init__(self, timeout_s: float, pending: list[str], details: str = "") -> None:
        msg = f"not ready after {timeout_s:g} s: still waiting for {', '.join(pending)}"
        if details:
            msg += "\n" + details.rstrip("\n")
        super().__init__(msg)
        self.timeout_s = timeout_s
        self.pending = list(pending)
