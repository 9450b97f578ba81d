"""Helpers for the simulated engine's tests: start an engine process, scrape its /metrics."""

from __future__ import annotations

import os
import sys

import httpx

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
