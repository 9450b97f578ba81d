"""Config validation (router/config.py): defaults, flag overrides, errors naming the field, the example file."""
from __future__ import annotations

import pytest

from router.config import load_config
from router.errors import ConfigError


def test_config_defaults_and_overrides(tmp_path):
    cfg = load_config(None)
    assert cfg.health_check.interval_ms == 200 and cfg.health_check.timeout_ms == 50
    assert cfg.health_check.max_failures == 3
    assert cfg.circuit_breaker.failure_rate_threshold == 0.15 and cfg.circuit_breaker.minimum_requests == 20
    assert cfg.routing_policy.kv_cache_threshold == 0.8 and cfg.shm_name == "dplb-30000"
    p = tmp_path / "d.yaml"
    p.write_text("router: {port: 31000}\nrouting_policy: {policy: cache_aware}\n"
                 "backend_servers:\n  - {endpoint: 'http://10.1.2.3:8001', weight: 2}\n")
    cfg = load_config(p, {"routing_policy.policy": "round_robin", "router.api_key": None})
    assert cfg.router.port == 31000 and cfg.shm_name == "dplb-31000"
    assert cfg.routing_policy.policy == "round_robin"          # flag beats file
    assert cfg.backend_servers[0].endpoint == "10.1.2.3:8001" and cfg.backend_servers[0].weight == 2.0


@pytest.mark.parametrize("text,field", [
    ("health_check: {interval_ms: -5}", "health_check.interval_ms"),
    ("routing_policy: {policy: fastest}", "routing_policy.policy"),
    ("routing_policy: {kv_cache_threshold: 1.5}", "routing_policy.kv_cache_threshold"),
    ("circuit_breaker: {failure_rate: 0.2}", "circuit_breaker.failure_rate"),     # unknown key (typo)
    ("backend_servers: [{endpoint: 'nohostport'}]", "backend_servers.0.endpoint"),
    ("router: {shm: '/dev/shm/x'}", "router.shm"),
    ("- just\n- a list", "<root>"),
    ("router: {port: [", "<file>"),
])
def test_config_errors_name_the_field(tmp_path, text, field):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.field == field
    assert field in str(ei.value)


def test_example_config_is_valid_and_matches_defaults():
    from router.config import Config
    from tests.helpers import ROOT

    cfg = load_config(ROOT / "dplb.example.yaml")
    assert cfg == Config()
