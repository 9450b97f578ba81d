"""``dplb-shm-dump``: print the live worker table of a DPLB segment.

Usage::

    dplb-shm-dump [--shm NAME] [--watch SECONDS] [--json] [--all] [--heartbeat-timeout-ms MS]

Without ``--shm`` it attaches to the only DPLB segment in /dev/shm (and lists them if there are
several). ``--json`` prints ``{"version", "name", "generation", "num_slots", "workers": [...]}``
where each worker is :meth:`WorkerSnapshot.to_dict`; ``--watch`` redraws every SECONDS.
EMPTY slots are hidden unless ``--all``. ``agent_pid`` is the worker agent's pid (``-`` for a
mirrored remote worker: the slot's writer is the router that mirrors it), ``engine_pid`` the engine process the agent
spawned (``-``: none, e.g. an attached server), ``model`` the model the engine serves; ``done`` /
``fail`` the request attempts the routers saw the worker answer / fail (5xx, connection error,
broken stream: the router stats line, local and mirrored workers alike); ``restarts`` the engine's
restarts, ``agent_rst`` the agent's; ``exit`` the engine's last exit status (``3``; ``SIGKILL``
for a signal; ``-``: it never exited; JSON: ``-9`` and null, :mod:`dplb_shm.exits`). The table's state column says ``stale`` for a READY slot
whose heartbeat is older than ``--heartbeat-timeout-ms`` (default: the router's
``health_check.heartbeat_timeout_ms`` default): its agent is gone or stuck and no router routes to
it, the rule ``/dplb/status`` applies (:func:`dplb_shm.heartbeat_stale`); ``stale(mid-write)``
for a slot whose writer stopped inside a write (its seqlock sequence stays odd: no router routes
to it until its agent writes again). ``--json`` keeps the slot's own state (the ``/dplb/state``
shape) with ``heartbeat_age_ms`` and ``stale`` beside it.

Exit status: 0 ok; 1 no segment / segment error; 2 wrong magic or layout version, several
segments and no ``--shm``, or bad usage.
"""
from __future__ import annotations

import argparse
import sys
import time

import orjson

from dplb_shm import (
    HEARTBEAT_TIMEOUT_MS,
    LayoutMismatchError,
    Segment,
    SegmentError,
    WorkerSnapshot,
    WorkerState,
    heartbeat_stale,
)
from dplb_shm.discover import list_segments
from dplb_shm.exits import exit_label

COLUMNS = ("id", "state", "agent_pid", "engine_pid", "model", "hb_age_ms", "run", "wait", "infl", "r_infl", "kv%", "mem_gb",
           "ttft_ms", "tpot_ms", "e2e_ms", "done", "fail", "restarts", "agent_rst", "exit", "circ", "endpoint")
CIRCUIT = {0: "closed", 1: "open", 2: "half"}


def _fmt_ms(v: float) -> str:
    return "-" if v < 0 else f"{v:.1f}"


def _fmt_exit(s: WorkerSnapshot) -> str:
    """The engine's last exit status (:func:`dplb_shm.exits.exit_label` of
    :attr:`WorkerSnapshot.exit_code`): ``3``, ``SIGKILL``, or ``-`` while it never exited."""
    return exit_label(s.exit_code)


def state_label(s: WorkerSnapshot, heartbeat_timeout_ms: float = HEARTBEAT_TIMEOUT_MS) -> str:
    """The state column: the slot's state in lower case; ``stale`` for a READY slot whose
    heartbeat is older than ``heartbeat_timeout_ms`` (:func:`dplb_shm.heartbeat_stale`), and
    ``stale(mid-write)`` for a slot whose writer stopped inside a write
    (:attr:`WorkerSnapshot.stale`), whatever its torn state field says."""
    if s.stale:
        return "stale(mid-write)"
    return "stale" if heartbeat_stale(s.state, s.heartbeat_age_ms, heartbeat_timeout_ms) else s.state.name.lower()


def _row(s: WorkerSnapshot, heartbeat_timeout_ms: float) -> tuple[str, ...]:
    mem = "-" if s.gpu_mem_total_bytes < 0 else f"{s.gpu_mem_used_bytes / 1e9:.1f}/{s.gpu_mem_total_bytes / 1e9:.0f}"
    return (str(s.worker_id), state_label(s, heartbeat_timeout_ms), "-" if s.mirrored else str(s.pid),
            str(s.engine_pid or "-"),
            s.model or "-", _fmt_ms(s.heartbeat_age_ms),
            str(s.num_running), str(s.num_waiting), str(s.inflight), str(s.router_inflight),
            "-" if s.kv_cache_usage < 0 else f"{100 * s.kv_cache_usage:.1f}", mem,
            _fmt_ms(s.ttft_ms), _fmt_ms(s.tpot_ms), _fmt_ms(s.e2e_ms), str(s.completed), str(s.failed),
            str(s.restarts), str(s.agent_restarts), _fmt_exit(s), CIRCUIT.get(s.circuit, str(s.circuit)), s.endpoint)


def render_table(seg: Segment, show_all: bool = False, heartbeat_timeout_ms: float = HEARTBEAT_TIMEOUT_MS) -> str:
    """The worker table of ``seg`` as text (one header line, one line per shown slot; a READY
    slot's heartbeat older than ``heartbeat_timeout_ms`` ms shows as ``stale``)."""
    snaps = [s for s in seg.snapshot() if show_all or s.state != WorkerState.EMPTY]
    rows = [COLUMNS] + [_row(s, heartbeat_timeout_ms) for s in snaps]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    head = (f"segment {seg.name}  layout v{seg.version}  slots {seg.num_slots}  "
            f"generation {seg.generation}  workers {len(snaps)}")
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def render_json(seg: Segment, show_all: bool = False) -> bytes:
    """The JSON document printed by ``--json`` (UTF-8 bytes, no trailing newline)."""
    workers = [s.to_dict() for s in seg.snapshot() if show_all or s.state != WorkerState.EMPTY]
    return orjson.dumps({"version": seg.version, "name": seg.name, "generation": seg.generation,
                         "num_slots": seg.num_slots, "workers": workers})


def _pick_name(args: argparse.Namespace) -> str | None:
    if args.shm:
        return args.shm
    found = list_segments()
    if not found:
        print("dplb-shm-dump: no DPLB segment in /dev/shm (give --shm NAME)", file=sys.stderr)
        return None
    if len(found) > 1:
        names = ", ".join(f"{i.name} (v{i.version})" for i in found)
        print(f"dplb-shm-dump: several DPLB segments, choose one with --shm: {names}", file=sys.stderr)
        raise SystemExit(2)
    return found[0].name


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``dplb-shm-dump``; returns the exit status."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="dplb-shm-dump", description="Print the live DPLB worker table.")
    p.add_argument("--shm", help="segment name (default: the only DPLB segment in /dev/shm)")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="redraw every SECONDS until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--all", action="store_true", help="also show EMPTY slots")
    p.add_argument("--heartbeat-timeout-ms", type=float, default=float(HEARTBEAT_TIMEOUT_MS), metavar="MS",
                   help="a READY slot with an older heartbeat shows as stale; give the router's "
                        f"health_check.heartbeat_timeout_ms if it is not the default (default: {HEARTBEAT_TIMEOUT_MS})")
    args = p.parse_args(argv)
    if args.watch is not None and not args.watch > 0:
        p.error("--watch needs a positive number of seconds")
    if not args.heartbeat_timeout_ms > 0:
        p.error("--heartbeat-timeout-ms needs a positive number of milliseconds")
    name = _pick_name(args)
    if name is None:
        return 1
    try:
        seg = Segment.attach(name, readonly=True)
    except LayoutMismatchError as e:
        print(f"dplb-shm-dump: {e}", file=sys.stderr)
        return 2
    except SegmentError as e:
        print(f"dplb-shm-dump: {e}", file=sys.stderr)
        return 1
    try:
        while True:
            if args.json:
                sys.stdout.buffer.write(render_json(seg, args.all) + b"\n")
            else:
                text = render_table(seg, args.all, args.heartbeat_timeout_ms)
                if args.watch is not None and sys.stdout.isatty():
                    sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
                sys.stdout.write(text + "\n")
            sys.stdout.flush()
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        return 0
    finally:
        seg.close()


if __name__ == "__main__":
    sys.exit(main())
