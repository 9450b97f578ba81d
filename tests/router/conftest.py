"""Fixtures for router tests: fake workers in a fresh segment and a router in front of them."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

import pytest

from bench.fakes import start_fake, start_router
from tests.helpers import Procs, unique_shm_name


@pytest.fixture
def loop():
    """A fresh asyncio event loop for a test that drives the router's protocol by hand; closed after."""
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


class Cluster:
    """A segment, N fake agents (slots 0..N-1) and a router; ``base`` is the router URL."""

    def __init__(self, n: int, config: dict | None = None, fake_args: list[list[str]] | None = None,
                 router_args: tuple[str, ...] = (), ready: int | None = None) -> None:
        from dplb_shm import Segment

        self.procs = Procs()
        self.shm = unique_shm_name()
        self.dir = tempfile.mkdtemp(prefix="dplb-rt-", dir="/tmp")
        self.seg = Segment.create(self.shm, num_slots=16)
        # generous probe and heartbeat limits: several test suites share 2 CPU cores
        config = dict(config or {})
        config["health_check"] = {"timeout_ms": 1000, "heartbeat_timeout_ms": 2000, **config.get("health_check", {})}
        try:
            self.fakes = [start_fake(self.procs, self.shm, i, self.dir, *((fake_args or [[]] * n)[i]))
                          for i in range(n)]
            self.base = start_router(self.procs, self.shm, self.dir, config, *router_args,
                                     ready_workers=n if ready is None else ready)
        except BaseException:
            self.close()
            raise

    def router_inflight(self) -> list[int]:
        return [self.seg.read_slot(i).router_inflight for i in range(len(self.fakes))]

    def close(self) -> None:
        self.procs.close()
        try:
            self.seg.close()
        finally:
            if os.path.exists(f"/dev/shm/{self.shm}"):
                os.unlink(f"/dev/shm/{self.shm}")
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster4():
    """4 idle fake workers behind a dplb-policy router (shared by a module: reset fakes you change)."""
    c = Cluster(4, {"router": {"max_body_bytes": 65536}})
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def make_cluster():
    """Factory for a dedicated cluster: ``make_cluster(n, config, fake_args, router_args)``."""
    made: list[Cluster] = []

    def make(n: int, config: dict | None = None, fake_args: list[list[str]] | None = None,
             router_args: tuple[str, ...] = (), ready: int | None = None) -> Cluster:
        c = Cluster(n, config, fake_args, router_args, ready)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()
