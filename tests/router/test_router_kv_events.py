"""The router (not only the picker) routes on the engines' KV-cache events (``kv_events.enabled``,
:mod:`router.events_index`): a remote worker's ``backend_servers`` entry names its engine's
publisher, and a prompt whose blocks that engine's events report stored goes there, even where the
router's own index placed it elsewhere; off (the default), the router keeps its own index. A real
router process, two fake workers (one local, one mirrored over TCP) and the simulated engine's ZMQ
publisher on ipc:// sockets; everything is stopped and removed at the end."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import httpx
import pytest

from bench.fakes import start_fake, start_router
from sim_engine.kv_events import BlockStored, KVEventsConfig, ZmqEventPublisher
from sim_engine.tokenizer import render_chat, token_ids
from tests.helpers import Procs, free_port, unique_shm_name, wait_until

pytestmark = pytest.mark.timeout(300)

BS, VOCAB = 4, 1000
DOC = " ".join(f"w{i}" for i in range(300))   # the shared history: 300 words


def turn(k: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": f"question {k}"}]


class Stack:
    """A segment, a local fake worker (slot 0), a remote one mirrored from ``backend_servers``, its
    engine's KV-events publisher, and a router with ``kv_events.enabled`` = ``enabled``."""

    def __init__(self, enabled: bool) -> None:
        from dplb_shm import Segment

        self.procs = Procs()
        self.shm = unique_shm_name()
        self.dir = tempfile.mkdtemp(prefix="dplb-rt-kv-", dir="/tmp")
        self.seg = Segment.create(self.shm, num_slots=16)
        self.pub: ZmqEventPublisher | None = None
        self.enabled = enabled
        try:
            start_fake(self.procs, self.shm, 0, self.dir)
            port = free_port()
            self.remote = f"127.0.0.1:{port}"
            start_fake(self.procs, None, 5, self.dir, port=port)
            self.pub = ZmqEventPublisher(KVEventsConfig(True, "zmq", f"ipc://{self.dir}/pub",
                                                        f"ipc://{self.dir}/replay", buffer_steps=100))
            cfg = {"backend_servers": [{"endpoint": self.remote, "kv_events": self.pub.last_endpoint,
                                        "kv_events_replay": self.pub.replay_last_endpoint}],
                   "kv_events": {"enabled": enabled, "block_size": BS, "vocab_size": VOCAB},
                   "routing_policy": {"policy": "cache_aware"},
                   "health_check": {"timeout_ms": 1000, "heartbeat_timeout_ms": 2000}}
            self.base = start_router(self.procs, self.shm, self.dir, cfg, ready_workers=2)
            self.mirror = next(w["id"] for w in httpx.get(self.base + "/dplb/status").json()["workers"]
                               if w["id"] != 0)
        except BaseException:
            self.close()
            raise

    def send(self, k: int) -> int:
        """Turn ``k`` of the session; the worker that served it."""
        r = httpx.post(self.base + "/v1/chat/completions", json={"model": "fake-model", "messages": turn(k)},
                       timeout=30)
        assert r.status_code == 200, r.text
        return int(r.headers["x-dplb-worker-id"])

    def eligible(self, wid: int) -> bool:
        return any(w["id"] == wid and w["eligible"] for w in httpx.get(self.base + "/dplb/status").json()["workers"])

    def close(self) -> None:
        self.procs.close()
        if self.pub is not None:
            self.pub.close()
        try:
            self.seg.close()
        finally:
            if os.path.exists(f"/dev/shm/{self.shm}"):
                os.unlink(f"/dev/shm/{self.shm}")
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(params=[True, False], ids=["events", "own-index"])
def stack(request) -> Iterator[Stack]:
    s = Stack(request.param)
    try:
        yield s
    finally:
        s.close()


def test_the_router_follows_the_engines_events_only_when_enabled(stack):
    # the router's own index places the session's history on the local worker: the mirror drained
    assert httpx.post(stack.base + f"/dplb/workers/{stack.mirror}/drain").status_code == 200
    assert stack.send(0) == 0
    assert httpx.post(stack.base + f"/dplb/workers/{stack.mirror}/undrain").status_code == 200
    wait_until(lambda: stack.eligible(stack.mirror), 30, what="the mirror back in rotation")
    # the mirror's engine reports the history's blocks stored (its cache, whoever placed them)
    ids = token_ids(render_chat(turn(0)), VOCAB)
    n = (len(ids) - 1) // BS
    assert stack.pub is not None
    stack.pub.publish([BlockStored(list(range(100, 100 + n)), None, ids[:n * BS], BS, None, "GPU", None)])
    if stack.enabled:
        # once the router's subscriber applied the batch, every later turn goes to the mirror
        wait_until(lambda: stack.send(1) == stack.mirror, 30, what="a turn routed to the engine holding it")
        assert [stack.send(k) for k in range(2, 8)] == [stack.mirror] * 6
    else:
        # the events are not read: the router's own index keeps the session on the local worker
        assert [stack.send(k) for k in range(1, 8)] == [0] * 7
