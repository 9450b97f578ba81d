"""One gateway stack per test module: fake engines on loopback TCP ports (no agents), ``dplb-epp``
scraping them from an endpoints file into a segment of the test's, two agent-like fakes that own
slots of that segment (``agent-model`` on TCP, ``uds-model`` on a Unix socket), and real Envoys (``BUFFERED``,
``FULL_DUPLEX_STREAMED`` and eager ``STREAMED`` request bodies, and ``STREAMED`` with the response side
observed) routing through it. Every process is killed and the
segment unlinked at teardown, even when a test fails; each wait is bounded."""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.fakes import FakeHandle, start_fake
from tests.helpers import ROOT, Procs, free_port, script, unique_shm_name

STARTUP_S = 90.0   # Envoy and the picker on a busy 2-core box: seconds, not minutes


def live_slots(seg: Any) -> dict[str, Any]:
    """The non-empty slots of ``seg`` by endpoint."""
    return {s.endpoint: s for s in seg.snapshot() if int(s.state) != 0}


@dataclass
class Gateway:
    """The started stack: ``envoy`` (base URL of the BUFFERED Envoy), ``duplex`` (base URL of the
    FULL_DUPLEX_STREAMED one), ``early`` (the STREAMED one: the body sent without waiting for the
    head's answer), ``fakes`` (the engines), ``seg`` (the picker's segment, attached),
    ports of the picker, the access logs, and the dead endpoint's model."""

    envoy: str
    duplex: str
    early: str
    fakes: list[FakeHandle]
    seg: Any
    epp_port: int
    health_port: int
    metrics_port: int
    access_log: Path
    run_dir: str
    dead_model: str = "dead-model"
    agent: FakeHandle | None = None
    procs: Procs = field(default_factory=Procs)
    #: the STREAMED Envoy whose response side is a second, observing ext_proc filter (epp.observe)
    observed: str = ""

    def slots(self) -> dict[str, Any]:
        """The live slots by endpoint."""
        return live_slots(self.seg)

    def log_tail(self, lines: int = 30) -> str:
        """The picker's last log lines (for assertion messages)."""
        try:
            return "\n".join(Path(self.run_dir, "epp.log").read_text().splitlines()[-lines:])
        except OSError as e:
            return str(e)

    def idle(self) -> bool:
        """Every slot's router line back to zero (in flight, outstanding prefill, decoding)."""
        for s in self.seg.snapshot():
            if int(s.state) == 0:
                continue
            line = self.seg.router_line(s.worker_id)
            if line["router_inflight"] or line["prefill_tokens"] or line["decode_reqs"] or line["decode_ctx_tokens"]:
                return False
        return True


def _start_envoy(procs: Procs, run_dir: str, epp_port: int, mode: str, access_log: Path, observe: bool = False) -> str:
    from epp.envoy import EnvoySettings, bootstrap_yaml, envoy_argv
    from launcher.stack import wait_for

    port, admin = free_port(), free_port()
    name = mode.lower() + ("-observe" if observe else "")
    cfg = Path(run_dir) / f"envoy-{name}.yaml"
    cfg.write_text(bootstrap_yaml(EnvoySettings(listen_port=port, admin_port=admin, epp_port=epp_port,
                                                request_body_mode=mode, access_log=str(access_log),
                                                observe_response=observe)))
    child = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, f"envoy-{name}.log"), cwd=str(ROOT))

    def ready() -> bool:
        return httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE"

    wait_for(ready, STARTUP_S, f"Envoy ({mode}) admin /ready", children=[child])
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateway():
    """The module's :class:`Gateway` (see the module docstring)."""
    from dplb_shm import Segment
    from launcher.stack import wait_for

    run_dir = tempfile.mkdtemp(prefix="dplb-epp-", dir="/tmp")
    name = unique_shm_name()
    procs = Procs()
    seg = Segment.create(name, num_slots=16)
    try:
        fakes = [start_fake(procs, None, i, run_dir, port=free_port()) for i in range(3)]
        # agent-like workers of the segment itself: one on a TCP port, one on a Unix socket
        agent = start_fake(procs, name, 3, run_dir, "--model", "agent-model", port=free_port())
        start_fake(procs, name, 4, run_dir, "--model", "uds-model")
        dead = f"127.0.0.1:{free_port()}"   # nothing listens there
        eps = Path(run_dir) / "endpoints.yaml"
        eps.write_text("".join(f"- {{address: '{f.endpoint}', model: fake-model}}\n" for f in fakes)
                       + f"- {{address: '{dead}', model: dead-model}}\n")
        epp_port, health_port, metrics_port = free_port(), free_port(), free_port()
        # a busy machine can stall the picker past the default 1 s heartbeat limit (the router tests' value)
        conf = Path(run_dir) / "dplb.yaml"
        conf.write_text("health_check:\n  heartbeat_timeout_ms: 2000\n")
        epp = procs.start([script("dplb-epp"), "--config", str(conf), "--shm", name, "--endpoints-file", str(eps),
                           "--policy", "round_robin",
                           "--port", str(epp_port), "--health-port", str(health_port), "--metrics-port",
                           str(metrics_port), "--state-dir", os.path.join(run_dir, "state"), "--log-level", "info"],
                          log=os.path.join(run_dir, "epp.log"), cwd=str(ROOT))
        want = {f.endpoint for f in fakes} | {agent.endpoint}

        def picker_ready() -> bool:
            ready = {ep for ep, s in live_slots(seg).items() if int(s.state) == 2}
            return want <= ready and httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).status_code == 200

        wait_for(picker_ready, STARTUP_S, "dplb-epp with 3 ready endpoints", children=[epp])
        access = Path(run_dir) / "access.log"
        envoy = _start_envoy(procs, run_dir, epp_port, "BUFFERED", access)
        duplex = _start_envoy(procs, run_dir, epp_port, "FULL_DUPLEX_STREAMED", Path(run_dir) / "access-duplex.log")
        early = _start_envoy(procs, run_dir, epp_port, "STREAMED", Path(run_dir) / "access-early.log")
        observed = _start_envoy(procs, run_dir, epp_port, "STREAMED", Path(run_dir) / "access-observe.log", observe=True)
        yield Gateway(envoy, duplex, early, fakes, seg, epp_port, health_port, metrics_port, access, run_dir, agent=agent,
                      procs=procs, observed=observed)
    finally:
        try:
            procs.close()
        finally:
            seg.close()
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
            shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def redis(procs, run_dir):
    """A real redis-server on a free loopback port (:class:`tests.epp.redis_server.RedisServer`),
    killed at teardown."""
    from tests.epp.redis_server import RedisServer

    return RedisServer(procs, run_dir).start()


@pytest.fixture
def segs():
    """A factory of 4-slot segments (each a replica's own, as on its own node), unlinked and
    closed at teardown."""
    made = []

    def make() -> Any:
        from dplb_shm import Segment

        s = Segment.create(unique_shm_name(), num_slots=4)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.unlink()
            s.close()
