"""Fixtures for the simulated engine's tests: a real ``python -m sim_engine`` process on a Unix socket."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from tests.sim_engine.simhelpers import start_engine


@pytest.fixture
def engine_factory(procs, run_dir) -> Callable[..., httpx.Client]:
    """``engine_factory(*flags)`` starts an engine process and returns an ``httpx.Client`` for it."""
    clients: list[httpx.Client] = []

    def make(*args: str, name: str = "engine") -> httpx.Client:
        c = start_engine(procs, run_dir, *args, name=name)
        clients.append(c)
        return c

    try:
        yield make
    finally:
        for c in clients:
            c.close()


@pytest.fixture(scope="module")
def shared_engine():
    """One engine process (``--time-scale 20``) shared by a module's tests; killed at module teardown."""
    import shutil
    import tempfile

    from tests.helpers import Procs

    d = tempfile.mkdtemp(prefix="dplb-t-", dir="/tmp")
    with Procs() as procs:
        c = start_engine(procs, d, "--time-scale", "20", "--seed", "1")
        try:
            yield c
        finally:
            c.close()
    shutil.rmtree(d, ignore_errors=True)
