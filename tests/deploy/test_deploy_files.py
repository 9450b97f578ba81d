"""deploy/: the Grafana dashboard, the Prometheus rules and the example scrape config are valid
(promtool), the alerts fire on what they should (promtool test rules), and the dashboard is the
output of its generator (issue 16). The real-Prometheus check is tests/e2e/test_operator.py."""
from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest

from tests.deploy.promql import (
    DASHBOARD,
    PROM_CONFIG,
    RULE_TESTS,
    RULES,
    alert_exprs,
    dashboard,
    dashboard_exprs,
    recording_exprs,
    rules,
)
from tests.helpers import ROOT, promtool

needs_promtool = pytest.mark.skipif(promtool() is None,
                                    reason="promtool not installed (Debian package prometheus; .ci/run installs it)")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, check=False,
                          cwd=RULES.parent)


@needs_promtool
def test_promtool_check_rules():
    cp = _promtool("check", "rules", RULES.name)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert f"SUCCESS: {len(rules())} rules found" in cp.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_alerts():
    cp = _promtool("test", "rules", RULE_TESTS.name)
    assert cp.returncode == 0 and "SUCCESS" in cp.stdout, cp.stdout + cp.stderr


@needs_promtool
def test_promtool_check_config():
    cp = _promtool("check", "config", PROM_CONFIG.name)
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_every_alert_is_unit_tested_firing_and_quiet():
    import yaml

    doc = yaml.safe_load(RULE_TESTS.read_text())
    fired = {a["alertname"] for t in doc["tests"] for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    quiet = {a["alertname"] for t in doc["tests"] for a in t.get("alert_rule_test", []) if not a.get("exp_alerts")}
    alerts = {name for name, _ in alert_exprs()}
    assert alerts == fired == quiet
    assert {"DPLBBackendOverloaded", "DPLBWorkerDead", "DPLBWorkerNotReady", "DPLBKVCacheNearThreshold",
            "DPLBHighErrorRatio", "DPLBCircuitOpen", "DPLBNoWorkerReady"} <= alerts
    for r in rules():
        if "alert" in r:
            assert r["labels"]["severity"] in ("critical", "warning")
            assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_dashboard_is_its_generators_output():
    spec = importlib.util.spec_from_file_location("dplb_dashboard", ROOT / "deploy" / "grafana" / "dashboard.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.render() == DASHBOARD.read_text(), "regenerate: python deploy/grafana/dashboard.py > deploy/grafana/dplb.json"


def test_dashboard_has_the_panels_an_operator_needs():
    d = dashboard()
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    titles = {p["title"]: p for p in panels}
    assert titles["Pending requests per GPU"]["type"] == "heatmap"
    kv = titles["KV-cache usage against decode latency"]
    assert [t["expr"].split("{")[0] for t in kv["targets"]] == ["dplb_worker_kv_cache_usage_ratio",
                                                                "dplb_worker_recent_tpot_seconds"]
    split = titles["Request time split: routing, queue + prefill, decode"]["targets"][0]["expr"]
    assert "dplb_router_request_phase_seconds_sum" in split and "by (phase)" in split
    for name in ("Routing decisions by reason (all models)", "Retries by reason (all models)", "Circuit state",
                 "Engine restarts"):
        assert name in titles
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource", "model"]


def test_the_errors_panel_names_every_error_kind_the_router_counts():
    """The "Errors by kind" panel's description lists the kinds an operator sees in its legend:
    it missed ``drain_cut`` (the router's stop cutting a request at its drain limit) when that
    kind was added to ``dplb_router_request_errors_total``."""
    from router.metrics import ERROR_KINDS

    panel = next(p for p in dashboard()["panels"] if p["title"] == "Errors by kind")
    named = set(re.findall(r"\b[a-z_0-9]+\b", panel["description"]))
    assert set(ERROR_KINDS) <= named, sorted(set(ERROR_KINDS) - named)


def test_names_follow_the_conventions_and_labels_are_bounded():
    exprs = [e for _, e in dashboard_exprs() + recording_exprs() + alert_exprs()]
    names = set(re.findall(r"\b(dplb_[a-z_]+)\b", " ".join(exprs)))
    assert names, "no DPLB series referenced"
    for n in names:
        # counters end in _total, units are base units (seconds, bytes, ratio), no _ms/_perc
        assert not re.search(r"_(ms|milliseconds|perc|percent)\b", n), n
    text = " ".join(exprs)
    for label in ("request_id", "rid", "prompt"):
        assert f"{label}=" not in text and f"by ({label}" not in text
