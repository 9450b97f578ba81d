"""The field's routers can front the simulated engine: vllm-router's cache_aware policy gets token
ids from every engine's /tokenize or render endpoints (without them it sends all traffic to one
worker), SGLang's router reads /server_info and /model_info. Skipped when the peers are not
installed (``bench/.peers/<name>``, set up by ``bench.peers.ensure_peer``)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, free_port, wait_for_port, wait_until

PEERS = ROOT / "bench" / ".peers"


def peer_python(name: str) -> Path:
    py = PEERS / name / "bin" / "python"
    if not py.exists():
        pytest.skip(f"{name} router not installed in {PEERS / name}")
    return py


def start_engines(procs, n: int) -> list[int]:
    ports = [free_port() for _ in range(n)]
    for p in ports:
        procs.start([sys.executable, "-m", "sim_engine", "--port", str(p), "--time-scale", "50"])
    for p in ports:
        wait_for_port(p, timeout=30)
    return ports


def start_router(procs, name: str, policy: str, ports: list[int]) -> int:
    port, prom = free_port(), free_port()
    level = "warn" if name == "sglang" else "warning"
    procs.start(
        [
            str(peer_python(name)),
            "-m",
            f"{name}_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *[f"http://127.0.0.1:{p}" for p in ports],
            "--policy",
            policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prom),
            "--log-level",
            level,
        ]
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200,
        timeout=60,
        what=f"{name} router healthy",
    )
    return port


def state(port: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{port}/sim/state", timeout=10).json()


@pytest.mark.slow
@pytest.mark.parametrize("name,policy", [("vllm", "cache_aware"), ("sglang", "cache_aware")])
def test_peer_router_fronts_two_engines(procs, name, policy):
    peer_python(name)
    ports = start_engines(procs, 2)
    rport = start_router(procs, name, policy, ports)
    with httpx.Client(base_url=f"http://127.0.0.1:{rport}", timeout=60) as c:
        for i in range(6):
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": "sim-llama-3.1-8b",
                    "max_tokens": 3,
                    "messages": [{"role": "user", "content": f"question {i} " + "word " * 30}],
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        with c.stream(
            "POST",
            "/v1/completions",
            json={"model": "sim-llama-3.1-8b", "prompt": "a b", "max_tokens": 4, "stream": True},
        ) as s:
            events = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 5
    states = [state(p) for p in ports]
    assert sum(st["request_success"]["length"] for st in states) == 7
    calls = [st["peer_calls"] for st in states]
    if name == "vllm":
        # every request was tokenized through the engines (render or /tokenize)
        assert sum(c.get("chat_render", 0) + c.get("tokenize", 0) for c in calls) >= 6
    else:
        assert all(c.get("server_info", 0) >= 1 and c.get("model_info", 0) >= 1 for c in calls)
