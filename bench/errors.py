"""Errors of the benchmark tools (replay, the harness); a trace that cannot be read raises
:class:`dplb_trace.errors.TraceFormatError`.

::

    BenchError
    ├── ReplayError         the replay cannot start (endpoint unreachable, no model served)
    ├── PeerInstallError    (harness) a peer router's venv could not be created or pip failed
    ├── StartupError        (harness) a process (engine, agent, router, peer) did not become ready
    │                       in time or exited early; carries ``what`` and ``log`` path
    └── WorkloadError       (harness) a workload asked for with impossible parameters

The harness (``bench.run``) catches :class:`BenchError` per system, so one broken system is
recorded as failed rows and a note instead of aborting the whole run.
"""
from __future__ import annotations


class BenchError(Exception):
    """Base of the benchmark tools' errors."""


class ReplayError(BenchError):
    """The replay cannot run against the given endpoint (``url``) for ``reason``."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason


class PeerInstallError(BenchError):
    """Installing a peer router (``sglang-router`` / ``vllm-router`` / ``smg``) into its own venv failed.

    Attributes: ``peer`` (``"sglang"``, ``"vllm"`` or ``"smg"``), ``log`` (path of pip's output).
    """

    def __init__(self, peer: str, log: str, reason: str) -> None:
        super().__init__(f"installing {peer}-router failed: {reason} (pip output in {log})")
        self.peer = peer
        self.log = log


class StartupError(BenchError):
    """A process the harness started did not become ready.

    Attributes: ``what`` (human name, e.g. ``"sim engine 2"``), ``log`` (its log file or ``None``);
    the message quotes the end of the log.
    """

    def __init__(self, what: str, reason: str, log: str | None = None) -> None:
        tail = ""
        if log:
            try:
                with open(log, "rb") as f:
                    f.seek(0, 2)
                    f.seek(max(0, f.tell() - 1500))
                    tail = "\n--- last lines of " + log + " ---\n" + f.read().decode("utf-8", "replace")
            except OSError:
                pass
        super().__init__(f"{what}: {reason}{tail}")
        self.what = what
        self.log = log


class WorkloadError(BenchError):
    """A workload was configured with parameters it cannot honour (e.g. zero requests)."""
