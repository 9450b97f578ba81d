"""``dplb-epp --shm`` over a node's real worker agents (sim engines listening on TCP,
``--engine-host``): the agents' slots are used as they are, no endpoints file; a stream through
Envoy teaches the worker's TTFT/TPOT and leaves the router lines at zero."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import openai
import pytest

from epp.envoy import EnvoySettings, bootstrap_yaml, envoy_argv
from launcher.stack import agent_argv, wait_for
from tests.helpers import ROOT, free_port, script, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_agents_slots_through_envoy(procs, run_dir, segment, shm_name):
    agents = [procs.start(agent_argv(i, shm_name, os.path.join(run_dir, f"agent-{i}.sock"), engine="sim",
                                     model="sim-model", run_dir=run_dir, extra=["--engine-host", "127.0.0.1"]),
                          log=os.path.join(run_dir, f"agent-{i}.log"), cwd=str(ROOT)) for i in range(2)]
    wait_for(lambda: sum(int(segment.read_slot(i).state) == 2 for i in range(2)) == 2, 120, "two ready agents",
             children=agents)
    assert all(not segment.read_slot(i).endpoint.startswith("/") for i in range(2))
    port = free_port()
    epp = procs.start([script("dplb-epp"), "--shm", shm_name, "--policy", "round_robin", "--port", str(port),
                       "--health-port", str(free_port()), "--metrics-port", "0",
                       "--state-dir", os.path.join(run_dir, "state")],
                      log=os.path.join(run_dir, "epp.log"), cwd=str(ROOT))
    wait_for_port(port, timeout=60)
    lport, admin = free_port(), free_port()
    cfg = Path(run_dir) / "envoy.yaml"
    cfg.write_text(bootstrap_yaml(EnvoySettings(listen_port=lport, admin_port=admin, epp_port=port)))
    envoy = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, "envoy.log"), cwd=str(ROOT))
    wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE", 90,
             "Envoy ready", children=[envoy, epp])
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{lport}/v1", api_key="none", timeout=60, max_retries=0)
    workers = set()
    for _ in range(2):
        with c.chat.completions.with_streaming_response.create(
                model="sim-model", messages=[{"role": "user", "content": "one two three"}], max_tokens=6,
                stream=True) as resp:
            workers.add(resp.headers["x-dplb-worker-id"])
            text = "".join(ch.choices[0].delta.content or "" for ch in resp.parse() if ch.choices)
        assert text
    assert workers == {"0", "1"}
    for i in range(2):
        wait_for(lambda i=i: segment.router_line(i)["router_inflight"] == 0, 10, "router line back to zero")
        line = segment.router_line(i)
        assert line["decode_reqs"] == 0 and line["prefill_tokens"] == 0 and line["router_tpot_s"] > 0, line
