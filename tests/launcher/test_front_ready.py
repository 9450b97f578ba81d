"""``--gateway envoy`` is ready only once Envoy's pool cluster holds every worker (a CI failure: the
banner came when every slot was READY and Envoy's ``/ready`` answered, before the picker's EDS file
reached Envoy, and the first chat completion failed). A stand-in admin API (loopback, a thread)
answers ``/ready``, ``/metrics`` and ``/clusters?format=json`` with as many pool hosts as a test sets."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import orjson
import pytest

from epp.envoy import POOL_CLUSTER
from launcher.gpus import GpuPlan
from launcher.host import envoy_cluster_hosts
from launcher.plan import LaunchPlan
from launcher.specs import WorkerPlan
from launcher.supervisor import Supervisor


class Admin:
    """What the stand-in answers: ``hosts`` pool hosts, or ``body`` verbatim for ``/clusters``."""

    hosts = 0
    body: bytes | None = None


@pytest.fixture
def admin() -> Iterator[tuple[str, int, type[Admin]]]:
    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.startswith("/clusters"):
                body = Admin.body if Admin.body is not None else orjson.dumps({"cluster_statuses": [
                    {"name": "epp", "host_statuses": [{"address": {}}]},
                    {"name": POOL_CLUSTER, "host_statuses": [{"address": {}}] * Admin.hosts}]})
            elif self.path in ("/ready", "/metrics"):
                body = b"ok"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    Admin.hosts, Admin.body = 0, None
    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", srv.server_port, Admin
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def supervisor(port: int, n: int) -> Supervisor:
    cfg = LaunchPlan(num_workers=n, plan=GpuPlan(num_workers=n, groups=[[]] * n), engine="sim",
                       run_dir=Path("/tmp/dplb-front-ready-test"),
                       workers=[WorkerPlan(engine="sim", model="m") for _ in range(n)],
                       gateway="envoy", envoy_admin_port=port, epp_metrics_port=port)
    return Supervisor(cfg)


def test_envoy_front_is_ready_only_with_every_worker_in_the_pool(admin):
    _, port, state = admin
    sup = supervisor(port, 2)
    for hosts, ready in ((0, False), (1, False), (2, True)):
        state.hosts = hosts
        assert sup.front_ready() is ready, hosts


def test_cluster_hosts_reads_the_named_cluster_and_is_zero_on_anything_else(admin):
    url, _, state = admin
    state.hosts = 3
    assert envoy_cluster_hosts(url, POOL_CLUSTER) == 3
    assert envoy_cluster_hosts(url, "epp") == 1
    assert envoy_cluster_hosts(url, "no_such_cluster") == 0
    for bad in (b"not json", b"[1, 2]", b'{"cluster_statuses": 7}', b'{"cluster_statuses": [3]}'):
        state.body = bad
        assert envoy_cluster_hosts(url, POOL_CLUSTER) == 0, bad
    assert envoy_cluster_hosts("http://127.0.0.1:1", POOL_CLUSTER) == 0   # nothing listening
