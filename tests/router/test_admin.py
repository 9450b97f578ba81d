"""Admin API (drain, remove, add a remote worker), admin token, client API key, several router processes."""
from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from bench.fakes import start_fake
from tests.helpers import free_port, wait_until

MODEL = "fake-model"
MSG = [{"role": "user", "content": "hi"}]
TOKEN = "adm-secret"


def served_by(base: str, n: int, **kw) -> Counter:
    c = Counter()
    for _ in range(n):
        r = httpx.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG}, **kw)
        assert r.status_code == 200, r.text
        c[r.headers["x-dplb-worker-id"]] += 1
    return c


def test_admin_requires_token(make_cluster):
    c = make_cluster(2, {"router": {"admin_token": TOKEN}})
    assert httpx.post(c.base + "/dplb/workers/0/drain").status_code == 401
    r = httpx.post(c.base + "/dplb/workers/0/drain", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(c.base + "/dplb/workers", headers={"X-DPLB-Admin-Token": TOKEN}).status_code == 200


def test_drain_and_undrain(make_cluster):
    c = make_cluster(2, {"router": {"admin_token": TOKEN}})
    h = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(c.base + "/dplb/workers/0/drain", headers=h)
    assert r.status_code == 200 and r.json()["draining"] is True
    rows = {w["id"]: w for w in httpx.get(c.base + "/dplb/status").json()["workers"]}
    # the slot is still READY (the dump agrees); the router's own verdict says why it is out
    assert rows[0]["state"] == "ready" and rows[0]["routing"] == "draining" and rows[0]["draining"]
    assert not rows[0]["eligible"]
    assert set(served_by(c.base, 10)) == {"1"}
    assert httpx.post(c.base + "/dplb/workers/1/drain", headers=h).status_code == 200
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 503 and r.headers["retry-after"]       # every worker drained: the 503 says so
    assert "(worker 0: draining, worker 1: draining)" in r.json()["error"]["message"], r.text
    assert httpx.post(c.base + "/dplb/workers/1/undrain", headers=h).status_code == 200
    assert httpx.post(c.base + "/dplb/workers/0/undrain", headers=h).status_code == 200
    assert httpx.post(c.base + "/dplb/workers/9/drain", headers=h).status_code == 404
    wait_until(lambda: set(served_by(c.base, 12)) == {"0", "1"}, 40, what="worker 0 back in rotation")


def test_remove_local_worker_and_restore_it(make_cluster):
    c = make_cluster(2)
    r = httpx.delete(c.base + "/dplb/workers/1")
    assert r.status_code == 200
    assert [w["id"] for w in httpx.get(c.base + "/dplb/status").json()["workers"]] == [0]
    assert set(served_by(c.base, 8)) == {"0"}
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": c.fakes[1].endpoint})
    assert r.status_code == 200 and r.json()["worker_id"] == 1
    wait_until(lambda: len(httpx.get(c.base + "/dplb/status").json()["workers"]) == 2, 10, what="worker 1 restored")


def test_add_remote_worker_gets_a_mirror_slot(make_cluster):
    c = make_cluster(1)
    port = free_port()
    remote = start_fake(c.procs, None, 5, c.dir, port=port)     # a "remote" agent on TCP, no slot of its own
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": f"127.0.0.1:{port}", "weight": 2.0})
    assert r.status_code == 201, r.text
    slot = r.json()["worker_id"]
    assert slot == 15                                           # mirrors fill the segment from the top
    s = c.seg.read_slot(slot)
    assert s.endpoint == f"127.0.0.1:{port}" and s.weight == 2.0 and s.model == MODEL
    wait_until(lambda: any(w["id"] == slot and w["eligible"] for w in httpx.get(c.base + "/dplb/status").json()["workers"]),
               10, what="mirror eligible")
    wait_until(lambda: str(slot) in served_by(c.base, 10), 20, what="requests reach the remote worker over TCP")
    assert remote.client().stats()["requests"] > 0
    r = httpx.delete(c.base + f"/dplb/workers/{slot}")
    assert r.status_code == 200
    assert int(c.seg.read_slot(slot).state) == 0               # slot released


def test_an_unreachable_remote_worker_is_dead_each_time_it_is_added(make_cluster):
    """Added, found unreachable (DEAD), removed, added again: DEAD again, not STARTING for good."""
    c = make_cluster(1)
    ep = f"127.0.0.1:{free_port()}"     # nothing listens there

    def state(slot: int) -> str:
        return next((w["state"] for w in httpx.get(c.base + "/dplb/status").json()["workers"] if w["id"] == slot), "-")

    for _ in range(2):
        r = httpx.post(c.base + "/dplb/workers", json={"endpoint": ep})
        assert r.status_code == 201, r.text
        slot = r.json()["worker_id"]
        wait_until(lambda slot=slot: state(slot) == "dead", 20, what=f"the unreachable mirror {slot} marked dead")
        assert httpx.delete(c.base + f"/dplb/workers/{slot}").status_code == 200
        wait_until(lambda slot=slot: int(c.seg.read_slot(slot).state) == 0, 10, what="the mirror slot released")


def test_bad_admin_bodies(make_cluster):
    c = make_cluster(1)
    for body, code in ((b"{", 400), (b"[]", 400), (b'{"endpoint": "nohost"}', 400), (b'{"weight": 1}', 400)):
        r = httpx.post(c.base + "/dplb/workers", content=body)
        assert r.status_code == code and r.json()["error"]["code"] == code
    r = httpx.post(c.base + "/dplb/workers/abc/drain")   # the error names the parameter as the API documents it
    assert r.status_code == 400 and r.json()["error"]["param"] == "id"
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": "127.0.0.1:1", "weight": "heavy"})
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == "weight" and "pydantic" not in e["message"] and "\n" not in e["message"]


def test_a_host_name_that_does_not_resolve_is_a_400_saying_so_and_takes_no_slot(make_cluster):
    """Issue 32: ``{"endpoint": "node-b:9100"}`` answered 201 and the slot turned DEAD."""
    c = make_cluster(1)
    for ep in ("node-b.invalid:9100", "http://no-such-node.invalid:9100"):   # RFC 6761: never resolves
        r = httpx.post(c.base + "/dplb/workers", json={"endpoint": ep}, timeout=30)
        e = r.json()["error"]
        assert r.status_code == 400 and e["param"] == "endpoint", r.text
        assert "does not resolve" in e["message"] or "did not resolve" in e["message"]
        assert ".invalid" in e["message"]
    assert [s.worker_id for s in c.seg.snapshot() if int(s.state) != 0] == [0]   # no mirror slot taken
    assert [w["id"] for w in httpx.get(c.base + "/dplb/workers").json()["workers"]] == [0]


def test_api_key(make_cluster):
    c = make_cluster(1, {"router": {"api_key": "sk-good"}})
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(c.base + "/v1/models").status_code == 401
    r = httpx.post(c.base + "/v1/chat/completions", json={"model": MODEL, "messages": MSG},
                   headers={"Authorization": "Bearer sk-good"})
    assert r.status_code == 200
    assert r.json()["fake"]["headers"]["authorization"] == "Bearer sk-good"   # passed through untouched


def test_two_router_processes_share_in_flight_counts(make_cluster):
    c = make_cluster(4, None, None, ("--workers", "2"))
    for f in c.fakes:
        f.client().set_mode("slow", delay=0.3)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=c.base, timeout=60, limits=httpx.Limits(max_connections=40)) as ac:
            rs = await asyncio.gather(*(ac.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
                                        for _ in range(40)))
        assert all(r.status_code == 200 for r in rs)
        return [r.headers["x-dplb-worker-id"] for r in rs]

    share = Counter(asyncio.run(burst()))
    assert set(share) == {"0", "1", "2", "3"} and max(share.values()) <= 16, share
    pids: set[int] = set()

    def both_answer() -> bool:   # each new connection lands on either process, not always in turn
        pids.add(httpx.get(c.base + "/dplb/status").json()["pid"])
        return len(pids) == 2

    wait_until(both_answer, 30, what="both router processes answering")
    for _ in range(3):                                          # whichever process answers /metrics,
        text = httpx.get(c.base + "/metrics").text              # it counts the requests of both
        total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("dplb_router_requests_total{") and 'status="200"' in line)
        assert total == 40, text
    wait_until(lambda: c.router_inflight() == [0, 0, 0, 0], 10, what="shared in-flight back to 0")


def test_remote_backend_from_config_is_mirrored_with_its_weight(make_cluster, procs, run_dir):
    port = free_port()
    remote = start_fake(procs, None, 7, run_dir, port=port)
    c = make_cluster(1, {"backend_servers": [{"endpoint": f"127.0.0.1:{port}", "weight": 3.0}]}, ready=2)
    rows = {w["id"]: w for w in httpx.get(c.base + "/dplb/status").json()["workers"]}
    assert rows[15]["endpoint"] == f"127.0.0.1:{port}" and rows[15]["weight"] == 3.0 and rows[15]["eligible"]
    wait_until(lambda: "15" in served_by(c.base, 10), 20, what="traffic to the configured remote worker")
    assert remote.client().stats()["requests"] > 0
    # removed at run time (its slot released, not hidden), then added back
    assert httpx.delete(c.base + "/dplb/workers/15").status_code == 200
    assert int(c.seg.read_slot(15).state) == 0
    assert httpx.delete(c.base + "/dplb/workers/15").status_code == 404
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": f"127.0.0.1:{port}"})
    assert r.status_code == 201 and r.json()["worker_id"] == 15, r.text


def test_admin_is_loopback_only_by_default():
    from types import SimpleNamespace

    import pytest

    from router.admin import check_admin
    from router.config import Config
    from router.errors import Forbidden, Unauthorized

    def req(host: str, headers: dict | None = None):
        return SimpleNamespace(client=SimpleNamespace(host=host), headers=headers or {})

    cfg = Config.model_validate({"router": {"admin_token": TOKEN}})
    with pytest.raises(Forbidden):
        check_admin(req("10.1.2.3", {"authorization": f"Bearer {TOKEN}"}), cfg)
    with pytest.raises(Unauthorized):
        check_admin(req("127.0.0.1"), cfg)
    check_admin(req("::1", {"x-dplb-admin-token": TOKEN}), cfg)
    open_cfg = Config.model_validate({"router": {"admin_token": TOKEN, "admin_loopback_only": False}})
    check_admin(req("10.1.2.3", {"authorization": f"Bearer {TOKEN}"}), open_cfg)


def test_invalid_config_exits_2_naming_the_field(tmp_path):
    import subprocess
    import sys

    from tests.helpers import ROOT

    p = tmp_path / "bad.yaml"
    p.write_text("circuit_breaker: {minimum_requests: 0}\n")
    r = subprocess.run([sys.executable, "-m", "router", "--config", str(p)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 2 and "circuit_breaker.minimum_requests" in r.stderr


def test_admin_answers_for_a_remote_worker_added_twice_and_removed_twice(make_cluster):
    """Issue 27 item 7: a 201 names a slot; adding it again answers 200 with the same id (nothing
    changed); a DELETE empties the slot; a second DELETE (or one of a removed local worker) is 404
    in the OpenAI error shape; a local worker's own address is not mirrored over it (409)."""
    c = make_cluster(1)
    port = free_port()
    start_fake(c.procs, None, 5, c.dir, port=port)
    ep = f"127.0.0.1:{port}"
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": ep})
    assert r.status_code == 201 and r.json()["worker_id"] == 15 and r.json()["created"] is True, r.text
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": ep, "weight": 5.0})
    assert r.status_code == 200 and r.json()["worker_id"] == 15 and r.json()["created"] is False, r.text
    assert c.seg.read_slot(15).weight == 1.0                    # nothing changed
    assert httpx.delete(c.base + "/dplb/workers/15").status_code == 200
    assert int(c.seg.read_slot(15).state) == 0                  # EMPTY when the answer left
    r = httpx.delete(c.base + "/dplb/workers/15")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
    assert httpx.delete(c.base + "/dplb/workers/0").status_code == 200
    r = httpx.delete(c.base + "/dplb/workers/0")
    assert r.status_code == 404 and "already removed" in r.json()["error"]["message"], r.text
    assert httpx.post(c.base + "/dplb/workers", json={"endpoint": c.fakes[0].endpoint}).status_code == 200
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": c.fakes[0].endpoint})
    assert r.status_code == 409 and r.json()["error"]["code"] == 409, r.text
    assert httpx.delete(c.base + "/dplb/workers/99").status_code == 404


def test_adding_a_remote_worker_to_a_full_segment_is_503_and_changes_nothing(make_cluster):
    c = make_cluster(1)
    for i in range(1, c.seg.num_slots):             # every other slot taken (by someone else)
        c.seg.writer(i).claim(worker_id=i, pid=1, endpoint=f"/nonexistent/e{i}.sock")
    port = free_port()
    r = httpx.post(c.base + "/dplb/workers", json={"endpoint": f"127.0.0.1:{port}"})
    assert r.status_code == 503 and r.headers["retry-after"] and "no free slot" in r.json()["error"]["message"], r.text
    c.seg.writer(15).release()
    import time
    time.sleep(0.5)                                  # a few health ticks: it is not mirrored behind our back
    assert int(c.seg.read_slot(15).state) == 0
