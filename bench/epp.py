"""Added latency of Envoy + ``dplb-epp`` beside DPLB's router and a request straight to the engine.
``python -m bench.epp [--rounds 5] [--requests 300]``

Setup (loopback, cleaned up on exit): the instant worker (:mod:`bench.instant_worker`) on a TCP
port, owning slot 0 of a fresh segment (as an agent would); DPLB's router on that segment; the
picker (``dplb-epp --shm``, sharing the router's state directory) and an Envoy routing through it
(:mod:`epp.envoy`: ext_proc with a BUFFERED request body and a STREAMED response body, then
ORIGINAL_DST); and, to tell Envoy's own cost from the picker's, a second Envoy without ext_proc
(a static cluster to the worker).

Latency: ``--rounds`` rounds of ``--requests`` sequential non-streamed chat requests over one
keep-alive connection on each path, interleaved so machine noise hits every path alike (the raw
socket client of :mod:`bench.rawclient`). Printed: p50/p99 per path, added p50 over direct,
and the CPU seconds per request of the picker and of the Envoy in front of it (psutil, over all
rounds). Then ``--streams`` sequential streams of ``--chunks`` SSE events each through the router
and through Envoy + the picker in each of ``--response-modes`` (one Envoy per mode, the same
picker): the CPU per stream and per event of each (every event of a STREAMED or
FULL_DUPLEX_STREAMED response body is one ext_proc message to the picker; NONE sends the head and
the end only). On a shared 2-core VM the figures move by tens of µs between runs: compare the paths of
one run.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench.rawclient import STREAM_BODY, chat_request, connector, pct, sequential
from launcher.stack import free_port, router_argv, wait_for, wait_for_port


def plain_envoy(port: int, admin: int, worker_port: int) -> dict[str, Any]:
    """The picker's bootstrap without its ext_proc filter, routing to the worker (a static cluster)."""
    from epp.envoy import EnvoySettings, bootstrap

    cfg = bootstrap(EnvoySettings(listen_port=port, admin_port=admin))
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][1:]
    cfg["static_resources"]["clusters"] = [{
        "name": "original_destination_cluster", "type": "STATIC", "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "original_destination_cluster", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": worker_port}}}}]}]}}]
    return cfg


def _get_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.epp", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=300, help="sequential requests per path and round")
    ap.add_argument("--policy", default="dplb")
    ap.add_argument("--streams", type=int, default=100, help="sequential streams per path of the chunk phase (0: skip)")
    ap.add_argument("--chunks", type=int, default=64, help="SSE events per stream")
    ap.add_argument("--response-modes", default="STREAMED,FULL_DUPLEX_STREAMED,NONE",
                    help="response body modes of the chunk phase (comma-separated, epp.envoy.RESPONSE_BODY_MODES)")
    return ap


class Rig:
    """The bench's processes on loopback: a fresh segment of 8 slots and a run directory under
    /tmp; :meth:`start` runs a process with its output to a log there. :meth:`close` stops them
    (SIGTERM in reverse order, SIGKILL after 10 s) and removes the segment and the directory."""

    def __init__(self) -> None:
        from dplb_shm import Segment

        self.shm = f"dplb-bench-{uuid.uuid4().hex[:8]}"
        self.dir = tempfile.mkdtemp(prefix="dplb-bench-epp-", dir="/tmp")
        self.root = str(Path(__file__).resolve().parent.parent)
        self.seg = Segment.create(self.shm, num_slots=8)
        self.children: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` in its own session, stdout and stderr to ``log`` in the run directory."""
        f = open(os.path.join(self.dir, log), "wb")  # noqa: SIM115 - closed with the run dir
        p = subprocess.Popen(argv, cwd=self.root, start_new_session=True, stdout=f, stderr=f)
        self.children.append(p)
        return p

    def start_envoy(self, name: str, text: str, admin: int) -> subprocess.Popen[bytes]:
        """An Envoy of bootstrap ``text`` (YAML); waits until its admin port ``admin`` says LIVE."""
        from epp.envoy import envoy_argv

        path = os.path.join(self.dir, f"{name}.yaml")
        Path(path).write_text(text)
        p = self.start(envoy_argv(path, "error"), f"{name}.log")
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=2)
                 .read().strip() == b"LIVE", 60, f"{name} ready")
        return p

    def close(self) -> None:
        """Stop every process started; remove the segment and the run directory."""
        for p in reversed(self.children):
            p.terminate()
        for p in self.children:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.seg.close()
        if os.path.exists(f"/dev/shm/{self.shm}"):
            os.unlink(f"/dev/shm/{self.shm}")
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Paths:
    """The started paths: loopback ports by name (direct, router, envoy+epp, envoy) and the
    processes whose CPU is measured."""

    wport: int
    rport: int
    eport: int
    ports: dict[str, int]
    router: subprocess.Popen[bytes]
    epp: subprocess.Popen[bytes]
    envoy_epp: subprocess.Popen[bytes]


def start_paths(a: argparse.Namespace, rig: Rig) -> Paths:
    """The instant worker, DPLB's router, the picker, Envoy + the picker and a plain Envoy, each
    waited for until it serves."""
    from epp.envoy import EnvoySettings, bootstrap_yaml

    wport = free_port()
    rig.start([sys.executable, "-m", "bench.router_overhead", "--serve-worker", rig.shm, f"127.0.0.1:{wport}",
               str(a.chunks), "0.001"], "worker.log")
    wait_for_port(wport, timeout=20)
    rport = free_port()
    router = rig.start(router_argv(port=rport, shm=rig.shm, policy=a.policy, log_level="warning"), "router.log")
    wait_for(lambda: _get_ok(f"http://127.0.0.1:{rport}/health"), 60, "router ready")
    eport, hport = free_port(), free_port()
    epp = rig.start([sys.executable, "-m", "epp", "--shm", rig.shm, "--policy", a.policy, "--port", str(eport),
                     "--health-port", str(hport), "--metrics-port", "0", "--state-dir", f"/tmp/dplb-router-{rport}"],
                    "epp.log")
    wait_for_port(eport, timeout=60)
    paths: dict[str, int] = {}
    envoys: list[subprocess.Popen[bytes]] = []
    for name, cfg_text in (("envoy+epp", None), ("envoy", "plain")):
        port, admin = free_port(), free_port()
        text = (bootstrap_yaml(EnvoySettings(listen_port=port, admin_port=admin, epp_port=eport))
                if cfg_text is None else yaml.safe_dump(plain_envoy(port, admin, wport)))
        envoys.append(rig.start_envoy(name, text, admin))
        paths[name] = port
    return Paths(wport, rport, eport, {"direct": wport, "router": rport, **paths}, router, epp, envoys[0])


def latency_phase(a: argparse.Namespace, p: Paths) -> None:
    """``a.rounds`` rounds of ``a.requests`` sequential non-streamed requests per path, the
    order reversed every other round; prints p50/p99 and added p50 per path and the CPU per
    request of the picker and of Envoy in front of it."""
    import psutil

    ports = p.ports
    for port in ports.values():   # warm-up: connections, pools, the picker's first decisions
        sequential(connector(port), 50)
    lat: dict[str, list[float]] = {k: [] for k in ports}
    cpu = {"dplb-epp": psutil.Process(p.epp.pid), "envoy (ext_proc)": psutil.Process(p.envoy_epp.pid)}
    t0 = {k: sum(pr.cpu_times()[:2]) for k, pr in cpu.items()}
    for r in range(a.rounds):
        order = list(ports) if r % 2 == 0 else list(reversed(ports))
        for k in order:
            lat[k] += sequential(connector(ports[k]), a.requests)
    used = {k: sum(pr.cpu_times()[:2]) - t0[k] for k, pr in cpu.items()}
    n = a.rounds * a.requests
    base = pct(lat["direct"], 50)
    print(f"{n} sequential requests per path, non-streamed chat, policy {a.policy}")
    print(f"{'path':<12} {'p50 ms':>8} {'p99 ms':>8} {'added p50 ms':>13}")
    for k, xs in lat.items():
        print(f"{k:<12} {pct(xs, 50):8.3f} {pct(xs, 99):8.3f} {pct(xs, 50) - base:13.3f}")
    for k, s in used.items():
        print(f"CPU per request, {k}: {1e6 * s / n:.0f} µs")


def stream_phase(a: argparse.Namespace, rig: Rig, p: Paths) -> None:
    """The chunk phase, per response body mode: STREAMED and FULL_DUPLEX_STREAMED send every SSE
    event of the answer to the picker (one ext_proc message each; full duplex: the picker sends it
    back itself), NONE only the head and the end. One Envoy per mode, the same picker. Prints the
    stream p50 and the CPU per stream and per event of the router or the picker (and Envoy)."""
    import psutil

    from epp.envoy import EnvoySettings, bootstrap_yaml

    cpu = {"dplb-epp": psutil.Process(p.epp.pid), "router": psutil.Process(p.router.pid)}
    ports = {"router": p.rport}
    req = chat_request(b"bench", STREAM_BODY)
    for mode in a.response_modes.split(","):
        if mode == "STREAMED":
            cpu[f"envoy {mode}"] = psutil.Process(p.envoy_epp.pid)
            ports[f"envoy+epp {mode}"] = p.ports["envoy+epp"]
            continue
        port, admin = free_port(), free_port()
        text = bootstrap_yaml(EnvoySettings(listen_port=port, admin_port=admin, epp_port=p.eport,
                                            response_body_mode=mode))
        cpu[f"envoy {mode}"] = psutil.Process(rig.start_envoy(f"envoy-{mode}", text, admin).pid)
        ports[f"envoy+epp {mode}"] = port
        sequential(connector(port), 20, req)   # warm-up
    print(f"{a.streams} sequential streams of {a.chunks} events (1 ms apart) per path")
    events = a.streams * a.chunks
    for k in ("router", *(f"envoy+epp {m}" for m in a.response_modes.split(","))):
        t0 = {c: sum(pr.cpu_times()[:2]) for c, pr in cpu.items()}
        xs = sequential(connector(ports[k]), a.streams, req)
        used = {c: sum(pr.cpu_times()[:2]) - t0[c] for c, pr in cpu.items()}
        own = used["router"] if k == "router" else used["dplb-epp"]
        print(f"{k:<32} stream p50 {pct(xs, 50):7.2f} ms; CPU of {'the router' if k == 'router' else 'dplb-epp'}:"
              f" {1e3 * own / a.streams:.2f} ms per stream, {1e6 * own / events:.0f} µs per event"
              + (f"; Envoy {1e6 * used['envoy ' + k.split()[-1]] / events:.0f} µs per event"
                 if k != "router" else ""))


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the figures (module docstring)."""
    a = build_parser().parse_args(argv)
    rig = Rig()
    try:
        p = start_paths(a, rig)
        latency_phase(a, p)
        if a.streams:
            stream_phase(a, rig, p)
        return 0
    finally:
        rig.close()


if __name__ == "__main__":
    sys.exit(main())
