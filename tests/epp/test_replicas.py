"""Two ``dplb-epp`` replicas on one node share the segment and its state directory (issue 30:
"several EPP processes share one view"): one replica's dispatch is load the other's policy sees,
and the share of a replica killed with SIGKILL is given back by the survivor's next health tick
(the router's ledger, :mod:`router.ledger`)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import orjson
import pytest

from bench.fakes import start_fake
from epp.envoy import EnvoySettings, bootstrap_yaml, envoy_argv
from launcher.stack import wait_for
from tests.helpers import ROOT, free_port, script, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
SLOW = {"x-fake-mode": "stream", "x-fake-delay": "0.5", "x-fake-chunks": "60"}


def start_epp(procs, run_dir, shm, eps, i):
    port = free_port()
    child = procs.start([script("dplb-epp"), "--shm", shm, "--endpoints-file", str(eps), "--policy", "shortest_queue",
                         "--port", str(port), "--health-port", str(free_port()), "--metrics-port", "0",
                         "--state-dir", os.path.join(run_dir, "state"), "--log-level", "info"],
                        log=os.path.join(run_dir, f"epp-{i}.log"), cwd=str(ROOT))
    wait_for_port(port, timeout=60)
    return child, port


def start_envoy(procs, run_dir, epp_port, i):
    port, admin = free_port(), free_port()
    cfg = Path(run_dir) / f"envoy-{i}.yaml"
    cfg.write_text(bootstrap_yaml(EnvoySettings(listen_port=port, admin_port=admin, epp_port=epp_port)))
    child = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, f"envoy-{i}.log"), cwd=str(ROOT))
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE", 90,
             f"Envoy {i} ready", children=[child])
    return f"http://127.0.0.1:{port}"


class Stream:
    """A slow stream held open in a thread until :meth:`close`; ``worker`` once its head came."""

    def __init__(self, base: str) -> None:
        self.worker: str | None = None
        self.ended = threading.Event()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(base,), daemon=True)
        self._t.start()

    def _run(self, base: str) -> None:
        try:
            with httpx.Client(timeout=60) as c, c.stream("POST", base + "/v1/chat/completions", headers=SLOW,
                                                         content=orjson.dumps({**CHAT, "stream": True})) as r:
                self.worker = r.headers["x-dplb-worker-id"]
                for _ in r.iter_raw():
                    if self._stop.is_set():
                        return
        except httpx.HTTPError:
            pass
        finally:
            self.ended.set()

    def close(self) -> None:
        self._stop.set()
        self._t.join(30)


def test_replicas_share_the_load_and_a_killed_one_is_given_back(procs, run_dir, segment, shm_name):
    fakes = [start_fake(procs, None, i, run_dir, port=free_port()) for i in range(2)]
    eps = Path(run_dir) / "endpoints.yaml"
    eps.write_text("".join(f"- {{address: '{f.endpoint}', model: fake-model}}\n" for f in fakes))
    (e1, p1) = start_epp(procs, run_dir, shm_name, eps, 1)
    wait_for(lambda: sum(int(s.state) == 2 for s in segment.snapshot()) == 2, 60, "two ready slots", children=[e1])
    (e2, p2) = start_epp(procs, run_dir, shm_name, eps, 2)
    g1, g2 = start_envoy(procs, run_dir, p1, 1), start_envoy(procs, run_dir, p2, 2)
    slots = {s.worker_id for s in segment.snapshot() if int(s.state) == 2}

    def inflight(wid: int) -> int:
        return int(segment.router_line(wid)["router_inflight"])

    held = Stream(g1)                                   # replica 1 dispatches a long stream
    wait_for(lambda: held.worker is not None, 30, "the held stream's head")
    busy = int(held.worker)                             # type: ignore[arg-type]
    assert inflight(busy) == 1
    # replica 2's shortest_queue sees replica 1's request in the shared router line: the other worker, every time
    (spare,) = slots - {busy}
    for _ in range(4):
        # the spare worker's scraped batch back to empty first: a scrape taken while the last
        # request ran there says running 1 until the next tick, a tie with the busy worker
        wait_for(lambda: segment.read_slot(spare).num_running + segment.read_slot(spare).num_waiting == 0, 15,
                 "the spare worker's scraped batch empty")
        r = httpx.post(g2 + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200 and int(r.headers["x-dplb-worker-id"]) != busy, r.headers
    # replica 2 takes a stream of its own (the idle worker), then dies with SIGKILL
    other = Stream(g2)
    wait_for(lambda: other.worker is not None, 30, "replica 2's stream head")
    idle = int(other.worker)                            # type: ignore[arg-type]
    assert idle != busy and idle in slots and inflight(idle) == 1
    procs.kill(e2)
    # replica 1's health tick gives the dead replica's share back; its own request still counts
    wait_for(lambda: inflight(idle) == 0, 15, "the killed replica's share given back")
    assert inflight(busy) == 1
    other.close()
    held.close()
    wait_for(lambda: all(inflight(w) == 0 for w in slots), 15, "router lines back to zero")
