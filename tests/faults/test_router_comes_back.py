"""The router comes back, and signals with no meaning kill nothing.

A router process that died took the whole stack down: with one router process, SIGHUP or SIGUSR1
(or any crash) to it made the launcher print ``the router is gone; stopping`` and stop every agent
and engine; SIGUSR1 to the launcher killed it silently and left the segment and its lock file
behind. Now the launcher restarts a dead router with a bounded backoff (the new router gives back
the dead one's accounting share), and SIGHUP/SIGUSR1/SIGUSR2 to the router, SIGUSR1/SIGUSR2 to the
launcher are logged and ignored. Real launches with sim engines; nothing asserts a tight time (the
recovery figures go to ``bench/results/faults.md``)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from tests.helpers import launched, wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

BODY = {"model": "sim-llama-3.1-8b", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


def _router_pid(launch) -> int:  # type: ignore[no-untyped-def]
    """The launch's router process (its child running ``-m router``)."""
    for p in psutil.Process(launch.proc.pid).children(recursive=True):
        try:
            if "router" in p.cmdline() and "-m" in p.cmdline():
                return p.pid
        except psutil.Error:
            pass
    raise LookupError("no router process")


def _ok(url: str) -> bool:
    try:
        return httpx.post(f"{url}/chat/completions", json=BODY, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


async def _steady(url: str, until: list[float], out: list[tuple[float, int]]) -> None:
    """One request every 50 ms until ``until[0]``: (time, status; 0 for a connection error)."""
    async with httpx.AsyncClient(timeout=30) as c:
        async def one() -> None:
            t = time.monotonic()
            try:
                r = await c.post(f"{url}/chat/completions", json=BODY)
                out.append((t, r.status_code))
            except httpx.HTTPError:
                out.append((t, 0))

        tasks = []
        while time.monotonic() < until[0]:
            tasks.append(asyncio.ensure_future(one()))
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)


def test_kill9_of_the_only_router_process_under_load_the_launcher_restarts_it_and_the_stack_serves_again():
    from dplb_shm import Segment

    seen: set[int] = set()
    with launched("--num-workers", "2", "--engine", "sim", "--time-scale", "4", prefix="dplb-t-rcb-",
                  seen=seen) as L:
        old = _router_pid(L)
        agents_before = set(L.tree()) - {old}
        marks: dict[str, float] = {}
        outs: list[tuple[float, int]] = []

        async def scenario() -> None:
            until = [time.monotonic() + 600.0]
            load = asyncio.ensure_future(_steady(L.url, until, outs))
            await asyncio.sleep(1.5)
            marks["kill"] = time.monotonic()
            os.kill(old, signal.SIGKILL)
            await asyncio.sleep(0.2)
            deadline = time.monotonic() + 120.0
            while time.monotonic() < deadline and "back" not in marks:
                if any(t > marks["kill"] + 0.2 and st == 200 for t, st in outs):
                    marks["back"] = min(t for t, st in outs if t > marks["kill"] + 0.2 and st == 200)
                await asyncio.sleep(0.05)
            until[0] = time.monotonic() + 1.0
            await load

        asyncio.run(scenario())
        assert "back" in marks, "the stack did not serve again:\n" + L.logs()
        assert L.proc.poll() is None, L.logs()
        new = _router_pid(L)
        assert new != old
        # every agent and engine kept running: nothing of the workers was stopped
        assert agents_before <= set(L.tree()), (agents_before, L.tree())
        out = L.out()
        assert "dplb: router killed by SIGKILL (-9); restarting it in" in out, out[-3000:]
        assert f"dplb: router restarted (restart 1, pid {new})" in out and "stopping" not in out, out[-3000:]
        wait_until(lambda: "dplb: the router serves again" in L.out(), timeout=30, what="the launcher says so")
        recovery = marks["back"] - marks["kill"]
        print(f"\nkill -9 of the only router process: served again after {recovery:.2f} s "
              f"({sum(1 for _, st in outs if st == 200)} of {len(outs)} requests answered 200)")
        assert recovery < 60.0
        # the dead router's accounting share was given back: once idle, nothing counts in flight
        seg = Segment.attach(L.shm, readonly=True)
        try:
            wait_until(lambda: all(s.router_inflight == 0 for s in seg.snapshot()), timeout=30,
                       what="router_inflight back to 0 on every slot")
        finally:
            seg.close()
        assert _ok(L.url)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2])
def test_a_signal_with_no_meaning_to_the_router_is_logged_and_kills_nothing(sig):
    seen: set[int] = set()
    with launched("--num-workers", "1", "--engine", "sim", "--time-scale", "4", prefix="dplb-t-rsig-",
                  seen=seen) as L:
        pid = _router_pid(L)
        os.kill(pid, sig)
        log = L.run_dir / "router.log"
        wait_until(lambda: f"ignores {sig.name}" in log.read_text(errors="replace"), timeout=30,
                   what=f"the router logs {sig.name}")
        assert _router_pid(L) == pid and _ok(L.url)
        assert "the router is gone" not in L.out() and "restarting it" not in L.out()


def test_sigusr1_to_the_launcher_is_logged_and_it_still_stops_clean():
    seen: set[int] = set()
    with launched("--num-workers", "1", "--engine", "sim", "--time-scale", "4", prefix="dplb-t-lsig-",
                  seen=seen) as L:
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            os.kill(L.proc.pid, sig)
            wait_until(lambda s=sig: f"the launcher ignores {s.name}" in L.out(), timeout=30,
                       what=f"the launcher logs {sig.name}")
        assert L.proc.poll() is None and _ok(L.url)
        os.kill(L.proc.pid, signal.SIGINT)
        assert L.proc.wait(120) == 0, L.out()[-3000:]
        assert not os.path.exists(f"/dev/shm/{L.shm}")             # the segment removed
        assert not (L.run_dir / "launch.lock").exists()             # and the lock file


def _child_pid(launch, module: str) -> int:  # type: ignore[no-untyped-def]
    """The launch's child running ``-m <module>``."""
    for p in psutil.Process(launch.proc.pid).children():
        try:
            cmd = p.cmdline()
            if "-m" in cmd and module in cmd:
                return p.pid
        except psutil.Error:
            pass
    raise LookupError(f"no {module} process")


@pytest.mark.slow
def test_kill9_of_the_picker_under_envoy_the_launcher_restarts_it_and_the_gateway_serves_again():
    """Nothing brought ``dplb-epp`` back under ``--gateway envoy``: Envoy answered 500s and refused
    connections after its kill -9 until the whole launch was restarted."""
    seen: set[int] = set()
    body = {**BODY, "model": "sim-model"}
    with launched("--num-workers", "2", "--gateway", "envoy", "--engine", "sim", "--model", "sim-model",
                  "--time-scale", "4", "--start-timeout", "180", ready_timeout=240, prefix="dplb-t-eppcb-",
                  seen=seen) as L:
        old = _child_pid(L, "epp")
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: "dplb: dplb-epp restarted (restart 1" in L.out() or L.proc.poll() is not None,
                   timeout=60, what="the picker restarted")
        assert L.proc.poll() is None, L.logs()

        def serves() -> bool:
            try:
                return httpx.post(f"{L.url}/chat/completions", json=body, timeout=10).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(serves, timeout=120, interval=0.1, what="a request answered through Envoy again")
        print(f"\nkill -9 of dplb-epp: served again through Envoy after {time.monotonic() - t0:.2f} s")
        new = _child_pid(L, "epp")
        assert new != old and "the gateway is gone" not in L.out()
        wait_until(lambda: "dplb: the gateway serves again" in L.out(), timeout=60, what="the launcher says so")
