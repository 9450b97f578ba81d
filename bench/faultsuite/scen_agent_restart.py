"""Issue 27 item 5, dead agents come back: ``kill -9`` of a worker agent under a real launch.

``27.5``: ``python -m launcher --num-workers 3 --engine sim`` (the supervisor, its router, three real
agents with sim engines), steady non-streamed load, ``kill -9`` of worker 2's agent (the pid its
slot shows, as ``dplb-shm-dump`` prints it). Before the fix the launcher printed ``worker 2 exited
with status -9`` and nothing else: the slot said READY with a heartbeat growing old, worker 2 took
no request until the whole stack restarted, and ``POST /dplb/workers/2/restart`` answered 502.
Now the launcher marks the slot DEAD (``agent_exited``) at once, restarts the agent after its
backoff, the new agent claims slot 2 again with a fresh engine, and worker 2 serves again.

*detection*: kill → the slot reads DEAD; *recovery*: kill → the slot READY again under the new
agent's pid (``first_served_s``: kill → the first request answered by worker 2,
``X-DPLB-Worker-ID: 2``, again).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.faultsuite.common import Result
from bench.faultsuite.load import Outcome, chat, send, steady
from launcher.stack import ROOT, ProcessGroup, free_port, wait_for

CHAT = "/v1/chat/completions"


class SlotStates:
    """Polls slot ``wid`` of a read-only segment in a thread: every (time, state, state_reason,
    pid) seen, in order."""

    def __init__(self, seg: Any, wid: int, interval: float = 0.01) -> None:
        self.seg, self.wid, self.interval = seg, wid, interval
        self.seen: list[tuple[float, str, str, int]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.seg.read_slot(self.wid)
                cur = (s.state.name, s.state_reason.name, int(s.pid))
                if not self.seen or self.seen[-1][1:] != cur:
                    self.seen.append((time.monotonic(), *cur))
            except Exception:  # noqa: BLE001 - the segment goes away at the stop
                return
            time.sleep(self.interval)

    def start(self) -> SlotStates:
        """Start polling."""
        self._t.start()
        return self

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._t.join(2)

    def first(self, state: str, after: float = 0.0) -> float | None:
        """When ``state`` was first seen at or after ``after`` (monotonic s), else None."""
        return next((t for t, st, _, _ in self.seen if st == state and t >= after), None)


def _finish_reason(o: Outcome) -> str | None:
    """``choices[0].finish_reason`` of a non-streamed answer (None when there is none)."""
    import orjson

    try:
        return str(orjson.loads(o.body)["choices"][0]["finish_reason"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def _until_served(base: str, victim: int, back_within_s: float) -> list[Outcome]:
    """The load ended before the victim came back: one request after another (0.1 s apart) until
    worker ``victim`` answers one, or ``back_within_s`` pass."""
    async def go() -> list[Outcome]:
        got: list[Outcome] = []
        deadline = time.monotonic() + back_within_s
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            while time.monotonic() < deadline:
                o = await send(client, chat(tag=f"after{len(got)}", max_tokens=8))
                got.append(o)
                if o.worker == str(victim) and o.kind == "ok":
                    break
                await asyncio.sleep(0.1)
        return got

    return asyncio.run(go())


def _recovery(res: Result, outs: list[Outcome], watch: SlotStates, victim: int, old_pid: int, t0: float,
              base: str, back_within_s: float) -> float:
    """Detection (kill → the slot DEAD), recovery (kill → READY under a new pid) and
    ``first_served_s`` (kill → the victim's first answer again, asking on after the load when
    needed) into ``res``. Returns the time from which the victim's answers count as after its
    restart (the slot read DEAD, else 5 s after the kill)."""
    dead_at = watch.first("DEAD", t0)
    # requests sent once its slot read DEAD reach worker 2 only through its new agent
    t_out = dead_at if dead_at is not None else t0 + 5.0
    back = [o for o in outs if o.worker == str(victim) and o.kind == "ok" and o.t_start > t_out]
    if not back:
        more = _until_served(base, victim, back_within_s)
        res.add(more)
        back = [o for o in more if o.worker == str(victim) and o.kind == "ok"]
    ready_again = next((t for t, st, _, pid in watch.seen if st == "READY" and pid != old_pid), None)
    res.recovery_s = None if ready_again is None else ready_again - t0
    res.extra["first_served_s"] = round(back[0].t_end - t0, 3) if back else None
    res.detection_s = None if dead_at is None else dead_at - t0
    return t_out


def _victim_extras(res: Result, seg: Any, watch: SlotStates, victim: int, old_pid: int, gen0: int, t0: float,
                   t_out: float, out: Path) -> None:
    """What the victim's slot, the answers, ``dplb-shm-dump`` and the launcher's output (``out``)
    say after the restart, into ``res.extra`` (see :func:`run_killed_agent_restarted`)."""
    from dplb_shm import dump

    watch.stop()
    snap = seg.read_slot(victim)
    res.extra.update(
        old_pid=old_pid, new_pid=int(snap.pid), generation=(gen0, seg.generation),
        slot_seen=[(st, reason.lower(), pid) for _, st, reason, pid in watch.seen],
        by_worker=dict(Counter(o.worker for o in res.outcomes if o.kind == "ok")),
        served_by_victim_after=sum(1 for o in res.outcomes if o.worker == str(victim) and o.kind == "ok"
                                   and o.t_start > t_out),
        # answered by the old engine after its agent's kill, before the slot read DEAD (the
        # engine got SIGTERM with its agent): their finish reasons
        old_engine_answers=[_finish_reason(o) for o in res.outcomes if o.worker == str(victim)
                            and t0 <= o.t_end and o.t_start <= t_out],
        dump_state=next((line.split()[1] for line in dump.render_table(seg).splitlines()[2:]
                         if line.split()[0] == str(victim)), None),
        launcher_lines=[line for line in out.read_text(errors="replace").splitlines()
                        if line.startswith(f"dplb: worker {victim}")],
    )


def run_killed_agent_restarted(num_workers: int = 3, victim: int = 2, rate: float = 8.0, duration: float = 14.0,
                               kill_at: float = 2.0, backoff_s: float = 2.0, back_within_s: float = 60.0) -> Result:
    """The 27.5 scenario (module docstring). ``extra``: ``launcher_lines`` (what the launcher
    printed about the victim), ``slot_seen`` (its slot's (state, reason, pid) changes), ``old_pid``,
    ``new_pid``, ``generation`` (before, after), ``by_worker`` (answers per worker id),
    ``first_served_s``, ``old_engine_answers``,
    ``served_by_victim_after`` (requests it answered after its restart), ``admin_restart_while_down``
    (status and Retry-After of ``POST /dplb/workers/<victim>/restart`` while its slot is DEAD),
    ``admin_restart`` (its status once back), ``dump_state`` (the victim's state column)."""
    from dplb_shm import Segment

    res = Result("27.5 kill -9 of an agent: it comes back", f"SIGKILL of worker {victim}'s agent at t={kill_at:g}s "
                 f"under {rate:g} req/s, {num_workers} workers of a real launch (--agent-restart-backoff {backoff_s:g})")
    port = free_port()
    shm = f"dplb-{port}"
    tmp = tempfile.mkdtemp(prefix="dplb-ar-", dir="/tmp")
    run_dir = os.path.join(tmp, "rd")
    out = Path(tmp) / "launcher.out"
    base = f"http://127.0.0.1:{port}"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    procs = ProcessGroup(grace_s=60.0)
    seg = None
    watch: SlotStates | None = None
    try:
        launcher = procs.start([sys.executable, "-m", "launcher", "--num-workers", str(num_workers), "--engine", "sim",
                                "--port", str(port), "--run-dir", run_dir, "--time-scale", "20",
                                "--agent-restart-backoff", f"{backoff_s:g}", "--start-timeout", "150"],
                               name="launcher", log=out, env=env, cwd=str(ROOT))
        wait_for(lambda: "DPLB ready" in out.read_text(errors="replace"), 180, "the launch's ready banner",
                 interval=0.1, children=[launcher])
        seg = Segment.attach(shm, readonly=True)
        old_pid, gen0 = int(seg.read_slot(victim).pid), seg.generation
        watch = SlotStates(seg, victim).start()
        t_kill: list[float] = []

        def kill() -> None:
            t_kill.append(time.monotonic())
            os.kill(old_pid, signal.SIGKILL)
            # the admin restart while the agent is down: 502 before; now 503 + Retry-After (it is coming back)
            wait_for(lambda: seg.read_slot(victim).state.name == "DEAD", 10, "the victim's slot DEAD", interval=0.01)
            r = httpx.post(f"{base}/dplb/workers/{victim}/restart", timeout=10)
            res.extra["admin_restart_while_down"] = (r.status_code, r.headers.get("retry-after"))

        outs = asyncio.run(steady(base, rate, duration, lambda i: chat(tag=i, max_tokens=8), events={kill_at: kill}))
        res.add(outs)
        t0 = t_kill[0]
        t_out = _recovery(res, outs, watch, victim, old_pid, t0, base, back_within_s)
        _victim_extras(res, seg, watch, victim, old_pid, gen0, t0, t_out, out)
        res.extra["admin_restart"] = httpx.post(f"{base}/dplb/workers/{victim}/restart", timeout=10).status_code
        os.kill(launcher.pid, signal.SIGINT)
        try:
            res.extra["launcher_rc"] = launcher.wait(90)
        except Exception:  # noqa: BLE001 - the group is killed below
            res.extra["launcher_rc"] = None
    finally:
        if watch is not None:
            watch.stop()
        if seg is not None:
            seg.close()
        procs.close()
        if os.path.exists(f"/dev/shm/{shm}"):
            os.unlink(f"/dev/shm/{shm}")
        shutil.rmtree(tmp, ignore_errors=True)
    return res


__all__ = ["SlotStates", "run_killed_agent_restarted"]
