"""``POST /add_worker?url=`` takes what SGLang router users pass (issue 46, item 8).

The failure: the URL of a plain vLLM/SGLang/OpenAI server answered 200 "Successfully added
worker", and the slot went DEAD 0.5 s later because it is not a DPLB agent; only a log line said
why. Now a plain engine becomes a worker without an agent, probed and scraped by the router; a
DPLB agent's control address is mirrored as before; an address that is neither is a 400 saying
what each path answered.
"""
from __future__ import annotations

import pytest

from bench.faultsuite.scen_contained import run_add_plain_engine

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]


def test_a_plain_sim_engine_on_tcp_added_by_url_serves_traffic():
    r = run_add_plain_engine(requests=20)
    x = r.extra
    code, engine, message = x["engine_added"]
    assert code == 200 and engine is True and message.startswith("Successfully added worker"), x["engine_added"]
    assert x["engine_row"]["routing"] == "eligible" and x["engine_row"]["model"] == "sim-llama-3.1-8b", x["engine_row"]
    assert r.ok == r.sent == 20 and r.lost == 0, x["served"]
    assert x["scraped_kv_cache_usage"] >= 0.0        # the engine's /metrics reached its slot
    code, msg = x["neither"]
    assert code == 400 and "neither a DPLB agent" in msg and "/v1/models answered 404" in msg, x["neither"]
    assert x["agent_added"] == (200, False)
