"""A remote node's agent mirrored over TCP (issue 14, "Shows").

Two nodes on one machine, each with its own segment: node B runs a real worker agent whose control
API listens on TCP (``--control-port``) and whose sim engine listens on TCP (``--engine-host``);
node A runs a router with no local worker. ``POST /dplb/workers {"endpoint": "host:port"}`` of B's
agent makes A's router mirror it into a slot of A's segment (before issue 14 this answered 201 and
the worker then died silently: nothing served ``/dplb/state`` over TCP). Requests then go from A's
router straight to B's engine, one hop, and its state (running requests) reaches A's slot.
"""
from __future__ import annotations

import httpx
import pytest

from launcher.stack import Stack, free_port, wait_for

MODEL = "sim-llama-3.1-8b"

pytestmark = pytest.mark.timeout(240)


def test_remote_agent_is_mirrored_over_tcp_and_served_in_one_hop():
    with Stack(num_slots=8, shm_prefix="dplb-test-b") as node_b, Stack(num_slots=8, shm_prefix="dplb-test-a") as node_a:
        ctl = free_port()
        node_b.start_agent(0, engine="sim", extra=["--control-port", str(ctl), "--engine-host", "127.0.0.1"],
                           engine_args=["--time-scale", "1", "--slowdown", "30"], state_interval_ms=100)
        engine_ep = node_b.seg.read_slot(0).endpoint
        assert engine_ep.startswith("127.0.0.1:")                  # B's engine on TCP
        base = node_a.router({"health_check": {"interval_ms": 100}}, ready=0)
        r = httpx.post(base + "/dplb/workers", json={"endpoint": f"127.0.0.1:{ctl}"}, timeout=10)
        assert r.status_code == 201, r.text
        wid = r.json()["worker_id"]
        assert wid == 7                                            # mirror slots: from the top down

        def row():
            rows = httpx.get(base + "/dplb/status", timeout=5).json()["workers"]
            return next((w for w in rows if w["id"] == wid and w["eligible"]), None)

        w = wait_for(row, 30, "the mirrored remote worker eligible")
        assert w["remote"] is True and w["model"] == MODEL
        assert w["endpoint"] == engine_ep and w["control"] == f"127.0.0.1:{ctl}"   # data: B's engine; control: B's agent
        assert node_a.seg.read_slot(wid).endpoint == engine_ep

        for i in range(6):
            r = httpx.post(base + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}],
                                 "max_tokens": 4, "stream": i % 2 == 1})
            assert r.status_code == 200, r.text
            assert r.headers["x-dplb-worker-id"] == str(wid)
        # A's router kept the request accounting in A's segment; B's router line never saw these
        assert node_a.seg.read_slot(wid).dispatched >= 6
        assert node_b.seg.read_slot(0).dispatched == 0
        # the mirrored worker's `done` counts what it served (issue 32: it showed 0)
        # (the router counts a request done after its last byte left, so the client can read it first)
        wait_for(lambda: node_a.seg.read_slot(wid).completed >= 6, 10, "the mirrored worker's done count at 6")
        assert node_a.seg.read_slot(wid).failed == 0
        with httpx.Client(base_url=f"http://{engine_ep}", timeout=5) as eng:   # B's engine served them
            st = eng.get("/sim/state").json()
        assert st["request_success"]["length"] >= 6

        # B's engine state (running requests) reaches A's mirror slot through B's agent
        with httpx.Client(base_url=f"http://{engine_ep}", timeout=60) as eng, \
                eng.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "x " * 8, "max_tokens": 4000,
                                                             "stream": True, "ignore_eos": True}) as s:
            next(s.iter_raw())
            wait_for(lambda: node_a.seg.read_slot(wid).num_running >= 1, 10, "remote running count mirrored")
            # sent around A's routers: published with A's in-flight count (0), so A prices it as outside load
            assert node_a.seg.read_slot(wid).inflight == 0
