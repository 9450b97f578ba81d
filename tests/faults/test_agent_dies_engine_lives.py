"""An engine outlives its agent. ``kill -9`` of a worker agent sent its engine SIGTERM
(``PR_SET_PDEATHSIG``): the streams it was generating ended HTTP 200 ``finish_reason: "abort"``
after a few of their tokens, and the restarted agent started a fresh engine (on a GPU box: the KV
cache and minutes of model loading thrown away for the crash of a small Python process).

Now the engine keeps serving through the agent's death, the launcher restarts the agent, the new
agent finds the engine (``<run-dir>/engine-<K>.pid``: pid, start time, address) and re-attaches:
the same engine pid, no stream cut, the worker back in routing. Real launches with sim engines;
nothing asserts a tight time (the recovery bound is generous for a busy 2-core machine; the
measured figure goes to ``bench/results/faults.md``)."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import httpx
import orjson
import psutil
import pytest

from tests.helpers import launched, metric, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

MAX_TOKENS = 60


@dataclass
class Stream:
    """One streamed chat request through the router: when it ran, which worker served it, its
    status, how many content chunks came back, its finish reason, an error event if any."""

    t_start: float
    t_end: float = 0.0
    worker: str | None = None
    status: int = 0
    chunks: int = 0
    finish: str | None = None
    error: str | None = None


async def _one(client: httpx.AsyncClient, i: int) -> Stream:
    s = Stream(time.monotonic())
    body = {"model": "sim-llama-3.1-8b", "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"tell me a story {i}"}]}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            s.status, s.worker = r.status_code, r.headers.get("x-dplb-worker-id")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                ev = orjson.loads(line[6:])
                if "error" in ev:
                    s.error = str(ev["error"])
                    continue
                for ch in ev.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        s.chunks += 1
                    s.finish = ch.get("finish_reason") or s.finish
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    s.t_end = time.monotonic()
    return s


async def _load(base: str, clients: int, until: list[float]) -> list[Stream]:
    """``clients`` loops sending streams back to back until ``until[0]`` (monotonic s)."""
    out: list[Stream] = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        async def loop(c: int) -> None:
            n = 0
            while time.monotonic() < until[0]:
                out.append(await _one(client, c * 1000 + n))
                n += 1

        await asyncio.gather(*(loop(c) for c in range(clients)))
    return out


def test_kill9_of_an_agent_under_streamed_load_cuts_no_request_and_keeps_its_engine():
    from dplb_shm import Segment

    victim = 1
    seen: set[int] = set()
    with launched("--num-workers", "2", "--engine", "sim", "--time-scale", "0.25", "--agent-restart-backoff", "0.5",
                  prefix="dplb-t-adel-", seen=seen) as L:
        seg = Segment.attach(L.shm, readonly=True)
        try:
            before = seg.read_slot(victim)
            agent, engine = int(before.pid), int(before.engine_pid)
            assert engine > 0 and before.state.name == "READY"
            seen.add(engine)
            until = [time.monotonic() + 600.0]
            marks: dict[str, float] = {}

            async def scenario() -> list[Stream]:
                task = asyncio.ensure_future(_load(f"http://127.0.0.1:{L.port}", 4, until))
                await asyncio.sleep(2.0)
                marks["kill"] = time.monotonic()
                os.kill(agent, signal.SIGKILL)
                # back in routing: the slot READY under a new agent pid (polled, generous bound)
                deadline = time.monotonic() + 120.0
                while time.monotonic() < deadline:
                    s = seg.read_slot(victim)
                    if s.state.name == "READY" and int(s.pid) not in (0, agent):
                        marks["ready"] = time.monotonic()
                        break
                    await asyncio.sleep(0.02)
                until[0] = time.monotonic() + 3.0   # keep the load on after it is back
                return await task

            streams = asyncio.run(scenario())
            assert "ready" in marks, "the worker did not come back:\n" + L.logs()
            after = seg.read_slot(victim)
            # the same engine, re-attached by a new agent; the agent restart counted as one, not as an engine's
            assert int(after.engine_pid) == engine and int(after.pid) != agent, (after.pid, after.engine_pid)
            assert psutil.Process(engine).status() != psutil.STATUS_ZOMBIE
            assert (after.agent_restarts, after.restarts, after.state.name) == (1, 0, "READY")
            # no stream was cut: every one complete, none ended "abort", none with an error event
            cut = [s for s in streams if s.status != 200 or s.error or s.finish != "length" or s.chunks < MAX_TOKENS]
            assert not cut, cut[:5]
            # streams the victim's engine was generating when its agent died finished whole
            spanning = [s for s in streams if s.worker == str(victim) and s.t_start < marks["kill"] < s.t_end]
            assert spanning, "no stream was running on the victim at the kill"
            # and the worker takes requests again once back
            assert any(s.worker == str(victim) and s.t_start > marks["ready"] for s in streams)
            recovery = marks["ready"] - marks["kill"]
            print(f"\nkill -9 of agent {victim}: {len(streams)} streams, {len(spanning)} spanning the kill, 0 cut; "
                  f"back in routing after {recovery:.2f} s; engine pid {engine} unchanged")
            assert recovery < 60.0, recovery
            out = L.out()
            assert f"dplb: worker {victim} killed by SIGKILL (-9); restarting its agent" in out, out[-3000:]
            assert "engine killed" not in out and "engine restart" not in out, out[-3000:]
            # counted where the alerts look: a counter of its own, not the engine's
            text = httpx.get(f"http://127.0.0.1:{L.port}/metrics", timeout=30).text
            assert metric(text, "dplb_worker_agent_restarts_total", worker=str(victim)) == 1.0
            assert metric(text, "dplb_worker_engine_restarts_total", worker=str(victim)) == 0.0
            rlog = (L.run_dir / "router.log").read_text(errors="replace")
            assert f"worker {victim}: ready -> dead (agent_exited)" in rlog and "engine killed" not in rlog
            wait_until(lambda: f"agent restart 1 (the previous agent, pid {agent}, died)" in
                       (L.run_dir / f"agent-{victim}.log").read_text(errors="replace"), timeout=10,
                       what="the agent log names the agent restart")
        finally:
            seg.close()
