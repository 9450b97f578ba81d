"""The Envoy bootstrap (epp/envoy.py), checked by Envoy itself."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from epp.envoy import (
    HEADER,
    EnvoySettings,
    bootstrap,
    bootstrap_yaml,
    envoy_argv,
    envoy_concurrency,
)


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED", "STREAMED"])
@pytest.mark.parametrize("fail_open", [False, True])
def test_bootstrap_is_valid_for_envoy(tmp_path, mode, fail_open):
    s = EnvoySettings(listen_port=18081, admin_port=19901, request_body_mode=mode, failure_mode_allow=fail_open,
                      access_log=str(tmp_path / "access.log"))
    cfg = bootstrap(s)
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["processing_mode"]["request_body_mode"] == mode
    assert ext["processing_mode"]["response_body_mode"] == "STREAMED"
    assert ext["failure_mode_allow"] is fail_open
    # a streamed body comes without waiting for the head's answer (the picker answers it at the body's end)
    assert ext.get("send_body_without_waiting_for_header_response", False) is (mode == "STREAMED")
    dst = cfg["static_resources"]["clusters"][1]
    assert dst["type"] == "ORIGINAL_DST" and dst["original_dst_lb_config"]["http_header_name"] == HEADER
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap_yaml(s))
    argv = envoy_argv(str(path), concurrency=1)
    assert argv[-2:] == ["--concurrency", "1"]
    r = subprocess.run([argv[0], "--mode", "validate", *argv[1:]], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_bootstrap_refuses_an_unknown_body_mode():
    with pytest.raises(ValueError, match="request_body_mode"):
        bootstrap(EnvoySettings(listen_port=1, admin_port=2, request_body_mode="BUFFERED_PARTIAL"))


def test_envoy_runs_one_worker_thread_on_a_small_machine():
    assert envoy_concurrency(1) == 1 and envoy_concurrency(2) == 1 and envoy_concurrency(4) == 1
    assert envoy_concurrency(16) is None   # Envoy's own default: a worker per CPU
    assert "--concurrency" not in envoy_argv("x.yaml")


@pytest.mark.parametrize("resp_mode", ["STREAMED", "FULL_DUPLEX_STREAMED", "NONE"])
def test_pool_cluster_bootstrap_is_valid_for_envoy(tmp_path, resp_mode):
    from epp.envoy import POOL_CLUSTER, write_eds

    eds = tmp_path / "eds" / "pool.json"
    write_eds(str(eds), ["127.0.0.1:8001", "[::1]:8002"])
    s = EnvoySettings(listen_port=18081, admin_port=19901, pool_eds=str(eds), response_body_mode=resp_mode)
    cfg = bootstrap(s)
    route = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == POOL_CLUSTER and "connect-failure" in route["retry_policy"]["retry_on"]
    pool = cfg["static_resources"]["clusters"][2]
    lb = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert lb["override_host_sources"] == [{"header": HEADER}]
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap_yaml(s))
    argv = envoy_argv(str(path))
    r = subprocess.run([argv[0], "--mode", "validate", *argv[1:]], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_print_envoy_config_renders_the_pool_cluster_and_the_response_mode(capsys, tmp_path):
    from epp.__main__ import main

    assert main(["--print-envoy-config", "--envoy-eds", str(tmp_path / "pool.json"),
                 "--response-body-mode", "NONE"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert [c["name"] for c in cfg["static_resources"]["clusters"]][-1] == "dplb_pool"
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["http_filters"][0]["typed_config"]["processing_mode"]["response_body_mode"] == "NONE"
    assert main(["--shm", "x", "--fallbacks", "-1"]) == 2
