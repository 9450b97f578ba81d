"""Kubernetes discovery (:mod:`epp.kube`) against the API-server stand-in (tests/epp/kube_standin.py):
Ready pods become endpoints (pod IP × target port), NotReady, terminating and deleted pods leave,
a 410 Gone re-lists without losing the endpoints, a pool selector or port change re-selects, and
the endpoints reach the scrape manager's slots through the picker. Every wait is bounded; the
stand-in and the watch threads are stopped even on failure."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from epp.kube import PoolWatcher, api_client, default_namespace
from tests.epp.kube_standin import KubeStandIn, pod, pool

NS = "llm"
APP = {"app": "vllm"}
WAIT_S = 20.0


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll ``cond`` every 20 ms until truthy; fail naming ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def api(tmp_path: Any) -> Iterator[tuple[KubeStandIn, str]]:
    s = KubeStandIn(NS)
    s.start()
    try:
        yield s, s.kubeconfig(str(tmp_path / "kubeconfig"))
    finally:
        s.stop()


@pytest.fixture
def watcher(api: tuple[KubeStandIn, str]) -> Iterator[Callable[..., PoolWatcher]]:
    made: list[PoolWatcher] = []

    def make(**kw: Any) -> PoolWatcher:
        _, kc = api
        w = PoolWatcher("pool-a", default_namespace(kc), api_client(kc), backoff_s=0.1, **kw)
        w.start()
        made.append(w)
        return w

    try:
        yield make
    finally:
        for w in made:
            w.stop()


def test_namespace_from_kubeconfig(api: tuple[KubeStandIn, str]) -> None:
    assert default_namespace(api[1]) == NS


def test_ready_pods_are_endpoints_per_ip_and_port(api: tuple[KubeStandIn, str], watcher: Any) -> None:
    s, _ = api
    s.put("pools", pool("pool-a", APP, [8000, 8001]))
    s.put("pods", pod("p0", "10.0.0.1", APP, annotations={"dplb.io/model": "llama"}))
    s.put("pods", pod("p1", "10.0.0.2", APP, ready=False))
    s.put("pods", pod("p2", None, APP))                       # no IP yet
    s.put("pods", pod("other", "10.0.0.9", {"app": "sglang"}))  # not selected
    w = watcher()
    eps = wait_for(lambda: w.endpoints() or None, "the first endpoints")
    assert eps == {"10.0.0.1:8000": {"model": "llama", "weight": 1.0},
                   "10.0.0.1:8001": {"model": "llama", "weight": 1.0}}
    s.put("pods", pod("p1", "10.0.0.2", APP))                 # becomes Ready (a watch event)
    s.put("pods", pod("p3", "fd00::3", {**APP, "dplb.io/model": "qwen"}))
    wait_for(lambda: len(w.endpoints()) == 6, "p1 and p3 to appear")
    eps = w.endpoints()
    assert {"10.0.0.2:8000", "10.0.0.2:8001", "[fd00::3]:8000", "[fd00::3]:8001"} <= set(eps)
    assert eps["[fd00::3]:8000"]["model"] == "qwen" and eps["10.0.0.2:8000"]["model"] == ""
    assert w.poll() is not None and w.poll() is None          # poll: only changes


def test_not_ready_terminating_and_deleted_pods_leave(api: tuple[KubeStandIn, str], watcher: Any) -> None:
    s, _ = api
    s.put("pools", pool("pool-a", APP, [8000]))
    for i in range(3):
        s.put("pods", pod(f"p{i}", f"10.0.0.{i + 1}", APP))
    w = watcher()
    wait_for(lambda: len(w.endpoints()) == 3, "three endpoints")
    s.put("pods", pod("p0", "10.0.0.1", APP, ready=False))
    s.put("pods", pod("p1", "10.0.0.2", APP, deletionTimestamp="2026-01-01T00:00:00Z"))
    s.delete("pods", "p2")
    wait_for(lambda: not w.endpoints(), "every endpoint to leave")
    s.put("pods", pod("p0", "10.0.0.1", APP))
    wait_for(lambda: set(w.endpoints()) == {"10.0.0.1:8000"}, "p0 to come back")


def test_410_gone_relists_without_losing_endpoints(api: tuple[KubeStandIn, str], watcher: Any) -> None:
    s, _ = api
    s.put("pools", pool("pool-a", APP, [8000]))
    s.put("pods", pod("p0", "10.0.0.1", APP))
    w = watcher()
    wait_for(lambda: set(w.endpoints()) == {"10.0.0.1:8000"}, "p0")
    wait_for(lambda: s.watches["pods"] >= 1, "the pod watch")
    lists = w.relists
    seen: list[dict[str, Any]] = []
    s.expire()                                  # the open watch gets 410, history compacted
    s.put("pods", pod("p1", "10.0.0.2", APP))   # an event only a re-list can see now
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end and set(w.endpoints()) != {"10.0.0.1:8000", "10.0.0.2:8000"}:
        seen.append(w.endpoints())
        time.sleep(0.005)
    assert set(w.endpoints()) == {"10.0.0.1:8000", "10.0.0.2:8000"}
    assert w.relists > lists
    assert all("10.0.0.1:8000" in e for e in seen)   # p0 never left during the re-list


def test_stop_after_the_watch_closed_its_response_does_not_raise(api: tuple[KubeStandIn, str]) -> None:
    """A watch thread may close its response (stream end, 410, re-list) just as ``stop`` cuts it:
    urllib3's ``shutdown`` of a closed response raises ValueError, and a stop must not (CI saw this
    as a teardown error). The cut of a closed or never-opened response is a no-op. (A watcher never
    started holds the closed responses here: a started one would replace them with its own.)"""
    import io

    from urllib3.response import HTTPResponse

    _, kc = api
    w = PoolWatcher("pool-a", default_namespace(kc), api_client(kc), backoff_s=0.1)
    closed = HTTPResponse(body=io.BytesIO(b""), preload_content=False)
    closed.close()
    with pytest.raises(ValueError):
        closed.shutdown()                  # what the old cut let through
    w._cut(closed)                         # no error: nothing is blocked on a closed response
    w._pool_resp = w._pod_resp = closed
    w.stop()                               # the stop path cuts both, and skips unstarted threads
    assert not any(t.is_alive() for t in w._threads)


def test_stop_cuts_the_open_watches_and_joins_the_threads(api: tuple[KubeStandIn, str], watcher: Any) -> None:
    """Both watch threads are blocked in a watch of 60 s; ``stop`` ends them at once."""
    s, _ = api
    s.put("pools", pool("pool-a", APP, [8000]))
    s.put("pods", pod("p0", "10.0.0.1", APP))
    w = watcher()
    wait_for(lambda: s.watches["pods"] >= 1 and s.watches["pools"] >= 1, "both watches")
    w.stop(timeout_s=WAIT_S)
    assert not any(t.is_alive() for t in w._threads)


def test_periodic_resync_relists(api: tuple[KubeStandIn, str], watcher: Any) -> None:
    s, _ = api
    s.put("pools", pool("pool-a", APP, [8000]))
    w = watcher(resync_s=0.3, watch_timeout_s=1)
    wait_for(lambda: w.relists >= 3, "three re-lists")


def test_pool_selector_and_port_change_reselects(api: tuple[KubeStandIn, str], watcher: Any) -> None:
    s, _ = api
    s.put("pods", pod("v", "10.0.0.1", APP))
    s.put("pods", pod("g", "10.0.0.2", {"app": "sglang"}))
    w = watcher()
    time.sleep(0.2)
    assert w.endpoints() == {}                                 # no pool yet
    s.put("pools", pool("pool-a", APP, [8000]))
    wait_for(lambda: set(w.endpoints()) == {"10.0.0.1:8000"}, "the vllm pod")
    s.put("pools", pool("pool-a", {"app": "sglang"}, [8000]))
    wait_for(lambda: set(w.endpoints()) == {"10.0.0.2:8000"}, "the sglang pod after the selector change")
    s.put("pods", pod("g2", "10.0.0.3", {"app": "sglang"}))    # the new selector's watch sees it
    wait_for(lambda: set(w.endpoints()) == {"10.0.0.2:8000", "10.0.0.3:8000"}, "g2")
    s.put("pools", pool("pool-a", {"app": "sglang"}, [9000, 9001]))
    wait_for(lambda: set(w.endpoints()) == {f"10.0.0.{i}:{p}" for i in (2, 3) for p in (9000, 9001)}, "new ports")
    s.delete("pools", "pool-a")
    wait_for(lambda: w.endpoints() == {}, "no endpoints without the pool")


async def test_pool_endpoints_reach_the_scrape_slots(api: tuple[KubeStandIn, str], segment: Any, tmp_path: Any) -> None:
    """Through the picker: each pod IP × port claims a slot of the segment with the pod's model;
    a deleted pod gives its slots back."""
    import asyncio

    from epp.picker import Picker
    from router.config import Config
    from tests.epp.conftest import live_slots

    s, kc = api
    s.put("pools", pool("pool-a", APP, [18000, 18001]))
    s.put("pods", pod("p0", "127.0.0.1", APP, annotations={"dplb.io/model": "llama"}))
    cfg = Config.model_validate({"health_check": {"interval_ms": 100},
                                 "router": {"state_dir": str(tmp_path / "st")}})
    w = PoolWatcher("pool-a", NS, api_client(kc), backoff_s=0.1)
    p = Picker(cfg, segment, kube=w)
    await p.start()
    try:
        async def slots_are(want: set[str]) -> dict[str, Any]:
            for _ in range(int(WAIT_S / 0.05)):
                live = live_slots(segment)
                if set(live) == want:
                    return live
                await asyncio.sleep(0.05)
            pytest.fail(f"slots {set(live_slots(segment))}, wanted {want}")

        live = await slots_are({"127.0.0.1:18000", "127.0.0.1:18001"})
        assert {sl.model for sl in live.values()} == {"llama"}
        s.delete("pods", "p0")
        await slots_are(set())
    finally:
        await p.stop()


def test_cli_flags(tmp_path: Any, capsys: Any) -> None:
    from epp.__main__ import main

    assert main(["--namespace", "x"]) == 2                     # --namespace without --pool
    assert main(["--pool", "p", "--pool-resync", "0"]) == 2
    assert main(["--pool", "p", "--kubeconfig", str(tmp_path / "missing")]) == 2
    assert "Kubernetes client config" in capsys.readouterr().err
