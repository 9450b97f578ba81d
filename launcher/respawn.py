"""Restarts of the launch's front door (the router; with ``--gateway envoy``, Envoy and the
``dplb-epp`` picker) and the launcher's answer to signals it gives no meaning.

A front-door process that dies (kill -9, a crash, a signal it does not handle) is restarted with
the bounded backoff agents and engines get (:class:`worker_agent.restart.RestartPolicy`), from a
shorter first wait (:data:`FRONT_RESTART`: while the router is down nothing is served at all):
0.25 s, doubled per death up to 8 s, at most 5 deaths within 10 minutes; one more stops the launch
(status 1), as a dead router did at once before. Whatever the dead process left in its process
group (``--router-workers`` processes whose parent died, holding the port) is killed first, so the
new one can bind. The accounting share a dead router process held on the segment's router lines
is given back by the new router when it starts (:mod:`router.ledger`: the first router process of
a deployment sweeps the ledgers of dead ones), as for a replaced ``--router-workers`` process.

Signals: SIGINT, SIGTERM and SIGHUP stop the launch (documented); :data:`IGNORED_SIGNALS` (SIGUSR1,
SIGUSR2, SIGALRM: their default action killed the launcher silently, leaving the segment and its
lock file behind) are logged on one line and otherwise ignored.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker_agent.restart import RestartParams, RestartPolicy

#: the front door's restart policy (module docstring): a short first wait, doubling, bounded
FRONT_RESTART = RestartParams(max_restarts=5, window_s=600.0, backoff_s=0.25, backoff_max_s=8.0)

#: signals with no meaning to the launcher: logged, never fatal
IGNORED_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM)


def ignore_signals(say: Callable[[str], None], who: str, stop_with: str) -> dict[signal.Signals, signal._HANDLER]:
    """Install a handler for each of :data:`IGNORED_SIGNALS` that prints one line (``who`` ignores
    it; ``stop_with``: what does stop it) and does nothing else. Returns the previous handlers
    (``signal.signal`` can restore them). Call from the main thread."""
    def handler(signum: int, frame: object) -> None:
        say(f"dplb: {who} ignores {signal.Signals(signum).name} (it has no meaning here; {stop_with} stop it)")

    return {s: signal.signal(s, handler) for s in IGNORED_SIGNALS}


def kill_group(pid: int) -> None:
    """SIGKILL to the process group ``pid`` leads (what a dead front-door process left there)."""
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


# Any: the launch's dplb_shm.Segment, or a test's stand-in (a fake or closed one is reported, not raised)
def mark_slot_dead(segment: Any, k: int, reason: str, next_restart_ns: int) -> str | None:  # type: ignore[explicit-any]
    """Write DEAD into worker ``k``'s slot for its dead agent (the launcher is the slot's only
    writer until a new agent claims it): ``reason`` (a ``StateReason`` name), ``next_restart_ns``
    (CLOCK_MONOTONIC ns of the agent's restart, 0: none), nothing running, the last heartbeat kept
    (its age stays true). ``last_exit_code`` stays the engine's: the agent's own status is in the
    launcher's line. Returns None, or what went wrong (a fake or closed segment: the restart goes
    on)."""
    try:
        from dplb_shm import StateReason, WorkerState

        hb = int(segment.read_slot(k).heartbeat_ns)
        segment.writer(k).publish(state=WorkerState.DEAD, state_reason=StateReason[reason],
                                  next_restart_ns=next_restart_ns, num_running=0, num_waiting=0,
                                  kv_cache_usage=-1.0, **({"heartbeat_ns": hb} if hb > 0 else {}))
    except Exception as e:  # noqa: BLE001 - reported by the caller
        return f"{type(e).__name__}: {e}"
    return None


#: the launcher's foreground loop period, s: how soon a dead child is noticed (its slot marked
#: DEAD, its restart scheduled); a restart that falls due sooner wakes the loop (:func:`next_tick`)
SERVE_TICK_S = 0.25


def next_tick(*dues: Iterable[float]) -> float:
    """How long the launcher's foreground loop sleeps before its next round, s:
    :data:`SERVE_TICK_S`, or less when a restart (``dues``: monotonic s of the agents' and the
    front-door processes' due restarts) falls due sooner: a restart waits its backoff, not its
    backoff plus a tick."""
    soonest = min((d for ds in dues for d in ds), default=None)
    if soonest is None:
        return SERVE_TICK_S
    return min(SERVE_TICK_S, max(0.0, soonest - time.monotonic()))


def segment_gone(k: int, path: Path) -> str:
    """The launcher's line when worker ``k``'s agent cannot be restarted because the segment file
    ``path`` was removed while the launch runs: the processes that have it mapped keep using it, a
    new one cannot attach (a removed POSIX shm name cannot be linked again to the same memory, and
    a new segment under the name would split the routers from the agents)."""
    return (f"dplb: worker {k}: its agent is not restarted: the segment {path} was removed while the launch runs "
            f"(by something outside it). The router and the running agents keep serving on it, but a new agent "
            f"cannot attach to a removed segment; its engine keeps running until the launch stops. Stop the launch "
            f"(Ctrl-C) and start it again to recreate the segment.")


@dataclass
class FrontRestarts:
    """Dead front-door processes, by name (``router``, ``envoy``, ``dplb-epp``): their restart
    policies, when each restart is due (monotonic s), restarts so far, and those restarted but not
    yet serving (``back``)."""

    params: RestartParams = FRONT_RESTART
    policies: dict[str, RestartPolicy] = field(default_factory=dict)
    due: dict[str, float] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    back: set[str] = field(default_factory=set)

    def died(self, name: str) -> float | None:
        """Record a death of ``name``; the seconds until its restart, or None past the budget."""
        policy = self.policies.setdefault(name, RestartPolicy.from_params(self.params))
        delay = policy.failure()
        if delay is not None:
            self.due[name] = time.monotonic() + delay
        return delay

    def in_window(self, name: str) -> int:
        """Deaths of ``name`` within the policy's window."""
        p = self.policies.get(name)
        return 0 if p is None else p.failures_in_window()

    def take_due(self) -> list[tuple[str, int]]:
        """Names whose restart is due now, each with its restart number (removed from ``due``,
        added to ``back``)."""
        now = time.monotonic()
        out = []
        for name, t in sorted(self.due.items()):
            if now >= t:
                del self.due[name]
                n = self.restarts[name] = self.restarts.get(name, 0) + 1
                self.back.add(name)
                out.append((name, n))
        return out


__all__ = ["FRONT_RESTART", "IGNORED_SIGNALS", "SERVE_TICK_S", "FrontRestarts", "ignore_signals", "kill_group", "mark_slot_dead",
           "next_tick", "segment_gone"]
