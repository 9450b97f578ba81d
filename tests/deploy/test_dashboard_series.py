"""Every series the Grafana dashboard (and the alert rules) query is one DPLB exports: the
router's families (router/metrics.py, its own counters and the segment's per-worker series) or the
engine's vLLM names (the simulated engine's page, sim_engine/metrics.py). A panel naming a series
nobody exports stays empty on every deployment (issue 32: "no empty panel on a fresh laptop
launch"). The real-Prometheus check that each expression has data is tests/e2e/test_operator.py."""
from __future__ import annotations

import re
from types import SimpleNamespace

from tests.deploy.promql import alert_exprs, dashboard, dashboard_exprs, recording_exprs

_NAME = re.compile(r"(?<![:\w])(dplb_[a-z_]+(?![:\w])|vllm:[a-z_:]+)")  # not a recorded job:...:... name
_SUFFIXES = ("_bucket", "_sum", "_count")


def _router_series() -> set[str]:
    """Sample names of the router's page: its registry plus the segment collector's families,
    rendered with no worker listed (families are written with their HELP/TYPE lines even empty)."""
    from router.config import Config
    from router.metrics import Metrics

    m = Metrics()
    m.attach(SimpleNamespace(handles={}), object(), "dplb", lambda h, s: None,  # type: ignore[arg-type]
             default_prefill_rate=Config().routing_policy.prefill_tokens_per_s)
    out = set()
    for line in m.render()[0].decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            out.add(name)
            if kind == "histogram":
                out.update(name + s for s in _SUFFIXES)
    return out


def _engine_series() -> set[str]:
    from sim_engine import metrics as sm

    out = {name for name, *_ in sm.GAUGES}
    out |= {name + "_total" for name, *_ in sm.COUNTERS}
    out |= {name + s for name, *_ in sm.HISTOGRAMS for s in _SUFFIXES}
    return out


def test_every_dashboard_and_rule_series_is_exported():
    exported = _router_series() | _engine_series()
    recorded = {name for name, _ in recording_exprs()}
    missing = []
    for what, expr in dashboard_exprs() + alert_exprs():
        for name in _NAME.findall(expr):
            if name not in exported and name not in recorded:
                missing.append(f"{what}: {name}")
    assert not missing, "series nobody exports:\n" + "\n".join(missing)


def test_the_model_selector_filters_every_panel_whose_series_carry_a_model():
    """Router-level panels (requests, errors, TTFT, duration) did not follow ``$model``: their
    series had no model label. Every selector of a series with a ``model`` label now names it."""
    with_model = _model_series()
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            for sel in re.finditer(r"\b(dplb_[a-z_]+)(\{[^}]*\})?", t["expr"]):
                name, labels = sel.group(1), sel.group(2) or ""
                base = next((name[: -len(s)] for s in _SUFFIXES if name.endswith(s)), name)
                if base in with_model or name in with_model:
                    assert 'model=~"$model"' in labels, (p["title"], t["expr"])


def _model_series() -> set[str]:
    """Names of the router's families that carry a ``model`` label (a sample with one)."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.metrics import Metrics

    m = Metrics()
    m.observe_request("0", 200, "/v1/chat/completions", 0.1)
    m.observe_ttft("/v1/chat/completions", 0.1, "m")
    m.errors.labels("0", "connect").inc()
    m.observe_phase("decode", "m", 0.1)
    m.count_tokens(0, "m", 1, 1)
    names = set()
    for fam in text_string_to_metric_families(m.render()[0].decode()):
        if any("model" in s.labels for s in fam.samples):
            names.add(fam.name)
            names.add(fam.name + "_total")
    # the segment's per-worker series all carry worker and model (router/metrics.py)
    names |= {n for n in _router_series() if n.startswith("dplb_worker_")}
    return names
