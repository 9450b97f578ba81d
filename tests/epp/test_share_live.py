"""Two ``dplb-epp`` pickers behind one Envoy, each with its own segment (as on two nodes), sharing
their load and placements through a real redis-server (``--share-url``, epp/share.py): a session's
turns land on the engine holding its history even without the engines' KV-cache events (each
picker's prefix index gets the other's placements), both pickers count every request in flight on
each engine (the load is not double-booked), and with Redis gone every request is still answered
(each picker on its own view, the outage logged once and counted). Every process (engines, pickers,
Envoy, Redis) is stopped at the end (the ``procs`` fixture); the pickers remove their segments."""
from __future__ import annotations

import json
import os
import re
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from epp.envoy import EnvoySettings, bootstrap, envoy_argv
from launcher.stack import wait_for
from tests.epp.redis_server import RedisServer
from tests.epp.test_events_live import BS, cache_counters, decisions, metric_sum
from tests.helpers import ROOT, free_port, script, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def start_engine(procs, run_dir: str, i: int, time_scale: float = 50.0) -> tuple[str, str, str]:
    """A simulated engine publishing its KV-cache events (vLLM's wire format, ipc://), ``time_scale``
    times faster than its model; returns (address, events endpoint, replay endpoint)."""
    port = free_port()
    pub, replay = f"ipc://{run_dir}/kv-{i}", f"ipc://{run_dir}/kv-replay-{i}"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
           "buffer_steps": 10000}
    procs.start([sys.executable, "-m", "sim_engine", "--host", "127.0.0.1", "--port", str(port), "--time-scale",
                 str(time_scale), "--model", "sim-model", "--kv-events-config", json.dumps(cfg)],
                log=os.path.join(run_dir, f"engine-{i}.log"), cwd=str(ROOT))
    wait_for_port(port, timeout=60)
    return f"127.0.0.1:{port}", pub, replay


def start_picker(procs, run_dir: str, eps: Path, i: int, *extra: str) -> tuple[int, int]:
    port, health, metrics = free_port(), free_port(), free_port()
    procs.start([script("dplb-epp"), "--endpoints-file", str(eps), "--policy", "dplb", *extra,
                 "--port", str(port), "--health-port", str(health), "--metrics-port", str(metrics),
                 "--state-dir", os.path.join(run_dir, f"state-{i}"), "--log-level", "info"],
                log=os.path.join(run_dir, f"epp-{i}.log"), cwd=str(ROOT))
    wait_for_port(port, timeout=60)
    return port, metrics


def envoy_over(procs, run_dir: str, picker_ports: list[int]) -> str:
    """One Envoy whose ext_proc cluster holds every picker (round robin per stream); its base URL."""
    port, admin = free_port(), free_port()
    boot = bootstrap(EnvoySettings(listen_port=port, admin_port=admin, epp_port=picker_ports[0]))
    (epp,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "epp"]  # type: ignore[index,union-attr]
    lb = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for p in picker_ports[1:]:
        lb.append({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}})
    cfg = Path(run_dir) / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(boot))
    envoy = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, "envoy.log"), cwd=str(ROOT))
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE", 90,
             "Envoy ready", children=[envoy])
    return f"http://127.0.0.1:{port}"


def stack(procs, run_dir: str, n_pickers: int, picker_args: list[str], time_scale: float = 50.0):
    """Two simulated engines (publishing their KV events, read only with --kv-events), the pickers,
    one Envoy; returns (engines, pickers, Envoy base URL) once every picker is ready."""
    engines = [start_engine(procs, run_dir, i, time_scale) for i in range(2)]
    eps = Path(run_dir) / "endpoints.yaml"
    eps.write_text("".join(f"- {{address: '{a}', model: sim-model, kv_events: '{p}', kv_events_replay: '{r}'}}\n"
                           for a, p, r in engines))
    pickers = [start_picker(procs, run_dir, eps, i, *picker_args) for i in range(n_pickers)]
    base = envoy_over(procs, run_dir, [p for p, _ in pickers])
    logs = [Path(run_dir) / f"epp-{i}.log" for i in range(n_pickers)]
    wait_for(lambda: all("picker ready" in p.read_text() for p in logs), 60, "every picker ready")
    wait_for(lambda: httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "warm up"}]}).status_code == 200,
        60, "a first answer through Envoy")
    return engines, pickers, base


def sessions(base: str, engines, n: int = 5, turns: int = 4, words: int = 3000) -> dict[str, object]:
    """``n`` interleaved sessions of ``turns`` turns over a ``words``-word system prompt each, one
    request at a time: the turns whose engine did not hold the session's history (``misses``), the
    hit rate (``cached / prompt`` tokens, the engines' own counters) and the ideal one."""
    history = [[{"role": "system", "content": " ".join(f"s{s}w{j}" for j in range(words))}] for s in range(n)]
    prompt = cached = ideal = 0
    last = [0] * n
    misses = []
    with httpx.Client(timeout=60) as c:
        for t in range(turns):
            for s in range(n):
                history[s].append({"role": "user", "content": " ".join(f"s{s}t{t}u{j}" for j in range(40))})
                before = cache_counters(c, engines)
                r = c.post(base + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 4,
                                                                 "messages": history[s]})
                assert r.status_code == 200, r.text
                body = r.json()
                after = cache_counters(c, engines)
                (hit,) = [a[1] - b[1] for a, b in zip(after, before) if a[0] > b[0]]
                tokens = body["usage"]["prompt_tokens"]
                want = (last[s] - 1) // BS * BS if t else 0
                prompt, cached, ideal = prompt + tokens, cached + hit, ideal + want
                if hit < want:
                    misses.append((s, t, hit, want))
                last[s] = tokens
                history[s].append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return {"misses": misses, "hit_rate": cached / prompt, "ideal": ideal / prompt}


def inflight_by_endpoint(metrics_port: int) -> dict[str, float]:
    """A picker's ``dplb_worker_requests_in_flight`` per engine endpoint (its slots differ from the
    other picker's: the info series maps them)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    ep_of = {m.group(1): m.group(2) for m in re.finditer(r'^dplb_worker_info\{[^}]*?worker="([^"]+)"[^}]*?endpoint="([^"]+)"',
                                                           text, re.MULTILINE)}
    out: dict[str, float] = {}
    for m in re.finditer(r'^dplb_worker_requests_in_flight\{[^}]*?worker="([^"]+)"[^}]*\} (\S+)$', text, re.MULTILINE):
        ep = ep_of.get(m.group(1), m.group(1))
        out[ep] = out.get(ep, 0.0) + float(m.group(2))
    return out


def test_sharing_pickers_place_a_sessions_turns_without_the_engines_events(procs, run_dir):
    redis = RedisServer(procs, run_dir).start()
    engines, pickers, base = stack(procs, run_dir, 2, ["--share-url", redis.url])
    got = sessions(base, engines)
    d = [decisions(m) for _, m in pickers]
    assert min(d) >= 5, f"both pickers decide (decisions {d})"
    assert got["misses"] == [], f"turns not placed on the engine holding their history: {got}"
    assert float(got["hit_rate"]) >= float(got["ideal"]) - 0.02, got  # type: ignore[arg-type]


def test_sharing_pickers_count_every_request_in_flight_and_survive_redis_going_away(procs, run_dir):
    redis = RedisServer(procs, run_dir).start()
    _, pickers, base = stack(procs, run_dir, 2, ["--share-url", redis.url], time_scale=1.0)
    n = 6
    statuses: list[int] = []
    # long answers: in flight for seconds (a decode step is ~5 ms at real speed)
    body = {"model": "sim-model", "max_tokens": 800,
            "messages": [{"role": "user", "content": "tell me everything"}]}

    def send() -> None:
        statuses.append(httpx.post(base + "/v1/chat/completions", json=body, timeout=120).status_code)

    threads = [threading.Thread(target=send) for _ in range(n)]
    for t in threads:
        t.start()
    seen: list[tuple[dict[str, float], dict[str, float]]] = []

    def agree() -> bool:
        views = (inflight_by_endpoint(pickers[0][1]), inflight_by_endpoint(pickers[1][1]))
        seen.append(views)
        return views[0] == views[1] and sum(views[0].values()) == n

    try:
        wait_for(agree, 60, "both pickers count all the requests in flight, per engine", interval=0.05)
    finally:
        for t in threads:
            t.join(timeout=120)
    assert statuses == [200] * n, statuses
    wait_for(lambda: all(not any(inflight_by_endpoint(m).values()) for _, m in pickers), 30, "in flight back to 0")
    # Redis gone: every request is still answered, each picker on its own view, logged once
    redis.stop()
    logs = [Path(run_dir) / f"epp-{i}.log" for i in range(2)]
    with httpx.Client(timeout=60) as c:
        codes = [c.post(base + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 2, "messages": [
            {"role": "user", "content": f"q{i}"}]}).status_code for i in range(12)]
    assert codes == [200] * 12, codes
    wait_for(lambda: all("unreachable" in p.read_text() for p in logs), 30, "both pickers log the outage")
    errors = [metric_sum(httpx.get(f"http://127.0.0.1:{m}/metrics", timeout=10).text, "dplb_epp_share_errors_total")
              for _, m in pickers]
    assert min(errors) >= 1, errors
    assert all(p.read_text().count("unreachable") == 1 for p in logs), "logged once per outage"
