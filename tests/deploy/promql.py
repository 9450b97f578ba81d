"""The PromQL expressions an operator runs: every target of the Grafana dashboard, every recording
rule and every alert of ``deploy/`` (shared by the fast checks and the real-Prometheus test)."""
from __future__ import annotations

import json
import re

import yaml

from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dplb.json"
RULES = DEPLOY / "prometheus" / "dplb.rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "dplb.rules.test.yml"
PROM_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"

#: Grafana's variables as an all-models dashboard expands them
GRAFANA_VARS = {"$__rate_interval": "1m", "$model": ".*"}
_CMP = re.compile(r"(==|!=|>=|<=|>|<)(?!\s*bool)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """``(panel title / refId, expression with Grafana's variables expanded)`` for every target."""
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for k, v in GRAFANA_VARS.items():
                expr = expr.replace(k, v)
            out.append((f"{p['title']} / {t['refId']}", expr))
    return out


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def recording_exprs() -> list[tuple[str, str]]:
    return [(r["record"], r["expr"]) for r in rules() if "record" in r]


def alert_exprs() -> list[tuple[str, str]]:
    """``(alert, its expression with every comparison made a ``bool`` one)``: the alert's
    condition evaluated for every series, so a healthy system still returns data (0 = quiet)."""
    return [(r["alert"], _CMP.sub(r"\1 bool", r["expr"])) for r in rules() if "alert" in r]
