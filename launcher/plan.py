"""The plan of one launch: :class:`LaunchPlan`, everything the supervisor (:mod:`launcher.supervisor`)
needs to start the segment, the agents and the front door, and the command line and environment of
each child it starts. Built by :func:`launcher.cli.config_from_args` from the flags and the config
file (the file itself is :class:`launcher.config.LaunchConfig`); nothing here touches the host.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dplb_protocol.limits import DRAIN_TIMEOUT_S
from launcher.gpus import GpuPlan
from launcher.specs import WorkerPlan
from launcher.stack import LOOPBACK, agent_argv, router_argv
from worker_agent.restart import RestartParams

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SIM_MODEL = "sim-llama-3.1-8b"  # sim engine's default model name (docs/INTERFACES.md)


@dataclass
class LaunchPlan:
    """Everything one launch needs; built by :func:`launcher.cli.config_from_args`.

    ``time_scale``: passed to sim engines as ``--time-scale`` (None: the engine's default);
    ``engine_args``: extra engine flags given after ``--``; ``latency_window_s``: the config's
    ``routing_policy.latency_window_sec``, passed to every agent; ``engine_urls``: one per worker for
    ``--engine openai``; ``start_timeout_s``: how long every worker has to become ready;
    ``agent_module``/``router_module``: what ``python -m`` runs (the launcher's own tests run
    stand-ins that speak the same CLIs).
    """

    num_workers: int
    plan: GpuPlan
    engine: str
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    config: str | None = None
    state_interval_ms: int = 200
    policy: str | None = None
    #: the policy the router runs (the flag, else the config file, else its default): the banner's
    router_policy: str = "dplb"
    #: the config sets ``router.api_key``: the banner's curl lines send ``$DPLB_API_KEY``
    api_key_set: bool = False
    time_scale: float | None = None
    router_workers: int | None = None
    #: ``--metrics-port``: the router's ``GET /metrics`` on a port of its own too (None: the main port only)
    metrics_port: int | None = None
    log_level: str | None = None
    engine_urls: list[str] = field(default_factory=list)
    engine_args: list[str] = field(default_factory=list)
    run_dir: Path = Path("/tmp/dplb-30000")
    shm_name: str = "dplb-30000"
    num_slots: int = 64
    latency_window_s: float | None = None
    start_timeout_s: float = 120.0
    #: the drain limit: what the agents and the router are told (``--drain-timeout``)
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    python: str = sys.executable
    #: start no router: the agents and the segment only (``--no-router``); routers elsewhere attach to
    #: ``shm_name`` and reach the engines through the run dir's sockets
    with_router: bool = True
    #: where POSIX shared memory lives (the free space :func:`launcher.host.check_shm_space` checks)
    shm_dir: Path = Path("/dev/shm")
    agent_module: str = "worker_agent"  # ``python -m`` module of the agent (tests swap in a fake)
    router_module: str = "router"
    #: every worker's plan (:class:`launcher.specs.WorkerPlan`); empty: one model for all, from
    #: ``plan``/``engine``/``model``/``engine_urls``/``engine_args``
    workers: list[WorkerPlan] = field(default_factory=list)
    #: how a dead agent is restarted (``--agent-restart-*``; the agent's own engine policy's defaults)
    agent_restart: RestartParams = field(default_factory=RestartParams)
    #: what serves ``port``: ``"router"`` (dplb-router) or ``"envoy"`` (Envoy + ``dplb-epp`` over the
    #: segment; the engines listen on loopback TCP, ``--engine-host``, for Envoy's ORIGINAL_DST cluster)
    gateway: str = "router"
    #: ``--gateway envoy``: the picker's ext_proc, gRPC health and /metrics ports, Envoy's admin port
    epp_port: int = 9002
    epp_health_port: int = 9003
    epp_metrics_port: int = 9090
    envoy_admin_port: int = 9901
    #: ``--gateway envoy``: the Envoy executable (:func:`epp.envoy.envoy_binary`)
    envoy_bin: str = "envoy"

    def __post_init__(self) -> None:
        if not self.workers:
            self.workers = [
                WorkerPlan(engine=self.engine, model=self.model, gpus=list(self.plan.groups[k]),
                           tp_size=self.plan.tp_size if self.plan.groups[k] else 1,
                           engine_url=self.engine_urls[k] if self.engine == "openai" else None,
                           engine_args=list(self.engine_args))
                for k in range(self.num_workers)]
        self.num_workers = len(self.workers)

    @property
    def models(self) -> list[str]:
        """The models served, in worker order, each once (the sim default for a sim worker naming none)."""
        out: list[str] = []
        for w in self.workers:
            m = w.model or (DEFAULT_SIM_MODEL if w.engine == "sim" else "")
            if m and m not in out:
                out.append(m)
        return out

    def agent_socket(self, k: int) -> Path:
        """Unix socket worker ``k``'s agent serves on."""
        return self.run_dir / f"agent-{k}.sock"

    def agent_argv(self, k: int) -> list[str]:
        """Command line of worker ``k``'s agent (:func:`launcher.stack.agent_argv`)."""
        w = self.workers[k]
        extra = list(w.engine_args)
        if w.engine == "sim" and self.time_scale is not None:
            extra = ["--time-scale", f"{self.time_scale:g}", *extra]
        return agent_argv(k, self.shm_name, self.agent_socket(k), engine=w.engine, model=w.model,
                          gpus=w.gpus, tp_size=w.tp_size if w.gpus else None, engine_url=w.engine_url,
                          state_interval_ms=self.state_interval_ms, run_dir=self.run_dir,
                          latency_window_s=self.latency_window_s, engine_args=extra, python=self.python,
                          module=self.agent_module,
                          extra=["--drain-timeout", f"{self.drain_timeout_s:g}",
                                 *(["--weight", f"{w.weight:g}"] if w.weight != 1.0 else []),
                                 *(["--engine-host", LOOPBACK] if self.envoy else [])])

    @property
    def envoy(self) -> bool:
        """True for ``--gateway envoy`` (Envoy + ``dplb-epp`` instead of the router)."""
        return self.gateway == "envoy" and self.with_router

    def epp_argv(self) -> list[str]:
        """Command line of ``dplb-epp`` over this launch's segment (``--gateway envoy``); its state
        directory is in the run dir."""
        argv = [self.python, "-m", "epp", "--shm", self.shm_name, "--host", LOOPBACK, "--port", str(self.epp_port),
                "--health-port", str(self.epp_health_port), "--metrics-port", str(self.epp_metrics_port),
                "--state-dir", str(self.run_dir / "epp-state"), "--envoy-eds", str(self.envoy_eds_path)]
        if self.config:
            argv += ["--config", self.config]
        if self.policy:
            argv += ["--policy", self.policy]
        if self.log_level:
            argv += ["--log-level", self.log_level]
        return argv

    @property
    def envoy_config_path(self) -> Path:
        """Where Envoy's bootstrap is written (the run dir)."""
        return self.run_dir / "envoy.yaml"

    @property
    def envoy_eds_path(self) -> Path:
        """The pool cluster's EDS file (:mod:`epp.envoy`), written by the picker (the run dir)."""
        return self.run_dir / "envoy-eds" / "pool.json"

    def envoy_config(self) -> str:
        """Envoy's bootstrap as YAML (:func:`epp.envoy.bootstrap_yaml`): listener on ``host:port``,
        admin on loopback, ext_proc to the picker, the pool cluster on the picker's EDS file
        (fallbacks and retries: a killed engine loses no request), access log in the run dir."""
        from epp.envoy import EnvoySettings, bootstrap_yaml

        return bootstrap_yaml(EnvoySettings(listen_port=self.port, admin_port=self.envoy_admin_port,
                                            epp_port=self.epp_port, host=self.host, epp_host=LOOPBACK,
                                            access_log=str(self.run_dir / "envoy-access.log"),
                                            pool_eds=str(self.envoy_eds_path)))

    def envoy_argv(self) -> list[str]:
        """Command line of Envoy on :attr:`envoy_config_path` (hot restart off: no shared memory;
        one worker thread on a small machine, :func:`epp.envoy.envoy_concurrency`)."""
        from epp.envoy import envoy_concurrency

        argv = [self.envoy_bin, "-c", str(self.envoy_config_path), "--disable-hot-restart", "-l", "warning"]
        n = envoy_concurrency()
        return argv + ["--concurrency", str(n)] if n else argv

    @property
    def envoy_admin_url(self) -> str:
        """Envoy's admin base URL (loopback)."""
        return f"http://{LOOPBACK}:{self.envoy_admin_port}"

    def router_argv(self) -> list[str]:
        """Command line of the router (:func:`launcher.stack.router_argv`)."""
        return router_argv(port=self.port, shm=self.shm_name, host=self.host, config=self.config,
                           policy=self.policy, workers=self.router_workers, log_level=self.log_level,
                           python=self.python, module=self.router_module,
                           extra=["--drain-timeout", f"{self.drain_timeout_s:g}",
                                  *(["--metrics-port", str(self.metrics_port)] if self.metrics_port else [])])

    def child_env(self, k: int | None) -> dict[str, str]:
        """Environment of worker ``k`` (``None``: the router): ours + PYTHONPATH + its GPU group."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        if k is not None:
            cvd = self.workers[k].cuda_visible_devices()
            if cvd is not None:
                env["CUDA_VISIBLE_DEVICES"] = cvd
        return env

    @property
    def url(self) -> str:
        """The router's base URL as a client on this machine reaches it."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else ("[::1]" if self.host == "::" else self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"



def describe_workers(workers: list[WorkerPlan]) -> str:
    """One line of what runs where: per run of workers with the same engine and model, their ids,
    engine, model and GPU groups (tensor parallel size)."""
    parts: list[str] = []
    k = 0
    while k < len(workers):
        w = workers[k]
        j = k
        while j + 1 < len(workers) and (workers[j + 1].engine, workers[j + 1].model) == (w.engine, w.model):
            j += 1
        ids = str(k) if j == k else f"{k}-{j}"
        groups = [x.gpus for x in workers[k:j + 1]]
        gpu = f"GPUs {groups} (tp {w.tp_size})" if any(groups) else "no GPU"
        parts.append(f"worker {ids}: engine {w.engine}{' model ' + w.model if w.model else ''}, {gpu}")
        k = j + 1
    return "; ".join(parts)
