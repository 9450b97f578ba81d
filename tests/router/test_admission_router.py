"""The admission queue in a live router (router/admission_gate.py through router/director.py): a
request that waits its budget is answered 429 with Retry-After in the OpenAI error shape; a queued
request whose client leaves is dropped from the queue and leaks no accounting; the queue is seen
in /dplb/status and /metrics.

``headroom`` is set so small that no worker ever has room: every request waits in the router
(``shed_late`` off: only its budget or its client ends the wait)."""
from __future__ import annotations

import glob
import os
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import metric, wait_until

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hello there"}]
# hold_after_s 0: the queue holds from the first request without room (by default a spell without
# room shorter than hold_after_s binds on arrival: a burst below capacity costs nothing)
SATURATED = {"admission": {"enabled": True, "headroom": 1e-9, "queue_budget_s": 30, "shed_late": False,
                           "hold_after_s": 0}}


@pytest.fixture(scope="module")
def saturated(request):
    from tests.router.conftest import Cluster

    c = Cluster(2, SATURATED)
    request.addfinalizer(c.close)
    return c


def _status(c) -> dict:
    return httpx.get(c.base + "/dplb/status", timeout=10).json()


def test_budget_expiry_answers_429_with_retry_after(saturated):
    c = saturated
    t0 = time.monotonic()
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 4},
                   headers={"x-dplb-queue-budget-ms": "600"}, timeout=30)
    waited = time.monotonic() - t0
    assert r.status_code == 429
    assert waited >= 0.6
    assert int(r.headers["retry-after"]) >= 1
    assert r.headers["x-dplb-shed-reason"] == "budget"
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == 429 and "queue budget" in err["message"]
    # llm-d's TTL header (a Go duration) shortens it too
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                   headers={"x-llm-d-inference-ttl": "300ms"}, timeout=30)
    assert r.status_code == 429
    text = httpx.get(c.base + "/metrics", timeout=10).text
    assert (metric(text, "dplb_router_admission_shed_total", reason="budget", **{"class": "0"}) or 0) >= 2
    assert c.router_inflight() == [0, 0]        # nothing was dispatched
    # the access log says how long each shed request queued (the first one: its 600 ms budget)
    logs = glob.glob(os.path.join(c.dir, "router-*.log"))

    def shed_waits() -> list[float]:
        lines = [ln for f in logs for ln in Path(f).read_text().splitlines()
                 if "status=429" in ln and "queue_ms=" in ln]
        return [float(ln.split("queue_ms=")[1].split()[0]) for ln in lines]

    wait_until(lambda: len(shed_waits()) >= 2, 10)
    assert max(shed_waits()) >= 600.0


def test_a_queued_request_whose_client_leaves_is_dropped(saturated):
    c = saturated
    with pytest.raises(httpx.TimeoutException):
        httpx.post(c.base + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MSG, "user": "team-a"},
                   headers={"x-smg-priority": "3"}, timeout=1.5)
    # while it waited it was seen; once its client left, the queue is empty again
    wait_until(lambda: _status(c)["admission"]["depth"] == 0, 10, what="the queue to drop the request")
    assert c.router_inflight() == [0, 0]


def test_the_queue_is_shown_while_requests_wait(saturated):
    import threading

    c = saturated
    out: list[int] = []

    def client() -> None:
        r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "user": "team-b"},
                       headers={"x-dplb-priority": "2", "x-dplb-queue-budget-ms": "4000"}, timeout=30)
        out.append(r.status_code)

    th = threading.Thread(target=client)
    th.start()
    try:
        wait_until(lambda: _status(c)["admission"]["depth"] == 1, 10, what="the request in the queue")
        adm = _status(c)["admission"]
        assert adm["classes"]["2"]["tenants"] == {"team-b": 1}
        text = httpx.get(c.base + "/metrics", timeout=10).text
        assert metric(text, "dplb_router_admission_queue_depth") == 1
    finally:
        th.join(30)
    assert out == [429]
