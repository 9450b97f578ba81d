"""``metrics.port`` / ``--metrics-port``: ``GET /metrics`` on a port of its own (router/metrics_port.py),
the same page as the main port's, whole-deployment with ``--workers 2``, refused when the port is taken."""
from __future__ import annotations

import socket
import subprocess
import sys

import httpx

from bench.fakes import MODEL
from launcher.stack import ROOT, free_port
from tests.helpers import metric, wait_until


def _requests(page: str) -> float:
    """Sum of ``dplb_router_requests_total`` over every worker and status on one page."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith("dplb_router_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _families(page: str) -> set[str]:
    return {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE ")}


def _chat(base: str) -> None:
    r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                   timeout=10)
    assert r.status_code == 200


def test_metrics_on_a_port_of_their_own(make_cluster):
    mport = free_port()
    c = make_cluster(2, router_args=("--metrics-port", str(mport)))
    for _ in range(3):
        _chat(c.base)
    mbase = f"http://127.0.0.1:{mport}"
    httpx.get(c.base + "/metrics", timeout=5)   # the first scrape starts the error series at 0
    main = httpx.get(c.base + "/metrics", timeout=5)
    side = httpx.get(mbase + "/metrics", timeout=5)
    assert side.status_code == 200 and main.status_code == 200
    assert side.headers["content-type"].startswith("text/plain")
    assert _requests(side.text) == 3 == _requests(main.text)
    assert _families(side.text) == _families(main.text)
    assert metric(side.text, "dplb_worker_ready", worker="0") == 1.0      # segment series read there too
    assert httpx.get(mbase + "/v1/models", timeout=5).status_code == 404  # the API is not served there
    assert httpx.post(mbase + "/v1/chat/completions", json={}, timeout=5).status_code == 404


def test_metrics_port_adds_up_every_router_process(make_cluster):
    """``--workers 2``: each process listens (SO_REUSEPORT); whichever answers a scrape reports every
    process's counts (prometheus_client's multiprocess files) and the segment's series once."""
    mport = free_port()
    c = make_cluster(2, router_args=("--workers", "2", "--metrics-port", str(mport)))
    n = 12
    for _ in range(n):
        _chat(c.base)
    mbase = f"http://127.0.0.1:{mport}"

    def scraped() -> int:
        with httpx.Client() as client:
            return _requests(client.get(mbase + "/metrics", timeout=5).text)

    # a process counts a non-streamed answer just after writing it: the other may be scraped first
    wait_until(lambda: scraped() == n, 10, what=f"{n} requests counted")
    for _ in range(8):   # new connections: the kernel hands them to either process
        with httpx.Client() as client:
            page = client.get(mbase + "/metrics", timeout=5).text
        assert _requests(page) == n
        assert page.count('dplb_worker_ready{model="') == 2


def test_a_taken_metrics_port_is_refused_with_its_cause(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "router", "--port", str(free_port()), "--shm", "dplb-test-none",
                            "--metrics-port", str(port)], cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=False)
    finally:
        holder.close()
    assert r.returncode == 2
    assert f"metrics.port {port}" in r.stderr and "in use" in r.stderr


def test_metrics_port_equal_to_the_main_port_is_a_config_error():
    from router.config import load_config
    from router.errors import ConfigError

    try:
        load_config(None, {"router.port": 30123, "metrics.port": 30123})
    except ConfigError as e:
        assert "metrics.port 30123 is router.port" in str(e)
    else:
        raise AssertionError("accepted")
