"""Fixtures for the simulated engine's tests: a real ``python -m sim_engine`` process on a Unix socket."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import httpx
import pytest

from tests.helpers import wait_for_unix_socket


def start_engine(procs, run_dir: str, *args: str, name: str = "engine") -> httpx.Client:
    """Start an engine on ``<run_dir>/<name>.sock`` with extra ``args``; return a client bound to it.

    The process is registered with ``procs`` (killed at teardown); its log is ``<run_dir>/<name>.log``."""
    sock = os.path.join(run_dir, f"{name}.sock")
    procs.start(
        [sys.executable, "-m", "sim_engine", "--uds", sock, *args], log=os.path.join(run_dir, f"{name}.log")
    )
    wait_for_unix_socket(sock, timeout=30)
    return httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://sim", timeout=60)


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


def metrics(client: httpx.Client) -> dict[str, float]:
    """Scrape ``/metrics`` into ``{"name{label=value,...}": value}`` (label ``engine``/``model_name``
    dropped; other labels kept in order), plus bare ``name`` keys for unlabelled-by-extra samples."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(client.get("/metrics").text):
        for s in fam.samples:
            extra = {k: v for k, v in s.labels.items() if k not in ("engine", "model_name")}
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}" if extra else ""
            )
            out[key] = s.value
    return out
