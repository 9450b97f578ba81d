"""Issue 27 item 7, admin races on a remote worker; see :mod:`bench.faultsuite.scenarios`.

``27.7`` (one router process) and ``27.7w`` (two, ``--workers 2``): 4 threads × 50 cycles of
``POST /dplb/workers {"endpoint": <one remote agent>}`` then ``DELETE /dplb/workers/<the id it
answered>`` of the same endpoint while a light request loop runs. Before the fix a DEAD slot was
left in the segment, a DELETE of it answered 200 "removed" and changed nothing, and POSTs answered
201 with ``worker_id: null``. Every answer is kept; the scenario then reads the segment (which
slots are not EMPTY), the router's listing, and asks once more for a DELETE of a removed id.
``27.7k``: the router process that owns mirror slots is stopped, then killed, while a DELETE
answered by the other process waits for it (:func:`run_mirror_owner_killed`).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import httpx

from bench.faultsuite.cluster import Stack
from bench.faultsuite.common import Result
from bench.faultsuite.load import chat, steady

ADMIN = "/dplb/workers"


def _cycles(base: str, endpoint: str, n: int, log: list[tuple[str, int, Any, Any]], deadline: float) -> None:
    """``n`` add/remove cycles of ``endpoint`` (stops early at ``deadline``, time.monotonic());
    appends ``(verb, status, worker_id or id, body)`` per call to ``log``."""
    with httpx.Client(base_url=base, timeout=30) as c:
        for _ in range(n):
            if time.monotonic() > deadline:
                return
            r = c.post(ADMIN, json={"endpoint": endpoint})
            body = r.json()
            wid = body.get("worker_id")
            log.append(("POST", r.status_code, wid, body))
            if not isinstance(wid, int):
                continue
            r = c.delete(f"{ADMIN}/{wid}")
            log.append(("DELETE", r.status_code, wid, r.json()))


def run_concurrent_add_remove(threads: int = 4, cycles: int = 50, router_workers: int = 1,
                              budget_s: float = 120.0, rate: float = 8.0) -> Result:
    """Two local fake workers (slots 0 and 1) and one remote fake agent on TCP (no slot of its
    own, mirrored by the router); ``threads`` × ``cycles`` concurrent add/remove cycles of that
    agent (stopped at ``budget_s``) while ``rate`` req/s flow. ``extra``: every admin answer's
    status counted per verb, the POSTs answered 2xx without an integer ``worker_id``, the slots
    left non-EMPTY in the segment, the router's remote rows, and a DELETE of a removed id."""
    from bench.fakes import start_fake
    from launcher.stack import free_port

    res = Result(f"27.7{'w' if router_workers > 1 else ''} concurrent add/remove of a remote worker",
                 f"{threads} threads x {cycles} POST+DELETE cycles of one remote agent's endpoint, "
                 f"{rate:.0f} req/s, {router_workers} router process(es)")
    with Stack() as st:
        st.fake(0)
        st.fake(1)
        port = free_port()
        start_fake(st.procs, None, 9, st.dir, port=port)      # a "remote" agent on TCP: no slot of its own
        endpoint = f"127.0.0.1:{port}"
        args = ("--workers", str(router_workers)) if router_workers > 1 else ()
        base = st.router({"health_check": {"interval_ms": 100}}, *args, ready=2)
        # first one at a time, each call on a fresh connection (with --workers 2 both processes answer)
        seq: list[tuple[int, int]] = []
        for _ in range(6):
            r = httpx.post(base + ADMIN, json={"endpoint": endpoint}, timeout=30)
            wid = r.json().get("worker_id")
            seq.append((r.status_code, httpx.delete(f"{base}{ADMIN}/{wid}", timeout=30).status_code))
        res.extra["one_at_a_time"] = dict(Counter(seq))
        log: list[tuple[str, int, Any, Any]] = []
        deadline = time.monotonic() + budget_s
        ts = [threading.Thread(target=_cycles, args=(base, endpoint, cycles, log, deadline), daemon=True)
              for _ in range(threads)]
        t0 = time.monotonic()
        for t in ts:
            t.start()
        done = threading.Event()

        def joiner() -> None:
            for t in ts:
                t.join(budget_s + 60)
            done.set()

        threading.Thread(target=joiner, daemon=True).start()

        async def load() -> list[Any]:
            outs: list[Any] = []
            while not done.is_set():
                outs += await steady(base, rate, 1.0, lambda i: chat(tag=i), timeout=30)
            return outs

        res.add(asyncio.run(load()))
        res.extra["cycles_s"] = round(time.monotonic() - t0, 1)
        res.extra["calls"] = {v: dict(sorted(Counter(s for vv, s, _, _ in log if vv == v).items()))
                              for v in ("POST", "DELETE")}
        res.extra["cycles_done"] = sum(1 for v, *_ in log if v == "POST")
        res.extra["post_2xx_without_id"] = sum(1 for v, s, w, _ in log
                                               if v == "POST" and 200 <= s < 300 and not isinstance(w, int))
        res.extra["unexpected"] = [(v, s, b) for v, s, _, b in log
                                   if (v == "POST" and s not in (200, 201, 409)) or (v == "DELETE" and s not in (200, 404))][:5]
        res.extra["nonempty_slots"] = sorted(s.worker_id for s in st.seg.snapshot() if int(s.state) != 0)
        res.extra["dead_slots"] = sorted(s.worker_id for s in st.seg.snapshot() if int(s.state) == 4)
        # the list is the answering process's registry, which drops a released slot at its next
        # health tick (100 ms here; with --workers 2 the other process's tick): a row may outlive
        # the last DELETE by a tick or two on a busy machine, never for 5 s
        settle = time.monotonic() + 5.0
        while True:
            rows = httpx.get(base + ADMIN, timeout=10).json()["workers"]
            res.extra["remote_rows"] = sorted(w["id"] for w in rows if w.get("remote") or w["control"] == endpoint)
            if not res.extra["remote_rows"] or time.monotonic() > settle:
                break
            time.sleep(0.1)
        removed = next((w for v, s, w, _ in reversed(log) if v == "DELETE" and s == 200), 15)
        r = httpx.delete(f"{base}{ADMIN}/{removed}", timeout=10)
        res.extra["delete_removed"] = (r.status_code, r.json().get("error", {}).get("type"))
        res.extra["served_by"] = dict(Counter(o.worker for o in res.outcomes))
    return res


def run_mirror_owner_killed() -> Result:
    """``27.7k``: with two router processes, the one that writes mirror slots is stopped (SIGSTOP),
    a remote worker's DELETE is sent (the other process answers it, and waits for the owner), then
    the owner is killed (SIGKILL): the other process takes the slots over, applies the DELETE and
    answers; no slot is left that no process owns. ``extra``: the DELETE's answer and time, the
    slot's state after it, the owners' pids before and after."""
    import os
    import signal

    from bench.fakes import start_fake
    from launcher.stack import free_port, wait_for

    res = Result("27.7k mirror owner killed mid-remove", "SIGSTOP then SIGKILL of the router process that owns mirror "
                 "slots while a DELETE of a remote worker waits for it (--workers 2)")
    with Stack() as st:
        st.fake(0)
        port = free_port()
        start_fake(st.procs, None, 9, st.dir, port=port)
        ep = f"127.0.0.1:{port}"
        base = st.router({"health_check": {"interval_ms": 100}}, "--workers", "2", ready=1)
        wait_for(lambda: len({httpx.get(base + "/dplb/status", timeout=5).json()["pid"] for _ in range(10)}) == 2,
                 30, "both router processes answering")
        r = httpx.post(base + ADMIN, json={"endpoint": ep}, timeout=30)
        assert r.status_code == 201, r.text
        wid = r.json()["worker_id"]
        res.extra["post"] = (r.status_code, wid)
        owner = st.seg.read_slot(wid).pid
        res.extra["owner_is_a_router"] = owner != os.getpid() and owner > 0
        os.kill(owner, signal.SIGSTOP)
        box: dict[str, Any] = {}

        def delete() -> None:
            t = time.monotonic()
            with httpx.Client(timeout=30) as c:              # a fresh connection: the stopped process cannot take it
                rr = c.delete(f"{base}{ADMIN}/{wid}")
            box["answer"] = (rr.status_code, rr.json())
            box["s"] = time.monotonic() - t

        th = threading.Thread(target=delete, daemon=True)
        th.start()
        time.sleep(0.5)
        res.extra["answered_while_owner_stopped"] = "answer" in box
        os.kill(owner, signal.SIGKILL)
        th.join(30)
        res.extra["delete"] = box.get("answer", (None, None))[0]
        res.extra["delete_s"] = round(box.get("s", -1.0), 2)
        res.extra["slot_state_after"] = int(st.seg.read_slot(wid).state)
        r = httpx.post(base + ADMIN, json={"endpoint": ep}, timeout=30)
        res.extra["readded"] = (r.status_code, r.json().get("worker_id"))
        res.extra["new_owner"] = st.seg.read_slot(wid).pid if int(st.seg.read_slot(wid).state) else None
        res.extra["new_owner_differs"] = res.extra["new_owner"] not in (None, owner)
        outs = asyncio.run(steady(base, 10.0, 1.0, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
    return res
