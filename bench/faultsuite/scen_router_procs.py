"""Issue 27 item 4: a router process killed with requests in flight (row ``27.4``); see
:mod:`bench.faultsuite.scenarios`."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from typing import Any

import httpx

from bench.faultsuite.cluster import Stack
from bench.faultsuite.common import Result
from bench.faultsuite.load import Outcome, chat, send
from dplb_shm.exits import exit_words
from launcher.stack import wait_for

FIELDS = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")


def router_line_totals(seg: Any, n: int) -> dict[str, int]:
    """Each router-line counter of :data:`FIELDS` summed over slots ``0..n-1`` of ``seg``."""
    out = dict.fromkeys(FIELDS, 0)
    for i in range(n):
        line = seg.router_line(i)
        for k in FIELDS:
            out[k] += int(line[k])
    return out


def _router_pids(base: str, want: int, tries: int = 200) -> set[int]:
    """The pids of the router processes answering on ``base`` (each new connection lands on one)."""
    pids: set[int] = set()
    for _ in range(tries):
        pids.add(int(httpx.get(base + "/dplb/status", timeout=10).json()["pid"]))
        if len(pids) >= want:
            break
    return pids


def _held_by_process(base: str, want: int, tries: int = 200) -> dict[int, int]:
    """Each router process's own in-flight requests (``local_inflight`` summed over its
    ``/dplb/status`` rows), by pid, from fresh connections until ``want`` processes answered."""
    held: dict[int, int] = {}
    for _ in range(tries):
        d = httpx.get(base + "/dplb/status", timeout=10).json()
        held[int(d["pid"])] = sum(int(w.get("local_inflight") or 0) for w in d["workers"])
        if len(held) >= want:
            break
    return held


def _stream_headers(i: int, hold_s: float) -> dict[str, str]:
    """The fake worker's mode for stream ``i``: even ones in prefill (the head out, the first
    token ``hold_s`` away), odd ones decoding one chunk every 0.1 s for ``hold_s``."""
    if i % 2 == 0:
        return {"x-fake-mode": "stream", "x-fake-chunks": "1", "x-fake-first-delay": str(hold_s)}
    return {"x-fake-mode": "stream", "x-fake-chunks": str(int(hold_s / 0.1)), "x-fake-delay": "0.1"}


async def _streams_and_kill(st: Stack, base: str, n: int, hold_s: float, box: dict[str, Any]) -> list[Outcome]:
    """``n`` streams; once all are in flight, SIGKILL of the router process holding fewer of them
    (none when one process holds them all: ``box`` then has no ``t_kill``). Into ``box``: ``held``
    (streams per process), ``victim``, ``at_kill`` (router-line totals), ``t_kill``, and once the
    victim's share has left the lines, ``share_left_s`` and ``cut``. Returns every stream's outcome."""
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(60)) as ac:
        tasks = [asyncio.ensure_future(send(ac, chat(stream=True, tag=i), headers=_stream_headers(i, hold_s),
                                            timeout=60))
                 for i in range(n)]
        t0 = time.monotonic()
        while router_line_totals(st.seg, 2)["router_inflight"] < n and time.monotonic() - t0 < 30:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)   # the decoding half past its first chunk
        # the kernel hands each new connection to either process, not evenly: a burst can
        # land on one; the victim must hold some streams and its peer the rest
        held = await asyncio.to_thread(_held_by_process, base, 2)
        box["held"] = held
        if len(held) < 2 or min(held.values()) == 0:
            return list(await asyncio.gather(*tasks))   # no kill: the caller tries again
        box["victim"] = victim = min(held)
        box["at_kill"] = router_line_totals(st.seg, 2)
        box["t_kill"] = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # the victim's clients see their connections break at once: that is its share
        while time.monotonic() - box["t_kill"] < 10:
            cut = sum(1 for t in tasks if t.done())
            if cut and router_line_totals(st.seg, 2)["router_inflight"] <= n - cut:
                box["share_left_s"] = time.monotonic() - box["t_kill"]
                box["cut"] = cut
                break
            await asyncio.sleep(0.02)
        return list(await asyncio.gather(*tasks))


def _kill_phase(st: Stack, base: str, n: int, hold_s: float, res: Result) -> dict[str, Any]:
    """:func:`_streams_and_kill` until a process was killed (3 tries); the outcomes into ``res``,
    with ``victim_held``, ``at_kill``, ``cut_by_the_kill``, the detection time, and the recovery
    time (every router line back to 0). Returns the kill's ``box``."""
    box: dict[str, Any] = {}
    for _attempt in range(3):
        box.clear()
        outs = asyncio.run(_streams_and_kill(st, base, n, hold_s, box))
        res.add(outs)
        if "t_kill" in box:
            break
    else:
        raise AssertionError(f"3 tries, each time one router process held every stream: {box.get('held')}")
    res.extra["victim_held"] = box["held"][box["victim"]]
    res.extra["at_kill"] = box.get("at_kill")
    res.extra["cut_by_the_kill"] = sum(1 for o in outs if o.kind != "ok")
    res.detection_s = box.get("share_left_s")
    t_done = time.monotonic()
    try:
        wait_for(lambda: not any(router_line_totals(st.seg, 2).values()), 15, "router lines back to 0")
        res.recovery_s = time.monotonic() - box["t_kill"]
    except TimeoutError:
        pass
    res.extra["after_streams"] = router_line_totals(st.seg, 2)
    res.extra["zero_after_streams_s"] = round(time.monotonic() - t_done, 3)
    return box


def _burst_phase(base: str, burst: int, res: Result) -> None:
    """``burst`` slow requests at once after the kill: into ``res`` with ``burst_lost`` and
    ``burst_split`` (requests per worker)."""
    async def burst_of(k: int) -> list[Outcome]:
        async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=k),
                                     timeout=httpx.Timeout(60)) as ac:
            return list(await asyncio.gather(*(send(ac, chat(tag=f"b{i}"), headers={"x-fake-mode": "slow",
                                                                                   "x-fake-delay": "0.3"})
                                               for i in range(k))))

    bouts = asyncio.run(burst_of(burst))
    res.add(bouts)
    res.extra["burst_lost"] = sum(1 for o in bouts if o.kind != "ok")
    res.extra["burst_split"] = dict(sorted(Counter(o.worker for o in bouts).items(), key=lambda kv: str(kv[0])))


def run_router_process_killed(n: int = 40, hold_s: float = 4.0, burst: int = 40) -> Result:
    """``--workers 2`` in front of two fake workers; ``n`` streams in flight (half still in prefill,
    their first byte ``hold_s`` away, half decoding one chunk every 0.1 s for ``hold_s``), then
    SIGKILL of one router process. The killed process's share of every slot's in-flight,
    prefill and decode counts must leave within a health tick or so (its clients' connections
    break: nothing can answer them), everything must be back to 0 once the surviving streams
    end, a later burst of ``burst`` must split evenly, and the parent must log the death."""
    res = Result("27.4 kill -9 of one of two router processes", f"SIGKILL of one router process (--workers 2) "
                 f"with {n} streams in flight, then a burst of {burst}")
    with Stack() as st:
        for i in range(2):
            st.fake(i)
        # the admission queue's TPOT rule off: the decoding streams pace at 0.1 s per chunk, exactly
        # the default bound (tpot_slo_s), which admission reads as a full batch; a stream that
        # reaches the router after they paced 8 chunks (a busy client) would wait for them to end,
        # and the kill needs all n in flight at once. The queue stays in the path (its TTFT rule).
        base = st.router({"admission": {"tpot_slo_s": 0}}, "--workers", "2", ready=2)
        pids = _router_pids(base, 2)
        if len(pids) < 2:
            raise AssertionError(f"only router process(es) {pids} answered")
        victim = _kill_phase(st, base, n, hold_s, res)["victim"]
        _burst_phase(base, burst, res)
        try:   # the parent starts a replacement; on a busy machine its import can take seconds
            wait_for(lambda: len(_router_pids(base, 2, tries=20)) == 2, 60, "two router processes again")
        except TimeoutError:
            pass
        res.extra["processes_after"] = sorted(_router_pids(base, 2))
        with open(st.routers[-1][0].log or os.devnull, errors="replace") as f:
            log = f.read()
        res.extra["death_logged"] = f"router process {victim} died ({exit_words(-signal.SIGKILL)})" in log
    return res


__all__ = ["FIELDS", "router_line_totals", "run_router_process_killed"]
