"""Routers on different nodes share their in-flight load per engine and their placements through
Redis (the config file's ``share`` section, :mod:`router.share`, the module the pickers use too):
two router processes, each with its own segment (as on two nodes), mirror the same two remote
workers and share through a real redis-server on a random loopback port. A session placed by one
router is routed to the same worker by the other; requests in flight through one are counted on
the other's lines, per engine; Redis gone, every request is still answered. The ``share`` section
is validated by the config model. Everything is stopped and removed at the end."""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator

import httpx
import orjson
import pytest

from bench.fakes import start_fake, start_router
from router.config import load_config
from router.errors import ConfigError
from tests.epp.redis_server import RedisServer
from tests.helpers import Procs, free_port, unique_shm_name, wait_until

pytestmark = pytest.mark.timeout(300)

DOC = " ".join(f"w{i}" for i in range(200))


def turn(session: int, k: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"session {session} " + DOC}, {"role": "user", "content": f"question {k}"}]


class Node:
    """A router with its own segment (a node of its own), mirroring ``remotes``, sharing via ``url``."""

    def __init__(self, procs: Procs, run_dir: str, remotes: list[str], url: str) -> None:
        from dplb_shm import Segment

        self.shm = unique_shm_name()
        self.seg = Segment.create(self.shm, num_slots=16)
        cfg = {"backend_servers": [{"endpoint": r} for r in remotes],
               "routing_policy": {"policy": "cache_aware"},
               "share": {"url": url},
               "health_check": {"timeout_ms": 1000, "heartbeat_timeout_ms": 2000}}
        self.base = start_router(procs, self.shm, run_dir, cfg, ready_workers=len(remotes))

    def rows(self) -> dict[str, dict[str, object]]:
        return {str(w["endpoint"]): w for w in httpx.get(self.base + "/dplb/status", timeout=10).json()["workers"]}

    def worker(self, session: int, k: int) -> str:
        """Send turn ``k`` of ``session``; the endpoint of the worker that served it."""
        r = httpx.post(self.base + "/v1/chat/completions", json={"model": "fake-model", "messages": turn(session, k)},
                       timeout=30)
        assert r.status_code == 200, r.text
        wid = int(r.headers["x-dplb-worker-id"])
        return next(ep for ep, w in self.rows().items() if w["id"] == wid)

    def admin(self, ep: str, what: str) -> None:
        wid = self.rows()[ep]["id"]
        assert httpx.post(self.base + f"/dplb/workers/{wid}/{what}", timeout=10).status_code == 200
        if what == "undrain":
            wait_until(lambda: self.rows()[ep]["eligible"], 30, what=f"{ep} back in rotation")

    def close(self) -> None:
        self.seg.close()
        if os.path.exists(f"/dev/shm/{self.shm}"):
            os.unlink(f"/dev/shm/{self.shm}")


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node, list[str], RedisServer]]:
    procs = Procs()
    d = tempfile.mkdtemp(prefix="dplb-rt-share-", dir="/tmp")
    made: list[Node] = []
    try:
        redis = RedisServer(procs, d).start()
        remotes = []
        for i in range(2):
            port = free_port()
            start_fake(procs, None, 10 + i, d, port=port)
            remotes.append(f"127.0.0.1:{port}")
        made.append(Node(procs, d, remotes, redis.url))
        made.append(Node(procs, d, remotes, redis.url))
        yield made[0], made[1], remotes, redis
    finally:
        procs.close()
        for n in made:
            n.close()
        shutil.rmtree(d, ignore_errors=True)


def test_a_session_placed_by_one_router_goes_to_the_same_worker_through_the_other(nodes):
    a, b, (x, y), _ = nodes
    # router a places sessions 0, 1 on x and 2, 3 on y (the other worker drained on a only)
    a.admin(y, "drain")
    placed = {s: a.worker(s, 0) for s in (0, 1)}
    a.admin(y, "undrain")
    a.admin(x, "drain")
    placed.update({s: a.worker(s, 0) for s in (2, 3)})
    a.admin(x, "undrain")
    assert placed == {0: x, 1: x, 2: y, 3: y}
    # router b never saw them: its own index is empty; the shared placements send each next turn
    # to the worker holding its history (without sharing, b's choice would not depend on the session)
    assert {s: b.worker(s, 1) for s in (0, 1, 2, 3)} == placed


def test_requests_in_flight_through_one_router_are_counted_on_the_other(nodes):
    a, b, _, redis = nodes
    host, port = a.base.removeprefix("http://").split(":")
    held = []
    try:
        for s in range(3):   # 3 requests held by their worker (a slow answer), kept open on sockets
            body = orjson.dumps({"model": "fake-model", "messages": turn(10 + s, 0)})
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                      b"x-fake-mode: slow\r\nx-fake-delay: 120\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            held.append(c)

        def inflight(n: Node) -> dict[str, int]:
            return {ep: int(w["router_inflight"] or 0) for ep, w in n.rows().items()}

        wait_until(lambda: sum(inflight(a).values()) == 3, 60, what="a counts its 3 requests")
        wait_until(lambda: inflight(b) == inflight(a), 60, what="b counts a's requests, per engine")
    finally:
        for c in held:
            c.close()
    wait_until(lambda: sum(inflight(b).values()) == 0, 60, what="b sees them end")
    redis.stop()   # Redis gone: each router routes on its own view, no request fails
    for n in (a, b):
        for k in range(3):
            n.worker(20, k)


@pytest.mark.parametrize("share, error", [
    ({"url": "http://redis:6379"}, "not a Redis URL"),
    ({"url": "redis://r:6379/0", "interval_ms": 3000, "ttl_s": 2}, "must be at least 3 x interval_ms"),
    ({"url": "redis://r:6379/0", "interval_ms": 1000, "ttl_s": 2}, "must be at least 3 x interval_ms"),
    ({"url": "redis://r:6379/0", "lookup_ms": -1}, "greater than or equal"),
    ({"url": "redis://r:6379/0", "max_stream_mb": 0}, "greater than"),
    ({"url": "redis://r:6379/0", "push_gap_ms": -1}, "greater than or equal"),
    ({"urls": "redis://r:6379/0"}, "urls"),
])
def test_the_share_section_is_validated(tmp_path, share, error):
    import yaml

    p = tmp_path / "dplb.yaml"
    p.write_text(yaml.safe_dump({"share": share}))
    with pytest.raises(ConfigError, match=error):
        load_config(p)


def test_sharing_goes_with_one_router_process_per_node():
    with pytest.raises(ConfigError, match="router.workers 1"):
        load_config(None, {"share.url": "redis://r:6379/0", "router.workers": 2})
    cfg = load_config(None, {"share.url": "unix:///run/redis.sock"})
    assert cfg.share.url == "unix:///run/redis.sock" and cfg.share.interval_ms == 100 and cfg.share.push_gap_ms == 1
    assert load_config(None).share.url is None   # off by default
