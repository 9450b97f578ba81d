"""kill -9 of one of two ``dplb-epp`` picker replicas behind one Envoy, under load.

Two simulated engines in Envoy's pool cluster (EDS, ``override_host`` + retries), two pickers
with their own private segments (as on two nodes) in the ``epp`` cluster, 8 paced clients of
non-streamed chat requests; one picker is killed with SIGKILL while requests flow.

- Envoy ejects the dead replica at its first failed stream (:func:`epp.envoy.epp_outlier_detection`):
  every request sent after the ejection is answered 200 and picked by the survivor. Without the
  ejection Envoy keeps sending half the streams to the dead picker (each a 500 with FailClose).
- The requests whose ext_proc stream was on the killed picker cannot move to the other one
  (Envoy runs a request's ext_proc filter once): with FailClose they answer 500 (OpenAI-shaped,
  ``gateway_error``), at most the requests in flight; with FailOpen they go through to Envoy's
  round robin over the pool without a pick, and nothing is lost.

The ``procs`` fixture kills every process at teardown and unlinks the pickers' private segments."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from epp.envoy import EnvoySettings, bootstrap, envoy_argv
from launcher.stack import wait_for
from tests.epp import faults_stack as fs
from tests.helpers import ROOT, free_port, script, wait_for_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CONCURRENCY = 8


def envoy_stat(admin: str, name: str) -> int:
    """A counter or gauge from Envoy's admin ``/stats`` (0 when absent)."""
    for line in httpx.get(f"{admin}/stats?filter={name}", timeout=5).text.splitlines():
        k, _, v = line.partition(": ")
        if k == name:
            return int(v)
    return 0


def decisions(metrics_port: int) -> float:
    """A picker's routing decisions so far (its ``/metrics``)."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dplb_router_routing_decisions_total{"))


@pytest.mark.parametrize("fail_open", [False, True], ids=["FailClose", "FailOpen"])
def test_one_of_two_pickers_killed_under_load(procs, run_dir, fail_open):
    ports = [free_port() for _ in range(2)]
    engines = [procs.start([sys.executable, "-m", "sim_engine", "--port", str(p), "--model", fs.MODEL],
                           log=os.path.join(run_dir, f"engine-{i}.log"), cwd=str(ROOT)) for i, p in enumerate(ports)]
    for p in ports:
        wait_for_port(p, timeout=fs.STARTUP_S)
    eps = Path(run_dir) / "endpoints.yaml"
    eps.write_text("".join(f"- {{address: '127.0.0.1:{p}', model: {fs.MODEL}}}\n" for p in ports))
    pickers = []
    for i in range(2):
        port, health, metrics = free_port(), free_port(), free_port()
        eds = os.path.join(run_dir, f"eds-{i}", "pool.json")   # Envoy reads picker 0's
        proc = procs.start([script("dplb-epp"), "--endpoints-file", str(eps), "--envoy-eds", eds, "--port", str(port),
                            "--health-port", str(health), "--metrics-port", str(metrics),
                            "--state-dir", os.path.join(run_dir, f"state-{i}"), "--log-level", "info"],
                           log=os.path.join(run_dir, f"epp-{i}.log"), cwd=str(ROOT))
        pickers.append((proc, port, metrics, eds))
    for proc, port, _, eds in pickers:
        wait_for_port(port, timeout=fs.STARTUP_S)
        wait_for(lambda eds=eds: os.path.exists(eds), fs.STARTUP_S, "the picker's EDS file", children=[proc, *engines])
    lport, admin_port = free_port(), free_port()
    boot = bootstrap(EnvoySettings(listen_port=lport, admin_port=admin_port, epp_port=pickers[0][1],
                                   failure_mode_allow=fail_open, pool_eds=pickers[0][3]))
    # the second replica in the same cluster (a Kubernetes Service's endpoints, here listed)
    (epp,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "epp"]  # type: ignore[index,union-attr]
    epp["load_assignment"]["endpoints"][0]["lb_endpoints"].append(
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": pickers[1][1]}}}})
    cfg = Path(run_dir) / "envoy.yaml"
    cfg.write_text(yaml.safe_dump(boot))
    envoy = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, "envoy.log"), cwd=str(ROOT))
    admin = f"http://127.0.0.1:{admin_port}"
    wait_for(lambda: httpx.get(f"{admin}/ready", timeout=2).text.strip() == "LIVE", fs.STARTUP_S, "Envoy LIVE",
             children=[envoy])
    wait_for(lambda: envoy_stat(admin, "cluster.epp.membership_total") == 2
             and envoy_stat(admin, "cluster.dplb_pool.membership_total") == 2, 30, "Envoy's clusters", children=[envoy])
    url = f"http://127.0.0.1:{lport}"
    ev: dict[str, float] = {}
    victim = pickers[1]

    async def kill_then_watch(n: int, _answers: list) -> None:
        if "kill" not in ev:
            # both replicas pick before the kill (Envoy alternates them per stream)
            if n >= 40 and min(decisions(m) for _, _, m, _ in pickers) >= 5:
                os.kill(victim[0].pid, signal.SIGKILL)
                ev["kill"] = time.monotonic()
        elif "eject" not in ev and envoy_stat(admin, "cluster.epp.outlier_detection.ejections_active") >= 1:
            ev["eject"] = time.monotonic()

    answers = asyncio.run(fs.load(url, 6000, CONCURRENCY, timeout=30, pace_s=0.01, on_progress=kill_then_watch,
                                  stop=lambda: "eject" in ev and time.monotonic() > ev["eject"] + 3.0
                                  or "kill" in ev and time.monotonic() > ev["kill"] + 60))
    logs = "\n".join(f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                     for p in sorted(Path(run_dir).glob("*.log")))
    assert "kill" in ev, ("the pickers never both decided", logs)
    assert "eject" in ev, ("Envoy never ejected the killed picker", Counter(a.status for a in answers), logs)
    failed = [a for a in answers if a.status != 200]
    after = [a for a in answers if a.t_sent > ev["eject"]]
    unpicked = [a for a in answers if a.t_sent >= ev["kill"] and a.status == 200 and a.worker is None]
    print(f"kill -9 of one of two pickers, failure_mode_allow={fail_open}: {len(answers)} requests, "
          f"{Counter(a.status for a in answers)}; ejected {ev['eject'] - ev['kill']:.2f} s after the kill "
          f"(as seen here); {len(after)} sent after; {len(unpicked)} answered without a pick")
    # nothing hangs
    assert all(a.status is not None for a in answers), [a.detail for a in answers if a.status is None][:5]
    # after the ejection: every request answered, picked by the surviving replica
    assert len(after) >= CONCURRENCY
    assert all(a.status == 200 and (a.worker or "").isdigit() for a in after), [a.detail for a in after][:5]
    # what failed was in flight before the ejection
    assert all(a.t_sent <= ev["eject"] for a in failed)
    if fail_open:
        assert not failed, [a.detail for a in failed][:5]
    else:
        # at most the requests in flight on the dead replica (each client has one at a time)
        assert len(failed) <= CONCURRENCY, Counter(a.status for a in failed)
        assert {a.status for a in failed} <= {500}, Counter(a.status for a in failed)
        for a in failed:
            err = orjson.loads(a.detail)["error"]
            assert err["type"] == "gateway_error" and "dplb-epp" in err["message"], err
