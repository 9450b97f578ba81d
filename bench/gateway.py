"""Gateway mode (Envoy + ``dplb-epp``) against DPLB's own router, in alternated rounds of one run.
``python -m bench.gateway [--rounds 4] [--rate 300] [--mode NONE] [--baseline-dir DIR]``

Setup (loopback, cleaned up on exit): the instant worker of :mod:`bench.router_overhead` on a TCP
port owning slot 0 of a fresh segment (as an agent would); DPLB's router on that segment; and one
*gateway* per ``--mode`` (Envoy rendered by ``dplb-epp --print-envoy-config`` with that response
body mode, in front of its own ``dplb-epp --shm`` picker sharing the router's state directory).
``--baseline-dir DIR`` adds a gateway run from another DPLB checkout (its picker and its Envoy
bootstrap, default mode): before/after figures from one run. ``--envoy-concurrency N`` gives
every Envoy ``--concurrency N`` (default: what the launcher gives it, :func:`epp.envoy.envoy_concurrency`:
one worker thread on a small machine; 0: Envoy's own default, one per core).

Each of ``--rounds`` rounds, the systems in a rotating order:

- **latency block**: ``--block-requests`` sequential tiny chat requests (non-streamed) on one
  keep-alive connection straight to the worker, then through the system: added p50 = system p50 -
  direct p50;
- **paced load**: ``--rate`` tiny requests/s over ``--conns`` keep-alive connections for
  ``--seconds``; each request's latency from the moment it was *due* (a system that falls behind
  shows its queue in the figures: no coordinated omission); the CPU per request of the router, or
  of Envoy + the picker (psutil, user + system, over the paced phase).

Printed per system: the medians over the rounds with the per-round range, the gateway / router
ratios of each round (median and range), and the load average before and after (the machine is
shared: only ratios within one run mean anything). ``--epp-profile FILE``: the (first) picker runs
under cProfile; its 40 costliest functions (inclusive) are written to ``FILE`` at the end.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench.rawclient import (
    chat_request,
    connector,
    in_threads,
    pct,
    read_response,
    sequential,
)
from epp.envoy import envoy_argv
from launcher.stack import free_port, router_argv, wait_for, wait_for_port

ROOT = Path(__file__).resolve().parent.parent


def _hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _ext_proc(cfg: dict) -> dict:
    return _hcm(cfg)["http_filters"][0]["typed_config"]


def _direct(cfg: dict, wport: int) -> None:
    """No ext_proc filter; the route goes to a static cluster holding the engine."""
    hcm = _hcm(cfg)
    hcm["http_filters"] = hcm["http_filters"][1:]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "engine"
    cfg["static_resources"]["clusters"].append({
        "name": "engine", "type": "STATIC", "connect_timeout": "2s", "load_assignment": {
            "cluster_name": "engine", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": wport}}}}]}]}})


def _no_stats(cfg: dict, wport: int) -> None:
    cfg["stats_config"] = {"stats_matcher": {"reject_all": True}}


def _no_request_id(cfg: dict, wport: int) -> None:
    hcm = _hcm(cfg)
    hcm["generate_request_id"] = False
    hcm["http_filters"][-1]["typed_config"]["suppress_envoy_headers"] = True


def _no_metadata(cfg: dict, wport: int) -> None:
    _ext_proc(cfg).pop("metadata_options", None)


def _access_log(cfg: dict, wport: int) -> None:
    from epp.envoy import ACCESS_LOG_FORMAT

    _hcm(cfg)["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
        "path": "/dev/null", "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]


def _request_only(cfg: dict, wport: int) -> None:
    """The response side skipped: Envoy resets the ext_proc stream at dispatch (no accounting)."""
    _ext_proc(cfg)["processing_mode"].update(response_header_mode="SKIP", response_body_mode="NONE")


def _no_local_reply(cfg: dict, wport: int) -> None:
    _hcm(cfg).pop("local_reply_config", None)


def _runtime(flags: dict[str, bool]) -> Callable[[dict, int], None]:
    def apply(cfg: dict, wport: int) -> None:
        cfg["layered_runtime"] = {"layers": [{"name": "static", "static_layer": dict(flags)}]}
    return apply


def _no_trailers(cfg: dict, wport: int) -> dict[str, str]:
    """The default bootstrap; the floor ends no stream with trailers (Envoy resets each itself)."""
    return {"FLOOR_NO_TRAILERS": "1"}


#: bootstrap changes for ``--floor VARIANT`` (each ``f(bootstrap dict, engine port)``, in place;
#: it may return environment variables for bench.epp_floor)
VARIANTS: dict[str, Callable[[dict, int], dict[str, str] | None]] = {"": lambda cfg, wport: None,
            "no-trailers": _no_trailers,
            # Envoy's HTTP/2 codec nghttp2 instead of oghttp2 (a runtime guard of Envoy 1.40)
            "nghttp2": _runtime({"envoy.reloadable_features.http2_use_oghttp2": False}), "direct": _direct, "no-stats": _no_stats, "no-request-id": _no_request_id,
            "no-metadata": _no_metadata, "access-log": _access_log, "request-only": _request_only,
            "no-local-reply": _no_local_reply}


@dataclass
class System:
    """One path under test: its port and the processes whose CPU it costs."""
    name: str
    port: int
    pids: list[int]
    added: list[float] = field(default_factory=list)      # ms, per round
    cpu_us: list[float] = field(default_factory=list)     # per request, per round
    p50: list[float] = field(default_factory=list)        # ms, paced, per round
    p99: list[float] = field(default_factory=list)
    rate: list[float] = field(default_factory=list)       # answered requests/s, per round
    parts: list[list[float]] = field(default_factory=list)   # CPU µs per request of each pid, per round
    bad: int = 0
    statuses: list[int] = field(default_factory=list)   # non-200 answers of the latency blocks


def paced(port: int, conns: int, seconds: float, rate: float) -> tuple[list[float], int]:
    """``rate`` tiny chat requests/s over ``conns`` keep-alive connections (each sends one every
    ``conns / rate`` s) for ``seconds``. Returns the latencies of the 200 answers in ms, each from
    the moment its request was due, and the count of other answers."""
    req = chat_request(b"bench")
    gap = conns / rate
    start = time.monotonic() + 0.05
    stop = start + seconds
    lat: list[list[float]] = [[] for _ in range(conns)]
    bad = [0] * conns

    def run(k: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        due = start + gap * k / conns
        try:
            while due < stop:
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                s.sendall(req)
                if read_response(s, buf) == 200:
                    lat[k].append((time.monotonic() - due) * 1000.0)
                else:
                    bad[k] += 1
                due += gap
        finally:
            s.close()

    in_threads(run, conns)
    return [x for xs in lat for x in xs], sum(bad)


def blocks(port: int, n: int, bad: list[int]) -> list[float]:
    """``n`` sequential tiny chat requests on one keep-alive connection; latencies of the 200
    answers in ms (the statuses of others are appended to ``bad``)."""
    s = connector(port)()
    req = chat_request(b"bench")
    buf = bytearray()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(req)
            st = read_response(s, buf)
            if st == 200:
                out.append((time.perf_counter() - t0) * 1000.0)
            else:
                bad.append(st)
    finally:
        s.close()
    return out


def _get_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as r:
        return r.status == 200


def _cpu(pids: list[int]) -> list[float]:
    import psutil

    return [sum(psutil.Process(p).cpu_times()[:2]) for p in pids]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.gateway", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block-requests", type=int, default=300, help="sequential requests per path per round")
    ap.add_argument("--rate", type=float, default=300.0, help="paced tiny requests/s (0: skip the paced phase)")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each paced phase")
    ap.add_argument("--conns", type=int, default=8, help="keep-alive connections of the paced phase")
    ap.add_argument("--policy", default="dplb")
    ap.add_argument("--mode", action="append", help="response body mode of a gateway (repeatable; default: the "
                    "picker's default); a mode may carry picker flags after '+' (e.g. 'NONE+--foo')")
    ap.add_argument("--baseline-dir", help="another DPLB checkout (built): its picker and bootstrap as a gateway")
    ap.add_argument("--envoy-concurrency", type=int, help="Envoy --concurrency (default: the launcher's, "
                    "epp.envoy.envoy_concurrency; 0: Envoy's own default)")
    ap.add_argument("--epp-profile", help="run the first picker under cProfile, write its top functions here")
    ap.add_argument("--floor", action="append", nargs="?", const="", metavar="VARIANT",
                    help="a gateway whose picker is bench.epp_floor (the cheapest ext_proc server: one fixed "
                         "answer, nothing counted) behind the default bootstrap, or that bootstrap changed by "
                         f"VARIANT (repeatable; {', '.join(VARIANTS)})")
    ap.add_argument("--envoy-only", action="store_true",
                    help="Envoy alone in front of the engine (no ext_proc filter): what proxying costs Envoy")
    return ap


class Run:
    """The processes of one run (module docstring) in the run directory ``d``; :meth:`close` stops them."""

    def __init__(self, a: argparse.Namespace) -> None:
        from dplb_shm import Segment

        self.a = a
        self.shm = f"dplb-bench-{uuid.uuid4().hex[:8]}"
        self.d = tempfile.mkdtemp(prefix="dplb-bench-gw-", dir="/tmp")
        self.seg = Segment.create(self.shm, num_slots=8)
        self.children: list[subprocess.Popen] = []
        self.wport = self.rport = 0

    def start(self, argv: list[str], log: str, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a child in its own session, its output to ``log`` in the run directory."""
        f = open(os.path.join(self.d, log), "wb")  # noqa: SIM115 - closed with the run dir
        p = subprocess.Popen(argv, cwd=cwd, start_new_session=True, stdout=f, stderr=f,
                             env={**os.environ, "PYTHONPATH": str(cwd), **(env or {})})
        self.children.append(p)
        return p

    def router(self) -> System:
        """The instant worker (slot 0) and DPLB's router in front of it."""
        self.wport = free_port()
        self.start([sys.executable, "-m", "bench.router_overhead", "--serve-worker", self.shm,
                    f"127.0.0.1:{self.wport}", "64", "0.001"], "worker.log")
        wait_for_port(self.wport, timeout=30)
        self.rport = rport = free_port()
        router = self.start(router_argv(port=rport, shm=self.shm, policy=self.a.policy, log_level="warning"),
                            "router.log")
        wait_for(lambda: _get_ok(f"http://127.0.0.1:{rport}/health"), 60, "router ready")
        return System("router", rport, [router.pid])

    def gateway(self, i: int, spec: str, cwd: Path) -> System:
        """Envoy and its picker from the checkout ``cwd``; ``spec``: ``MODE[+flags and VAR=value]``."""
        a = self.a
        mode, _, extra = spec.partition("+")
        name = ("gw-base" if cwd != ROOT else "gateway") + (f"-{mode}" if mode else "") + (f"+{extra}" if extra else "")
        eport, hport, port, admin = free_port(), free_port(), free_port(), free_port()
        words = extra.split()
        flags = ["--shm", self.shm, "--policy", a.policy, "--port", str(eport), "--health-port", str(hport),
                 "--metrics-port", "0", "--state-dir", f"/tmp/dplb-router-{self.rport}",
                 *(["--response-body-mode", mode] if mode else []), *(w for w in words if "=" not in w or w[:2] == "--")]
        env = dict(w.split("=", 1) for w in words if "=" in w and w[:2] != "--")
        prof = ["-m", "cProfile", "-o", os.path.join(self.d, "epp.prof")] if a.epp_profile and i == 0 else []
        epp = self.start([sys.executable, *prof, "-m", "epp", *flags], f"epp-{i}.log", cwd, env)
        text = subprocess.run([sys.executable, "-m", "epp", *flags, "--print-envoy-config", "--envoy-port", str(port),
                               "--envoy-admin-port", str(admin)], cwd=cwd, check=True, capture_output=True,
                              env={**os.environ, "PYTHONPATH": str(cwd), **env}).stdout
        cfg = os.path.join(self.d, f"envoy-{i}.yaml")
        Path(cfg).write_bytes(text)
        conc = ["--concurrency", str(a.envoy_concurrency)] if a.envoy_concurrency else []
        envoy = self.start([*envoy_argv(cfg, "error"), *conc], f"envoy-{i}.log")
        wait_for_port(eport, timeout=60)
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=2).read().strip() == b"LIVE",
                 60, f"{name} ready")
        return System(name, port, [envoy.pid, epp.pid])

    def floor(self, variant: str) -> System:
        """Envoy (the default bootstrap, changed by ``variant``: :data:`VARIANTS`) in front of
        :mod:`bench.epp_floor`; ``variant`` ``direct``: no ext_proc filter, Envoy alone."""
        from epp.envoy import EnvoySettings, bootstrap

        eport, port, admin = free_port(), free_port(), free_port()
        name = "envoy-only" if variant == "direct" else "floor" + (f"+{variant}" if variant else "")
        cfg = bootstrap(EnvoySettings(listen_port=port, admin_port=admin, epp_port=eport))
        env = VARIANTS[variant](cfg, self.wport)
        path = os.path.join(self.d, f"envoy-{name}.yaml")
        Path(path).write_text(yaml.safe_dump(cfg, sort_keys=False))
        pids = []
        if variant != "direct":
            floor = self.start([sys.executable, "-m", "bench.epp_floor", "--port", str(eport),
                                "--endpoint", f"127.0.0.1:{self.wport}"], f"{name}.log", env=env)
            wait_for_port(eport, timeout=30)
            pids.append(floor.pid)
        conc = ["--concurrency", str(self.a.envoy_concurrency)] if self.a.envoy_concurrency else []
        envoy = self.start([*envoy_argv(path, "error"), *conc], f"envoy-{name}.log")
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{admin}/ready", timeout=2).read().strip() == b"LIVE",
                 60, f"{name} ready")
        return System(name, port, [envoy.pid, *pids])

    def close(self) -> None:
        """Stop the children, write the profile (``--epp-profile``), remove the segment and the run dir."""
        for p in reversed(self.children):
            p.terminate()
        for p in self.children:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        prof = os.path.join(self.d, "epp.prof")
        if self.a.epp_profile and os.path.exists(prof):
            import pstats

            with open(self.a.epp_profile, "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
        self.seg.close()
        if os.path.exists(f"/dev/shm/{self.shm}"):
            os.unlink(f"/dev/shm/{self.shm}")
        shutil.rmtree(self.d, ignore_errors=True)


def measure(a: argparse.Namespace, systems: list[System], wport: int) -> None:
    """The rounds (module docstring): per system a latency block and a paced phase, order rotating."""
    for s in systems:   # warm-up: connections, pools, the first decisions
        warm: list[int] = []
        blocks(s.port, 200, warm)
        if warm:
            print(f"warm-up of {s.name}: non-200 answers {warm[:10]} ({len(warm)})")
    direct = connector(wport)
    sequential(direct, 200)
    for r in range(a.rounds):
        k = r % len(systems)
        for s in systems[k:] + systems[:k]:
            base = pct(sequential(direct, a.block_requests), 50)
            s.added.append(pct(blocks(s.port, a.block_requests, s.statuses) or [float("nan")], 50) - base)
            if a.rate > 0:
                c0 = _cpu(s.pids)
                lat, bad = paced(s.port, a.conns, a.seconds, a.rate)
                parts = [(y - x) * 1e6 / max(1, len(lat) + bad) for x, y in zip(c0, _cpu(s.pids), strict=True)]
                s.parts.append(parts)
                s.cpu_us.append(sum(parts))
                s.bad += bad
                s.p50.append(pct(lat, 50) if lat else float("nan"))
                s.p99.append(pct(lat, 99) if lat else float("nan"))
                s.rate.append(len(lat) / a.seconds)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the figures (module docstring)."""
    a = build_parser().parse_args(argv)
    if a.envoy_concurrency is None:
        from epp.envoy import envoy_concurrency

        a.envoy_concurrency = envoy_concurrency() or 0
    load0 = os.getloadavg()
    run = Run(a)
    try:
        systems = [run.router()]
        specs = [(m, ROOT) for m in (a.mode or [""])]
        if a.baseline_dir:
            specs.append(("", Path(a.baseline_dir).resolve()))
        systems += [run.gateway(i, spec, cwd) for i, (spec, cwd) in enumerate(specs)]
        systems += [run.floor(v) for v in (a.floor or [])]
        if a.envoy_only:
            systems.append(run.floor("direct"))
        measure(a, systems, run.wport)
        report(a, systems, load0)
        return 1 if any(s.bad or s.statuses for s in systems) else 0
    finally:
        run.close()


def _med(xs: list[float], fmt: str) -> str:
    return f"{format(statistics.median(xs), fmt)} [{format(min(xs), fmt)}–{format(max(xs), fmt)}]" if xs else "-"


def report(a: argparse.Namespace, systems: list[System], load0: tuple[float, float, float]) -> None:
    """Print the per-system medians (per-round ranges) and the ratios to the router (module docstring)."""
    print(f"{a.rounds} rounds, rotating order; latency blocks of {a.block_requests} sequential tiny requests; "
          + (f"paced {a.rate:g} req/s over {a.conns} connections for {a.seconds:g} s" if a.rate > 0 else "no paced phase")
          + f"; policy {a.policy}; Envoy concurrency {a.envoy_concurrency or 'default'}")
    print(f"{'system':<28} {'added p50 ms':>22} {'CPU µs/req':>20} {'paced p50 ms':>20} {'paced p99 ms':>22} {'req/s':>8}")
    for s in systems:
        print(f"{s.name:<28} {_med(s.added, '.3f'):>22} {_med(s.cpu_us, '.0f'):>20} {_med(s.p50, '.2f'):>20} "
              f"{_med(s.p99, '.2f'):>22} {statistics.median(s.rate) if s.rate else 0:8.0f}")
    for s in systems[1:]:
        if s.parts:
            picker = f", picker {_med([p[1] for p in s.parts], '.0f')}" if len(s.parts[0]) > 1 else ""
            print(f"  {s.name}: CPU µs per request, Envoy {_med([p[0] for p in s.parts], '.0f')}{picker}")
    router = systems[0]
    for s in systems[1:]:
        added = [x / y for x, y in zip(s.added, router.added, strict=True) if y > 0]
        cpu = [x / y for x, y in zip(s.cpu_us, router.cpu_us, strict=True) if y > 0]
        print(f"{s.name} / router: added p50 {_med(added, '.2f')}×, CPU per request {_med(cpu, '.2f')}×"
              + (f"; non-200 answers: {s.bad} paced, {s.statuses} sequential" if s.bad or s.statuses else ""))
    after = os.getloadavg()
    print(f"load average before {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, "
          f"after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
