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


def test_a_worker_seen_before_its_slot_names_a_model_gets_its_model_once_known():
    """Behind Envoy the picker saw each worker while its slot was still starting (no model yet):
    the empty model was cached and every request counted with ``model=""`` for ever."""
    from types import SimpleNamespace

    from router.metrics import Metrics

    h = SimpleNamespace(model="")
    m = Metrics()
    m.attach(SimpleNamespace(handles={0: h}), object(), "dplb", lambda h, s: None)  # type: ignore[arg-type]
    m.see_worker(0)                          # the slot is starting: no model in it yet
    h.model = "m1"                           # the agent wrote the engine's model
    m.observe_request("0", 200, "/v1/chat/completions", 0.01)
    m.errors.labels("0", "connect").inc()
    m.flush()
    def labelled(counter):
        return {tuple(sorted(s.labels.items())): s.value for fam in counter.collect() for s in fam.samples
                if s.name.endswith("_total")}
    assert labelled(m.requests)[(("model", "m1"), ("status", "200"), ("worker", "0"))] == 1.0
    assert labelled(m.errors.counter)[(("kind", "connect"), ("model", "m1"), ("worker", "0"))] == 1.0


def test_coalesced_histogram_observations_count_as_observe_does():
    """The per-request histograms (duration, TTFT, phases) are observed in batches
    (:func:`router.metrics.add_observations`): every bucket, the count and the sum come out as
    prometheus_client's ``observe`` per value makes them, bounds and the +Inf bucket included;
    a scrape sees what was observed before it, once."""
    from prometheus_client import CollectorRegistry, Histogram

    from router.metrics import BUCKETS, Metrics, add_observations
    from tests.helpers import metric

    values = [0.0, 0.0005, 0.001, 0.0010001, 0.02, 0.02, 0.3, 1.0, 7.5, 640.0, 641.0, 1e6]
    r = CollectorRegistry()
    one = Histogram("one", "per value", ["k"], buckets=BUCKETS, registry=r).labels("a")
    batch = Histogram("batch", "in one batch", ["k"], buckets=BUCKETS, registry=r).labels("a")
    for v in values:
        one.observe(v)
    add_observations(batch, values)

    def samples(name):
        return {(s.name.removeprefix(name), s.labels.get("le")): s.value
                for fam in r.collect() if fam.name == name for s in fam.samples if not s.name.endswith("_created")}
    assert samples("batch") == samples("one")
    assert samples("batch")[("_bucket", "0.001")] == 3 and samples("batch")[("_bucket", "+Inf")] == len(values)

    m = Metrics()
    for v in values:
        m.observe_phase("decode", "m", v)
        m.observe_ttft("/v1/chat/completions", v, "m")
    for _ in range(2):   # the first render adds them; the second finds nothing new
        text = m.render()[0].decode()
        for name, labels in (("dplb_router_request_phase_seconds", {"phase": "decode"}),
                             ("dplb_router_time_to_first_token_seconds", {"route": "/v1/chat/completions"})):
            assert metric(text, f"{name}_count", model="m", **labels) == len(values)
            assert metric(text, f"{name}_bucket", model="m", le="0.001", **labels) == 3
            assert abs(metric(text, f"{name}_sum", model="m", **labels) - sum(values)) < 1e-6
