"""Two ``dplb-epp`` pickers behind one Envoy, each with its own segment (as on two nodes, nothing
shared between them), both subscribed to the engines' KV-cache events (``--kv-events``,
epp/events.py): Envoy spreads the ext_proc streams over both, so a session's turns reach both
pickers, and every turn after the first still lands on the engine holding the session's history
(its prompt's cached tokens cover the previous turn's whole prompt), so the hit rate is the
one an ideal single picker gets. Two simulated engines publish vLLM's wire format on loopback TCP;
every process is stopped at the end (the ``procs`` fixture) and the pickers' private segments are
removed at their exit."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from epp.envoy import EnvoySettings, bootstrap, envoy_argv
from launcher.stack import wait_for
from tests.helpers import ROOT, free_port, script, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BS = 16
SESSIONS, TURNS = 5, 4   # an odd number of sessions: a session's turns alternate pickers


def start_engine(procs, run_dir: str, i: int) -> tuple[str, str, str]:
    port = free_port()
    # ipc:// (vLLM binds it, as a "tcp://*:port" endpoint; a tcp one without "*" would connect)
    pub, replay = f"ipc://{run_dir}/kv-{i}", f"ipc://{run_dir}/kv-replay-{i}"
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
           "buffer_steps": 10000}
    procs.start([sys.executable, "-m", "sim_engine", "--host", "127.0.0.1", "--port", str(port), "--time-scale",
                 "50", "--model", "sim-model", "--kv-events-config", json.dumps(cfg)],
                log=os.path.join(run_dir, f"engine-{i}.log"), cwd=str(ROOT))
    wait_for_port(port, timeout=60)
    return f"127.0.0.1:{port}", pub, replay


def start_picker(procs, run_dir: str, eps: Path, i: int) -> tuple[int, int]:
    port, health, metrics = free_port(), free_port(), free_port()
    procs.start([script("dplb-epp"), "--endpoints-file", str(eps), "--policy", "dplb", "--kv-events",
                 "--port", str(port), "--health-port", str(health), "--metrics-port", str(metrics),
                 "--state-dir", os.path.join(run_dir, f"state-{i}"), "--log-level", "info"],
                log=os.path.join(run_dir, f"epp-{i}.log"), cwd=str(ROOT))
    wait_for_port(port, timeout=60)
    return port, metrics


def metric_sum(text: str, pattern: str) -> float:
    """The sum of the samples whose line matches ``pattern`` (name and labels) in a Prometheus page."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{pattern} (\S+)$", text, re.MULTILINE))


def cache_counters(c: httpx.Client, engines: list[tuple[str, str, str]]) -> list[tuple[float, float]]:
    """Per engine (prefix-cache queried tokens, hit tokens) from its ``/metrics`` (vLLM's counters)."""
    out = []
    for addr, _, _ in engines:
        text = c.get(f"http://{addr}/metrics").text
        out.append((metric_sum(text, r"vllm:prefix_cache_queries_total\S*"),
                    metric_sum(text, r"vllm:prefix_cache_hits_total\S*")))
    return out


def decisions(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return metric_sum(text, r"dplb_router_routing_decisions_total\{[^}]*\}")


def test_two_pickers_place_a_sessions_turns_on_the_engine_holding_its_history(procs, run_dir):
    engines = [start_engine(procs, run_dir, i) for i in range(2)]
    eps = Path(run_dir) / "endpoints.yaml"
    eps.write_text("".join(f"- {{address: '{a}', model: sim-model, kv_events: '{p}', kv_events_replay: '{r}'}}\n"
                           for a, p, r in engines))
    pickers = [start_picker(procs, run_dir, eps, i) for i in range(2)]
    # one Envoy, its ext_proc cluster holding both pickers (round robin per stream)
    port, admin = free_port(), free_port()
    boot = bootstrap(EnvoySettings(listen_port=port, admin_port=admin, epp_port=pickers[0][0]))
    (epp,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "epp"]  # type: ignore[index,union-attr]
    lb = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    lb.append({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": pickers[1][0]}}}})
    cfg = Path(run_dir) / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(boot))
    envoy = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, "envoy.log"), cwd=str(ROOT))
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE", 90,
             "Envoy ready", children=[envoy])
    base = f"http://127.0.0.1:{port}"
    # both pickers ready (endpoints scraped, events caught up) before the load
    logs = [Path(run_dir) / f"epp-{i}.log" for i in range(2)]
    wait_for(lambda: all("picker ready" in p.read_text() for p in logs), 60, "both pickers ready")
    wait_for(lambda: httpx.post(base + "/v1/chat/completions", timeout=30, json={
        "model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "warm up"}]}).status_code == 200,
        60, "a first answer through Envoy")
    history: list[list[dict[str, str]]] = [
        [{"role": "system", "content": " ".join(f"s{s}w{j}" for j in range(3000))}] for s in range(SESSIONS)]
    prompt = cached = ideal = 0
    last_prompt = [0] * SESSIONS
    misses = []
    with httpx.Client(timeout=60) as c:
        for t in range(TURNS):
            for s in range(SESSIONS):   # sessions interleaved: Envoy alternates the pickers
                history[s].append({"role": "user", "content": " ".join(f"s{s}t{t}u{j}" for j in range(40))})
                before = cache_counters(c, engines)
                r = c.post(base + "/v1/chat/completions",
                           json={"model": "sim-model", "max_tokens": 4, "messages": history[s]})
                assert r.status_code == 200, r.text
                body = r.json()
                # the engine that served it: the one whose queried tokens grew (one request at a time)
                after = cache_counters(c, engines)
                (hit,) = [a[1] - b[1] for a, b in zip(after, before) if a[0] > b[0]]
                n = body["usage"]["prompt_tokens"]
                prompt += n
                cached += hit
                # the engine holding the history has the previous turn's full blocks but the last token's
                want = (last_prompt[s] - 1) // BS * BS if t else 0
                ideal += want
                if hit < want:
                    misses.append((s, t, hit, want))
                last_prompt[s] = n
                history[s].append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    d = [decisions(m) for _, m in pickers]
    assert min(d) >= SESSIONS, f"both pickers decide (decisions {d})"
    assert misses == [], f"turns not placed on the engine holding their history: {misses}"
    assert cached / prompt >= ideal / prompt - 0.02, (cached, ideal, prompt)
