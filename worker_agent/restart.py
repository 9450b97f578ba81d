"""The one restart policy: bounded restarts with exponential backoff, for engines and for agents.

The agent restarts its engine with it (:mod:`worker_agent.agent`, ``--restart-*``) and the
launcher restarts a dead agent with it (:mod:`launcher.supervisor`, ``--agent-restart-*``); both
take their defaults from :data:`DEFAULTS`. Pure Python, no dependencies, so the launcher imports it
without the agent's web stack.

The n-th failure within ``window_s`` seconds waits ``min(backoff_max_s, backoff_s * 2**(n-1))``
seconds before the restart; the failure after ``max_restarts`` of them gives up (systemd's
``StartLimitBurst``/``StartLimitIntervalSec`` with ``RestartSec`` doubling, Kubernetes'
CrashLoopBackOff without the reset).
"""
from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartParams:
    """Parameters of a :class:`RestartPolicy` (units in names; the CLI flags' defaults)."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0


#: defaults of ``dplb-worker-agent --restart-*`` and ``launch_dplb.sh --agent-restart-*``
DEFAULTS = RestartParams()


def add_restart_flags(p: argparse.ArgumentParser, prefix: str, failure: str, max_help: str) -> None:
    """Add ``--<prefix>restart-max``, ``-window``, ``-backoff`` and ``-backoff-max`` to ``p`` with
    :data:`DEFAULTS` (the agent: ``prefix=""``, ``failure="engine failure"``; the launcher:
    ``prefix="agent-"``, ``failure="agent death"``). ``max_help``: the ``-max`` flag's help."""
    f = f"--{prefix}restart"
    p.add_argument(f"{f}-max", type=int, default=DEFAULTS.max_restarts, help=max_help)
    p.add_argument(f"{f}-window", type=float, default=DEFAULTS.window_s,
                   help=f"seconds over which each {failure} is counted (default: {DEFAULTS.window_s:g})")
    p.add_argument(f"{f}-backoff", type=float, default=DEFAULTS.backoff_s,
                   help=f"seconds before the first restart; doubles with each {failure} in the window "
                        f"(default: {DEFAULTS.backoff_s:g})")
    p.add_argument(f"{f}-backoff-max", type=float, default=DEFAULTS.backoff_max_s,
                   help=f"longest wait before a restart, seconds (default: {DEFAULTS.backoff_max_s:g})")


def restart_params(ns: argparse.Namespace, prefix: str) -> RestartParams:
    """The flags :func:`add_restart_flags` added, parsed into ``ns``, as :class:`RestartParams`.

    Raises:
        ValueError: ``(flag, value, reason)`` for a negative count or duration.
    """
    a = prefix.replace("-", "_") + "restart"
    mx = getattr(ns, f"{a}_max")
    if mx < 0:
        raise ValueError(f"--{prefix}restart-max", mx, "must be >= 0")
    secs = {k: getattr(ns, f"{a}_{k.replace('-', '_')}") for k in ("window", "backoff", "backoff-max")}
    for k, v in secs.items():
        if not v >= 0:
            raise ValueError(f"--{prefix}restart-{k}", v, "must be >= 0 seconds")
    return RestartParams(max_restarts=mx, window_s=secs["window"], backoff_s=secs["backoff"],
                         backoff_max_s=secs["backoff-max"])


class RestartPolicy:
    """Bounded restarts with exponential backoff.

    Args:
        max_restarts: failures that are restarted within any ``window_s`` seconds (0: none).
        window_s: length of the counting window, seconds.
        backoff_s: wait before the restart after the first failure in the window, seconds.
        backoff_max_s: upper bound of the wait, seconds.
        clock: monotonic clock in seconds (injectable for tests).

    The n-th failure within the window waits ``min(backoff_max_s, backoff_s * 2**(n-1))``.
    """

    def __init__(self, max_restarts: int = DEFAULTS.max_restarts, window_s: float = DEFAULTS.window_s,
                 backoff_s: float = DEFAULTS.backoff_s, backoff_max_s: float = DEFAULTS.backoff_max_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.clock = clock
        self._failures: deque[float] = deque()

    @classmethod
    def from_params(cls, p: RestartParams, clock: Callable[[], float] = time.monotonic) -> RestartPolicy:
        """A policy with the parameters ``p``."""
        return cls(p.max_restarts, p.window_s, p.backoff_s, p.backoff_max_s, clock)

    def failures_in_window(self) -> int:
        """Failures recorded within the last ``window_s`` seconds."""
        cutoff = self.clock() - self.window_s
        while self._failures and self._failures[0] < cutoff:
            self._failures.popleft()
        return len(self._failures)

    def failure(self) -> float | None:
        """Record one failure now; return the seconds to wait before restarting, or None when this
        failure exceeds ``max_restarts`` within the window (give up)."""
        self._failures.append(self.clock())
        n = self.failures_in_window()
        if n > self.max_restarts:
            return None
        return min(self.backoff_max_s, self.backoff_s * (2 ** (n - 1)))

    def reset(self) -> None:
        """Forget every failure (an operator asked for a restart)."""
        self._failures.clear()


__all__ = ["DEFAULTS", "RestartParams", "RestartPolicy"]
