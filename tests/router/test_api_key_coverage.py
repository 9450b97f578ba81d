"""Which endpoints ``router.api_key`` and ``router.admin_token`` guard (issue 32; docs/api.md,
"What the API key and the admin token guard").

The rule: ``/v1/*``, ``/generate`` and ``/dplb/route`` need the API key; admin calls need the admin
token (and a loopback client by default); ``/health`` is always open; the read-only pages that show
the deployment (``/metrics``, ``/dplb/status``, the engines' pages, the Prometheus targets) are open
while the router listens on loopback and need the key or the admin token beyond it. The app is
driven in-process (starlette's TestClient): nothing listens beyond loopback in a test.
"""
from __future__ import annotations

import os

import pytest
from starlette.testclient import TestClient

from dplb_shm import Segment, WorkerState
from router.app import create_app
from router.config import is_loopback as listens_on_loopback
from router.config import load_config
from tests.helpers import unique_shm_name

OBSERVER = ("/metrics", "/dplb/status", "/dplb/prometheus/targets")


@pytest.fixture
def seg():
    name = unique_shm_name()
    s = Segment.create(name, num_slots=4)
    w = s.writer(0)
    w.claim(worker_id=0, pid=os.getpid(), endpoint="/nonexistent/e0.sock", model="m", max_num_seqs=64)
    w.set_state(WorkerState.READY)
    try:
        yield s
    finally:
        s.close()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def client(seg, tmp_path, host: str) -> TestClient:
    cfg = load_config(None, {"router.shm": seg.name, "router.host": host, "router.api_key": "sk-key",
                             "router.admin_token": "adm", "router.state_dir": str(tmp_path),
                             "health_check.enabled": False,
                             # the fixture's slot beats once: a loaded machine must not make it stale
                             # (1 s by default) before /health is asked (this file is about the key)
                             "health_check.heartbeat_timeout_ms": 600_000})
    return TestClient(create_app(cfg, seg), client=("127.0.0.1", 50000))


def test_loopback_names():
    assert listens_on_loopback("127.0.0.1") and listens_on_loopback("::1") and listens_on_loopback("localhost")
    assert listens_on_loopback("127.0.0.2") and listens_on_loopback("[::1]")
    assert not listens_on_loopback("0.0.0.0") and not listens_on_loopback("::") and not listens_on_loopback("10.1.2.3")
    assert not listens_on_loopback("node-a")


def test_beyond_loopback_the_pages_that_show_the_deployment_need_the_key_or_the_admin_token(seg, tmp_path):
    with client(seg, tmp_path, "0.0.0.0") as c:
        for path in OBSERVER:
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
            assert c.get(path, headers={"Authorization": "Bearer sk-key"}).status_code == 200, path
            assert c.get(path, headers={"Authorization": "Bearer adm"}).status_code == 200, path
            assert c.get(path, headers={"X-DPLB-Admin-Token": "adm"}).status_code == 200, path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        r = c.get("/dplb/workers/0/metrics")
        assert r.status_code == 401
        assert c.get("/dplb/workers/0/metrics", headers={"Authorization": "Bearer sk-key"}).status_code == 502
        assert c.get("/health").status_code == 200                       # liveness stays open
        assert c.get("/v1/models").status_code == 401                    # the API key's own ground
        assert c.get("/v1/models", headers={"Authorization": "Bearer adm"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sk-key"}).status_code == 200
        assert c.get("/dplb/workers", headers={"Authorization": "Bearer sk-key"}).status_code == 401  # admin only
        assert c.get("/dplb/workers", headers={"Authorization": "Bearer adm"}).status_code == 200


def test_on_loopback_the_pages_stay_open_and_the_key_still_guards_the_api(seg, tmp_path):
    with client(seg, tmp_path, "127.0.0.1") as c:
        for path in OBSERVER:
            assert c.get(path).status_code == 200, path
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 401
        assert c.post("/dplb/route", json={"model": "m", "prompt": "x"}).status_code == 401
        assert c.post("/dplb/workers/0/drain").status_code == 401        # admin token, as before
