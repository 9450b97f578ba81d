"""A router process killed (SIGKILL) while requests wait in its admission queue
(docs/admission.md "Several router processes"): what it had dispatched leaves no accounting behind
in the segment, its peer process (``--workers 2``) keeps serving and dispatches its own queued
requests as room frees, and a client that retries its broken request is served.

Two fake workers with ``max_num_seqs`` 3 behind a ``round_robin`` router (a policy without a TTFT
estimate has room while the chosen worker's in-flight count, summed over every router process in
the segment, is below ``max_num_seqs``): 6 requests hold the cluster, the rest wait in the two
processes' queues. If the killed process's in-flight counts stayed in the segment, the survivor
would never see room again and its queued requests would wait their budget and be answered 429.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest

from bench.faultsuite.scen_router_procs import router_line_totals
from tests.helpers import wait_until

pytestmark = [pytest.mark.timeout(300)]

MODEL = "fake-model"
SEATS = 3                       # max_num_seqs of each fake worker
N = 24                          # requests: 2 x SEATS dispatched at once, the rest queued
HOLD_S = 5.0                    # each answer streams for about this long
CONFIG = {"routing_policy": {"policy": "round_robin"},
          "admission": {"enabled": True, "queue_budget_s": 120, "shed_late": False}}
def _by_process(base: str, want: int = 2, tries: int = 200) -> dict[int, tuple[int, int]]:
    """``pid -> (requests it has in flight, requests waiting in its queue)`` from fresh connections
    (each lands on either process) until ``want`` processes answered."""
    out: dict[int, tuple[int, int]] = {}
    for _ in range(tries):
        d = httpx.get(base + "/dplb/status", timeout=10).json()
        out[int(d["pid"])] = (sum(int(w.get("local_inflight") or 0) for w in d["workers"]),
                              int(d["admission"]["depth"]))
        if len(out) >= want:
            break
    return out


async def _one(ac: httpx.AsyncClient, i: int, log: list[tuple[int, str]]) -> int:
    """One streamed chat request, retried (at most 3 times) when its connection breaks, as an
    OpenAI client does; returns the final status; ``log`` gets ``(i, outcome)`` per try."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"req {i}"}], "max_tokens": 4, "stream": True}
    hdr = {"x-fake-mode": "stream", "x-fake-chunks": str(int(HOLD_S / 0.1)), "x-fake-delay": "0.1"}
    for _ in range(3):
        try:
            async with ac.stream("POST", "/v1/chat/completions", json=body, headers=hdr) as r:
                text = (await r.aread()).decode(errors="replace")
                if r.status_code == 200 and "[DONE]" not in text:
                    log.append((i, "cut"))
                    continue
                log.append((i, str(r.status_code)))
                return r.status_code
        except httpx.TransportError as e:
            log.append((i, type(e).__name__))
    return -1


def test_killed_router_process_with_a_queue_leaks_nothing_and_its_peer_serves_on(make_cluster):
    c = make_cluster(2, CONFIG, fake_args=[["--max-num-seqs", str(SEATS)]] * 2, router_args=("--workers", "2"))
    assert len(_by_process(c.base)) == 2, "two router processes answer"
    box: dict = {}
    log: list[tuple[int, str]] = []

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=N + 8, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=c.base, limits=limits, timeout=httpx.Timeout(120)) as ac:
            tasks = [asyncio.ensure_future(_one(ac, i, log)) for i in range(N)]
            # the cluster full and both processes with requests waiting (new connections land on
            # either process, not evenly: each must hold some)
            t0 = time.monotonic()
            seen: dict[int, tuple[int, int]] = {}
            while time.monotonic() - t0 < 2 * HOLD_S:
                seen = await asyncio.to_thread(_by_process, c.base)
                if (len(seen) == 2 and router_line_totals(c.seg, 2)["router_inflight"] == 2 * SEATS
                        and all(q > 0 for _, q in seen.values()) and any(f > 0 for f, _ in seen.values())):
                    break
                await asyncio.sleep(0.1)
            else:
                box["skip"] = seen
                return list(await asyncio.gather(*tasks))
            victim = max(seen, key=lambda p: seen[p][0])   # it holds dispatched requests and a queue
            box["victim"], box["seen"] = victim, seen
            box["at_kill"] = router_line_totals(c.seg, 2)
            os.kill(victim, signal.SIGKILL)
            return list(await asyncio.gather(*tasks))

    for _attempt in range(3):   # new connections land on either process unevenly: try again
        box.clear()
        log.clear()
        statuses = asyncio.run(run())
        if "skip" not in box:
            break
    else:
        pytest.fail(f"3 tries, never both processes with a queue while the cluster was full: {box['skip']}")
    victim_inflight, victim_queued = box["seen"][box["victim"]]
    assert victim_inflight > 0 and victim_queued > 0
    assert box["at_kill"]["router_inflight"] == 2 * SEATS
    # every request was served: the survivor's own (dispatched and queued) at once, the victim's
    # on the client's retry; nothing was shed (the survivor's queue saw room again) or failed
    assert statuses == [200] * N, (statuses, log)
    assert any(o != "200" for _, o in log), log     # the victim's clients saw their connections break
    # the accounting the victim held left the segment: every line back to 0
    wait_until(lambda: not any(router_line_totals(c.seg, 2).values()), 30, what="router lines back to 0")
    # the parent replaced the victim; both processes serve and their queues are empty
    wait_until(lambda: len(_by_process(c.base, tries=20)) == 2, 60, what="two router processes again")
    after = _by_process(c.base)
    assert box["victim"] not in after and all(q == 0 for _, q in after.values()), after
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                   timeout=30)
    assert r.status_code == 200
