"""The systems under test, each started in front of a fresh :class:`bench.engines.EngineSet`.

- ``dplb/<policy>``: a fresh segment, one worker agent per engine attached to it with
  ``--engine openai --engine-url http://127.0.0.1:P`` (so DPLB drives exactly the engines the
  peers get, with the same flags), and one router process. Routing CPU = router + agents (the
  agents keep the engines off the request path since issue 14 — the router forwards straight to
  each engine — and scrape their metrics every 200 ms; the router alone is recorded too).
- ``sglang/<policy>``, ``vllm/<policy>``, ``smg/<policy>``: the peer router pointed at the
  engines' URLs directly (see :mod:`bench.peers`). smg's ``least_load`` and its ``cache_aware``
  fallback read the engines' ``GET /metrics`` (vLLM gauges), polled every 10 s; smg counts as
  started once it holds a load report for every engine (:func:`smg_loads_known`, up to 10 s).
- ``direct``: no router; the client talks to engine 0 (baseline for added latency).

A started system is a :class:`Running`: the client's base URL plus the PIDs whose CPU time is
charged to routing. Stopping is by PID/process group through the shared :class:`ProcessSet`;
the DPLB segment is unlinked.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from bench.engines import EngineSet, http_get
from bench.errors import StartupError
from bench.peers import ensure_peer, peer_command
from bench.procs import LOOPBACK, Child, ProcessSet, free_port, wait_until
from bench.replay import api_key
from launcher.stack import agent_argv, router_argv, write_router_config
from router.policies import policy_names

MODEL = "sim-llama-3.1-8b"
#: registered policies the benches leave out: the seeds' formula (``dplb`` replaced it) and random
BENCH_LEFT_OUT = ("weighted", "random")


def dplb_policies() -> tuple[str, ...]:
    """DPLB's policies the benches run: every registered one (router.policies.registry), in its
    order, but :data:`BENCH_LEFT_OUT`."""
    return tuple(p for p in policy_names() if p not in BENCH_LEFT_OUT)


PEER_POLICIES = {"sglang": ("cache_aware", "round_robin"), "vllm": ("cache_aware", "power_of_two"),
                 "smg": ("cache_aware", "least_load")}


@dataclass(frozen=True)
class SystemSpec:
    """Which system: ``kind`` in ``dplb|sglang|vllm|smg|direct`` and its routing ``policy``."""

    kind: str
    policy: str

    @property
    def label(self) -> str:
        """``kind/policy`` (``direct`` alone)."""
        return self.kind if self.kind == "direct" else f"{self.kind}/{self.policy}"


def all_systems() -> list[SystemSpec]:
    """Every system of issue 7, DPLB first, then the peers, then the direct baseline."""
    out = [SystemSpec("dplb", p) for p in dplb_policies()]
    out += [SystemSpec(k, p) for k, ps in PEER_POLICIES.items() for p in ps]
    out.append(SystemSpec("direct", "none"))
    return out


@dataclass
class Running:
    """A started system: ``base_url`` for the client, ``route_pids`` charged with routing CPU,
    ``router_pids`` (the router processes alone), the children to stop, and cleanup hooks."""

    spec: SystemSpec
    base_url: str
    route_pids: list[int]
    router_pids: list[int]
    children: list[Child] = field(default_factory=list)
    shm_name: str | None = None
    sock_dir: str | None = None


def _post_json(url: str, body: dict, timeout: float = 10.0, headers: Mapping[str, str] | None = None) -> int:
    req = urllib.request.Request(url, data=orjson.dumps(body), headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def probe(base_url: str) -> bool:
    """One tiny non-streaming chat completion through ``base_url``; True on HTTP 200. It sends the
    replay client's API key (:func:`bench.replay.api_key`): DPLB's admission queue takes a request
    for the tenant of its key, and a probe without one would be a second tenant, one that
    dispatched a request within ``admission.reserve_window_s`` of the measured load, which then
    counts as above its fair share and fills only ``tenant_reserve`` of the headroom for that
    long (docs/admission.md)."""
    return _post_json(base_url + "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1},
                      headers={"Authorization": f"Bearer {api_key()}"}) == 200


def start_system(spec: SystemSpec, procs: ProcessSet, engines: EngineSet, run_dir: Path,
                 ready_timeout_s: float = 120.0, router_config: Mapping[str, object] | None = None,
                 peer_extra: Sequence[str] = ()) -> Running:
    """Start ``spec`` in front of ``engines`` and wait until a probe request succeeds.

    ``run_dir`` is kept for the caller's logs; DPLB's agent sockets live in a short private
    directory under ``/tmp`` (Unix socket paths must stay under 108 bytes), removed on stop.
    ``router_config``: DPLB's router config (a ``dplb.yaml`` as a dict, e.g. its ``admission``
    section; default: none, the router's defaults); ``peer_extra``: flags appended to a peer's
    command line. Raises :class:`StartupError` (process exited, not ready in time) or
    :class:`bench.errors.PeerInstallError` (peer could not be installed).
    """
    if spec.kind == "direct":
        return Running(spec, engines.urls[0], [], [])
    if spec.kind in PEER_POLICIES:
        return _start_peer(spec, procs, engines, ready_timeout_s, peer_extra)
    if spec.kind == "dplb":
        return _start_dplb(spec, procs, engines, run_dir, ready_timeout_s, router_config)
    raise StartupError(spec.label, f"unknown system kind {spec.kind!r}")


def smg_loads_known(base_url: str, n: int) -> bool:
    """True once the smg router at ``base_url`` holds a load report for ``n`` workers.

    Reads smg's ``GET /workers`` (``{"workers": [{..., "engine_load": {"loads": [...]}}]}``). smg
    polls each worker's load every 10 s and a worker registered after the first tick waits for
    the next one; until then ``least_load`` (and ``cache_aware``'s fallback) scores it as the best
    reporting peer plus its own in-flight, so nearly every request goes to the reporting workers.
    """
    status, body = http_get(base_url + "/workers", 2.0)
    if status != 200:
        return False
    workers = orjson.loads(body).get("workers", [])
    return sum(1 for w in workers if (w.get("engine_load") or {}).get("loads")) >= n


def _start_peer(spec: SystemSpec, procs: ProcessSet, engines: EngineSet, timeout: float,
                extra: Sequence[str] = ()) -> Running:
    ensure_peer(spec.kind)
    port, prom = free_port(), free_port()
    child = procs.start([*peer_command(spec.kind, spec.policy, port, prom, engines.urls), *extra],
                        name=f"{spec.kind}-{spec.policy}")
    base = f"http://{LOOPBACK}:{port}"
    wait_until(lambda: probe(base), timeout, f"{spec.label} router at {base}", interval=0.25, children=[child])
    if spec.kind == "smg":  # ready = a load report for every engine (as DPLB waits for every worker)
        wait_until(lambda: smg_loads_known(base, engines.n), timeout, f"{spec.label}: load reports for "
                   f"{engines.n} engines", interval=0.5, children=[child])
    return Running(spec, base, [child.pid], [child.pid], [child])


def _start_dplb(spec: SystemSpec, procs: ProcessSet, engines: EngineSet, run_dir: Path, timeout: float,
                config: Mapping[str, object] | None = None) -> Running:
    shm = f"dplb-bench-{os.getpid()}-{free_port()}"
    # Unix socket paths must stay under 108 bytes: sockets go in a short private dir under /tmp
    run_dir = Path(tempfile.mkdtemp(prefix="dplb-b-", dir="/tmp"))
    os.chmod(run_dir, 0o700)
    from dplb_shm import Segment

    try:
        Segment.create(shm, num_slots=64, replace=True).close()
    except Exception as e:
        raise StartupError("dplb segment", f"cannot create segment {shm}: {e}") from e
    running = Running(spec, "", [], [], shm_name=shm, sock_dir=str(run_dir))
    try:
        agents = []
        for i, url in enumerate(engines.urls):
            agents.append(procs.start(agent_argv(i, shm, run_dir / f"agent-{i}.sock", engine="openai", engine_url=url,
                                                 model=MODEL, run_dir=run_dir, log_level="warning"),
                                      name=f"dplb-agent-{i}"))
        port = free_port()
        conf = None if config is None else write_router_config(run_dir / "dplb.yaml", config)
        router = procs.start(router_argv(port=port, shm=shm, policy=spec.policy, log_level="warning", config=conf),
                             name=f"dplb-router-{spec.policy}")
        base = f"http://{LOOPBACK}:{port}"
        running.base_url = base
        running.children = [router, *agents]
        running.route_pids = [router.pid] + [a.pid for a in agents]
        running.router_pids = [router.pid]

        def all_ready() -> bool:
            status, body = http_get(base + "/dplb/status", 2.0)
            if status != 200:
                return False
            ws = orjson.loads(body).get("workers", [])
            ready = [w for w in ws if str(w.get("state", "")).lower() == "ready" and w.get("eligible", True)]
            return len(ready) >= engines.n

        wait_until(all_ready, timeout, f"{spec.label}: {engines.n} workers ready", interval=0.25,
                   children=[router, *agents])
        wait_until(lambda: probe(base), timeout, f"{spec.label} router at {base}", interval=0.25, children=[router])
        return running
    except BaseException:
        stop_system(running, procs)
        raise


def stop_system(running: Running, procs: ProcessSet) -> None:
    """Stop the system's processes (by PID / process group) and unlink its segment, if any."""
    procs.stop_many(running.children)
    if running.shm_name:
        path = f"/dev/shm/{running.shm_name}"
        if os.path.exists(path):
            os.unlink(path)
    if running.sock_dir:
        shutil.rmtree(running.sock_dir, ignore_errors=True)
