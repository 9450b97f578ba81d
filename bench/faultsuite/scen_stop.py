"""Issue 27 item 6, a stop under traffic (row ``27.6``); see :mod:`bench.faultsuite.scenarios`.

The whole launcher (``python -m launcher``, what ``scripts/launch_dplb.sh`` execs) with 2 sim
workers whose engine steps take ``--base-step-ms 25`` (a 40-64 token stream lasts about 1-1.6 s),
and 16 clients that each send streamed chat completions one after the other. Mid-way through the
first streams the launcher gets SIGINT (Ctrl-C). Every client goes on sending until it gets an
answer that is not a 200 (or the stop is older than the drain limit), so requests keep arriving
while the workers drain.

What a stop that drains for real gives: every 200 stream ends with ``[DONE]`` and a normal
``finish_reason`` (``stop``/``length``, never ``abort``: an engine stopped under a stream), every
refused request is a 503 with ``Retry-After`` and an OpenAI-shaped body (every worker draining),
nothing is reset before a status, no agent reached its drain limit, and the launcher exits 0.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

from bench.faultsuite.common import Result
from bench.faultsuite.load import (
    Outcome,
    chat,
    openai_error,
    send,
    sse_events,
)
from launcher.stack import ProcessGroup, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
#: engine step time of the sim workers, ms: streams last ~1-1.6 s (vLLM's ~6 ms would end them before the stop)
STEP_MS = 25


@dataclass
class _Answer:
    """One request of the scenario: its :class:`Outcome` plus what this scenario checks."""

    out: Outcome
    retry_after: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    after_stop: bool = False   # sent after the SIGINT


def finish_reasons(body: bytes) -> list[str]:
    """Every non-null ``finish_reason`` of an SSE chat stream's events, in order."""
    out = []
    for e in sse_events(body):
        if not e.startswith(b"{"):
            continue
        try:
            d = orjson.loads(e)
        except orjson.JSONDecodeError:
            continue
        for c in d.get("choices") or ():
            if isinstance(c, dict) and c.get("finish_reason") is not None:
                out.append(str(c["finish_reason"]))
    return out


async def _send(client: httpx.AsyncClient, body: dict[str, Any], timeout: float) -> _Answer:
    """One streamed request (:func:`bench.faultsuite.load.send`), its ``Retry-After`` and finish reasons."""
    o = await send(client, body, timeout=timeout)
    return _Answer(o, o.headers.get("retry-after"), finish_reasons(o.body) if o.status == 200 else [])


def _tree(pid: int) -> set[int]:
    try:
        return {p.pid for p in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _kill_left(pids: set[int]) -> list[int]:
    """SIGKILL whatever of ``pids`` still runs (not a zombie); returns them."""
    left = []
    for pid in sorted(pids):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                continue
            os.kill(pid, signal.SIGKILL)
            left.append(pid)
        except (psutil.Error, OSError):
            pass
    return left


def _traffic(url: str, launcher: Any, clients: int, stop_after_s: float, drain_timeout_s: float,
             answers: list[_Answer]) -> float:
    """The load and the stop: ``clients`` streaming clients (staggered by 20 ms) each send one
    stream after another into ``answers`` until refused, the launcher gone or the stop older than
    the drain limit; SIGINT to the launcher ``stop_after_s`` in. Returns the stop's monotonic time."""
    box: dict[str, float] = {}

    async def client(k: int, c: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.02 * k)          # staggered: the streams do not all end on one step
        i = 0
        while True:
            stop_at = box.get("stop_at")
            if stop_at is not None and time.monotonic() - stop_at > drain_timeout_s:
                return
            a = await _send(c, chat(stream=True, max_tokens=40 + (k * 7 + i * 5) % 25, tag=f"{k}-{i}"),
                            timeout=drain_timeout_s + 30)
            a.after_stop = stop_at is not None
            answers.append(a)
            i += 1
            if a.out.status != 200 or launcher.poll() is not None:
                return

    async def go() -> None:
        limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(60.0)) as c:
            tasks = [asyncio.ensure_future(client(k, c)) for k in range(clients)]
            await asyncio.sleep(stop_after_s + 0.02 * clients)
            box["stop_at"] = time.monotonic()
            os.kill(launcher.pid, signal.SIGINT)
            await asyncio.gather(*tasks)

    asyncio.run(go())
    return box["stop_at"]


def _judge(res: Result, answers: list[_Answer], agent_logs: str, out_text: str) -> None:
    """Count the answers into ``res``: a 200 stream with a finish reason other than stop/length and
    a 503 without Retry-After are lost here (what ``classify()`` calls ok or honest); the extras."""
    for a in answers:
        o = a.out
        if o.status == 200 and o.kind == "ok" and any(r not in ("stop", "length") for r in a.finish_reasons or ["none"]):
            o.kind, o.detail = "lost", f"200 stream cut by the stop: finish_reason {a.finish_reasons}"
        elif o.status == 503 and not a.retry_after:
            o.kind, o.detail = "lost", "503 without Retry-After"
    res.add([a.out for a in answers])
    res.extra["statuses"] = dict(Counter(a.out.status for a in answers))
    res.extra["finish_reasons"] = dict(Counter(r for a in answers for r in a.finish_reasons))
    res.extra["sent_after_stop"] = sum(a.after_stop for a in answers)
    res.extra["refused_503"] = sum(1 for a in answers if a.out.status == 503)
    res.extra["refused_without_retry_after"] = [
        f"{a.out.status} {a.out.body[:120]!r}" for a in answers
        if a.out.status is not None and a.out.status != 200
        and not (a.out.status == 503 and a.retry_after and _openai_error(a.out.body))]
    res.extra["aborted_200"] = [f"w={a.out.worker} {a.finish_reasons}" for a in answers
                                if a.out.status == 200 and (not a.finish_reasons
                                                            or any(r not in ("stop", "length") for r in a.finish_reasons))]
    res.extra["reset_before_status"] = [a.out.detail for a in answers if a.out.status is None]
    res.extra["drain_limit_hit"] = agent_logs.count("drain deadline passed")
    res.extra["launcher_tail"] = out_text[-600:]


def run_stop_under_traffic(policy: str = "dplb", clients: int = 16, drain_timeout_s: float = 10.0,
                           stop_after_s: float = 0.6, start_timeout_s: float = 240.0) -> Result:
    """Ctrl-C of the launcher while ``clients`` streams run (see the module docstring).

    ``extra``: ``statuses`` (per status of every answer; ``None``: no status), ``finish_reasons``
    (of the 200 streams), ``in_flight_at_stop`` (streams begun and not ended at the SIGINT),
    ``sent_after_stop``, ``refused_without_retry_after``, ``reset_before_status`` (details),
    ``launcher_rc``, ``stop_s`` (SIGINT → launcher exit), ``drain_limit_hit`` (agent logs that say
    the drain limit passed with requests in flight), ``left_running`` (pids killed afterwards)."""
    port = free_port()
    base_dir = Path(tempfile.mkdtemp(prefix="dplb-stop-", dir="/tmp"))
    run_dir, log = base_dir / "rd", base_dir / "launch.out"
    res = Result(f"27.6 a stop under traffic ({policy})",
                 f"SIGINT of the launcher {stop_after_s:g} s into {clients} concurrent streams (2 sim workers, "
                 f"{STEP_MS} ms steps, --drain-timeout {drain_timeout_s:g}); clients keep sending until refused")
    argv = [sys.executable, "-m", "launcher", "--num-workers", "2", "--port", str(port), "--run-dir", str(run_dir),
            "--policy", policy, "--drain-timeout", f"{drain_timeout_s:g}", "--start-timeout", f"{start_timeout_s:g}",
            "--", "--base-step-ms", str(STEP_MS)]
    seen: set[int] = set()
    answers: list[_Answer] = []
    with ProcessGroup(grace_s=5.0) as pg:
        try:
            launcher = pg.start(argv, name="launcher", log=log, cwd=ROOT)
            wait_for(lambda: "DPLB ready" in log.read_text(errors="replace") or launcher.poll() is not None,
                     start_timeout_s + 30, "the launch's ready banner", interval=0.2)
            if launcher.poll() is not None:
                raise RuntimeError(f"the launch exited before ready:\n{log.read_text(errors='replace')[-3000:]}")
            seen |= _tree(launcher.pid)
            t_begin = time.monotonic()
            stop_at = _traffic(f"http://127.0.0.1:{port}", launcher, clients, stop_after_s, drain_timeout_s, answers)
            res.extra["in_flight_at_stop"] = sum(1 for a in answers if a.out.t_start <= stop_at <= a.out.t_end)
            try:
                rc: int | None = launcher.popen.wait(drain_timeout_s + 40)
            except subprocess.TimeoutExpired:
                rc = None
            res.extra["launcher_rc"] = rc
            res.extra["stop_s"] = round(time.monotonic() - stop_at, 3) if rc is not None else None
            res.extra["run_s"] = round(time.monotonic() - t_begin, 3)
        finally:
            seen |= _tree(launcher.pid) if "launcher" in locals() else set()
            out_text = log.read_text(errors="replace") if log.exists() else ""
            agent_logs = "".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("agent-*.log")))
            res.extra["left_running"] = _kill_left(seen)
            shm = f"/dev/shm/dplb-{port}"
            if os.path.exists(shm):
                os.unlink(shm)
            shutil.rmtree(base_dir, ignore_errors=True)
    _judge(res, answers, agent_logs, out_text)
    return res


def _openai_error(body: bytes) -> bool:
    try:
        return openai_error(orjson.loads(body))
    except orjson.JSONDecodeError:
        return False


__all__ = ["finish_reasons", "run_stop_under_traffic"]
