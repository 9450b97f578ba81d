"""The router's Prometheus counters (router/metrics.py)."""
from __future__ import annotations


def test_coalesced_request_counters_are_on_every_page_and_counted_once():
    from router.metrics import Metrics
    from tests.helpers import metric

    m = Metrics()
    for _ in range(3):
        m.decision("dplb", "ttft")
        m.observe_request("2", 200, "/v1/chat/completions", 0.01)
    m.count_tokens(2, "m", 9, 4)
    m.count_tokens(2, "m", 1, 0)
    for _ in range(2):   # the first render flushes; the second finds nothing new to add
        text = m.render()[0].decode()
        assert metric(text, "dplb_router_routing_decisions_total", policy="dplb", reason="ttft") == 3
        assert metric(text, "dplb_router_requests_total", worker="2", status="200") == 3
        assert metric(text, "dplb_router_prompt_tokens_total", worker="2", model="m") == 10
        assert metric(text, "dplb_router_generation_tokens_total", worker="2", model="m") == 4
        assert metric(text, "dplb_router_request_duration_seconds_count", route="/v1/chat/completions") == 3
    m.decision("dplb", "ttft")
    m.flush()   # what the health tick does
    assert metric(m.render()[0].decode(), "dplb_router_routing_decisions_total", policy="dplb", reason="ttft") == 4
