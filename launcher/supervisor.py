"""The supervisor behind ``scripts/launch_dplb.sh``: segment, router, N worker agents, one lifetime.

Start-up, in order (each step fails with a :class:`launcher.errors.LaunchError` naming what and
why, after undoing the steps before it):

0. own the run dir and the segment name: an exclusive ``flock`` on ``<run dir>/launch.lock`` and
   on ``$XDG_RUNTIME_DIR`` (else ``/tmp``) ``/dplb-locks/<segment>.lock``, held for the
   launcher's life (removed at its stop; the kernel drops the locks when it dies, kill -9 too). A second launch on
   the same port, run dir or segment (``--host ::1`` beside ``127.0.0.1`` too) is refused
   (exit status 2, naming the owner's pid) and touches nothing of the running stack: cleanup
   undoes only what this launch owns;
1. check the router port is free and the run dir's socket paths fit ``sun_path`` (108 bytes);
2. create the run dir (mode 0700) and drop sockets a previous run left behind;
3. check ``/dev/shm`` has room for the segment (:func:`check_shm_space`: a container's default
   64 MB, or a ``--shm-size`` too small, would otherwise end in SIGBUS on the first write past the
   limit) and create the segment ``dplb-<port>`` (64 slots, replacing a stale one — the port being
   free means no live launch owns it);
4. start the N agents (``python -m worker_agent``, ``CUDA_VISIBLE_DEVICES`` = the worker's GPU
   group) and the router (``python -m router``; not with ``--no-router``: the routers run
   elsewhere, e.g. another container sharing this IPC namespace and run dir), each in its own
   process group, logs in the run dir;
5. wait until every agent's slot is READY and the router answers ``GET /health`` with 200,
   printing progress from the slot states; a child that exits, or a slot that turns DEAD,
   stops the launch with that child's log's last lines;
6. print the ready banner and stay in the foreground.

Ctrl-C, SIGTERM or SIGHUP stop the workers first, while the router still relays: each agent
drains its engine (DRAINING: the router stops sending it requests and answers new ones 503 +
``Retry-After`` once every worker drains; the requests in flight, streams included, run to their
end, up to the drain limit ``--drain-timeout``) and stops it (:meth:`Supervisor.shutdown`); the
launcher waits the drain limit plus :data:`STOP_MARGIN_S` for that before it stops what is left.
Then every child and its descendants are stopped (engines included, see :mod:`launcher.children`),
the segment unlinked and the sockets removed; logs stay in the run dir. A second Ctrl-C kills
everything at once.
After start-up an agent that dies (a non-zero status: killed, crashed) is restarted
(:meth:`Supervisor.agent_died`, :meth:`Supervisor.restart_due_agents`) with the policy the agent
applies to its engine (:class:`worker_agent.restart.RestartPolicy`, ``--agent-restart-*``): its
death is printed on one line (status, when it comes back, then the log's last lines), its slot
marked DEAD at once (reason ``agent_exited``, the last heartbeat kept: routers stop sending to it
before the heartbeat would go stale), and after the backoff a new agent with the same command line
claims the same slot (generation bumped, new pid) and starts a fresh engine — the dead agent's
engine got SIGTERM with its agent (``PR_SET_PDEATHSIG``) and whatever is left of it is stopped
first (:mod:`worker_agent.adapters.base`); one line says so, another when it is READY again. Past
the budget (``--agent-restart-max`` deaths within ``--agent-restart-window``) the slot stays DEAD
(reason ``gave_up``) and the rest of the launch keeps serving. An agent that exits 0 (it was asked
to stop, and released its slot) is not restarted. A router that dies ends the launch with status 1.
Each engine failure and restart an agent records in its slot (``state_reason``,
``last_exit_code``, ``restarts``) is printed (:meth:`Supervisor.report_engines`): the exit code
and when the agent restarts it, each restart, the return to READY, and an agent that gave up
(with the admin call that restarts it).
"""
from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import orjson

from launcher.children import (
    Child,
    become_subreaper,
    reap_orphans,
    start_child,
    stop_tree,
)
from launcher.errors import ChildStartError, LaunchError, StartTimeoutError, UsageError
from launcher.gpus import GpuPlan
from launcher.specs import WorkerPlan
from launcher.stack import LOOPBACK, agent_argv, router_argv
from router.workers import exit_words
from worker_agent.config import DRAIN_TIMEOUT_S, ENGINE_STOP_GRACE_S
from worker_agent.logtail import log_tail
from worker_agent.restart import RestartParams, RestartPolicy

ROOT = Path(__file__).resolve().parent.parent
SUN_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux
#: how long a stop waits for the agents beyond the drain limit (``--drain-timeout``) before it stops
#: the rest: an agent past its drain limit stops its engine (SIGTERM, SIGKILL after
#: ``ENGINE_STOP_GRACE_S``, 15 s), closes its control API (2 s) and exits; 3 s to spare
STOP_MARGIN_S = ENGINE_STOP_GRACE_S + 5.0
DEFAULT_SIM_MODEL = "sim-llama-3.1-8b"  # sim engine's default model name (docs/INTERFACES.md)


@dataclass
class LaunchConfig:
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
    #: where POSIX shared memory lives (the free space :func:`check_shm_space` checks)
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
        """Command line of Envoy on :attr:`envoy_config_path` (hot restart off: no shared memory)."""
        return [self.envoy_bin, "-c", str(self.envoy_config_path), "--disable-hot-restart", "-l", "warning"]

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


class _Stop(Exception):
    """Raised inside the supervisor's loops when a stop signal arrived."""


class Supervisor:
    """Runs one launch (:meth:`run`); the children's commands come from ``cfg``.

    ``out`` receives progress and the banner (default stdout). ``segment_api``: the class whose
    ``create(name, num_slots=, replace=)`` makes the segment (default ``dplb_shm.Segment``).
    """

    def __init__(self, cfg: LaunchConfig, out: TextIO | None = None, segment_api: Any = None) -> None:
        self.cfg = cfg
        self.out = out or sys.stdout
        self._segment_api = segment_api
        self.segment: Any = None
        self.router: Child | None = None   # with --gateway envoy: Envoy, the front door
        self.epp: Child | None = None      # --gateway envoy: dplb-epp, Envoy's endpoint picker
        self.agents: list[Child] = []
        self._stop_sig: int | None = None
        self._reported_dead: set[int] = set()   # pids of children whose exit was reported
        self._engines: dict[int, tuple[str, int, str]] = {}  # worker -> (state, restarts, reason) last seen
        # dead agents (agent_died): worker -> its restart policy, when its restart is due
        # (monotonic s), its agent restarts so far; workers whose new agent is not READY yet; gave up
        self._agent_policy: dict[int, RestartPolicy] = {}
        self._agent_due: dict[int, float] = {}
        self._agent_restarts: dict[int, int] = {}
        self._agent_back: set[int] = set()
        self._agent_gave_up: set[int] = set()
        self._locks: list[TextIO] = []   # open lock files (step 0); empty: this launch owns nothing to clean
        self._tty = hasattr(self.out, "isatty") and self.out.isatty()

    # ----------------------------------------------------------------- public
    def run(self) -> int:
        """Start everything, wait for a stop signal, stop everything; returns the exit status.

        0 after a requested stop once ready, 130 when stopped before ready, 1 when the router
        died; raises :class:`LaunchError` for a failed start (after cleaning up).
        """
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            try:
                self.start()
                self.wait_ready()
            except _Stop:
                self._say(f"\nstopping ({signal.Signals(self._stop_sig or 2).name}) before ready ...")
                return 130
            self.print_banner()
            try:
                return self.serve()
            except _Stop:
                self._say(f"\nstopping ({signal.Signals(self._stop_sig or 2).name}) ...")
                return 0
        finally:
            self.shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def start(self) -> None:
        """Steps 1–4 of the module docstring."""
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        locks = [take_lock(cfg.run_dir / "launch.lock", f"run dir {cfg.run_dir}")]
        try:
            locks.append(take_lock(lock_dir() / f"{cfg.shm_name}.lock", f"segment {cfg.shm_name}"))
        except UsageError:
            release_lock(locks[0])
            raise
        self._locks = locks
        if cfg.with_router:
            check_port_free(cfg.host, cfg.port)
            if cfg.metrics_port:
                check_port_free(cfg.host, cfg.metrics_port)
        longest = cfg.run_dir / f"engine-{cfg.num_workers - 1}.sock"
        if len(os.fsencode(longest)) > SUN_PATH_MAX:
            raise UsageError(f"run dir {cfg.run_dir} is too long for Unix socket paths ({longest} > "
                             f"{SUN_PATH_MAX} bytes); set DPLB_RUN_DIR to a shorter directory")
        prepare_run_dir(cfg.run_dir)
        become_subreaper()
        check_shm_space(cfg.shm_dir, cfg.shm_name, cfg.num_slots)
        seg_cls = self._segment_api or _segment_class()
        self.segment = seg_cls.create(cfg.shm_name, num_slots=cfg.num_slots, replace=True)
        self._say(f"dplb: {cfg.num_workers} worker(s), {describe_workers(cfg.workers)}; segment {cfg.shm_name}; "
                  f"logs in {cfg.run_dir}")
        for k in range(cfg.num_workers):
            self._check_stop()
            self.agents.append(self._start(f"worker {k}", cfg.agent_argv(k), cfg.run_dir / f"agent-{k}.log",
                                           cfg.child_env(k)))
        if cfg.envoy:
            cfg.envoy_config_path.write_text(cfg.envoy_config())
            from epp.envoy import write_eds

            write_eds(str(cfg.envoy_eds_path), [])   # Envoy starts on an empty pool; the picker fills it
            self.epp = self._start("dplb-epp", cfg.epp_argv(), cfg.run_dir / "epp.log", cfg.child_env(None))
            self.router = self._start("envoy", cfg.envoy_argv(), cfg.run_dir / "envoy.log", cfg.child_env(None))
        elif cfg.with_router:
            self.router = self._start("router", cfg.router_argv(), cfg.run_dir / "router.log", cfg.child_env(None))

    def wait_ready(self) -> None:
        """Step 5: poll slots and the router until all are ready; progress on ``out``."""
        cfg = self.cfg
        t0 = time.monotonic()
        last, last_print = "", 0.0
        while True:
            self._check_stop()
            self._check_children(starting=True)
            states = self.slot_states()
            router_ok = self.front_ready() if cfg.with_router else True
            ready = sum(1 for s in states if s == "READY")
            for k, s in enumerate(states):
                if s == "DEAD":  # the agent lives on but its engine died: no point waiting
                    a = self.agents[k]
                    raise ChildStartError(a.name, None, str(a.log_path), self._tail_with_engine(a),
                                          reason="marked its slot DEAD (its engine failed)")
            line = (f"[{time.monotonic() - t0:5.1f}s] workers ready {ready}/{cfg.num_workers}: "
                    + " ".join(f"{k}:{s}" for k, s in enumerate(states))
                    + (f" | {'envoy+epp' if cfg.envoy else 'router'}: {'up' if router_ok else 'starting'}"
                       if cfg.with_router else ""))
            if ready == cfg.num_workers and router_ok:
                self._progress(line, final=True)
                self.report_ready()
                return
            now = time.monotonic()
            # print on every change; on a log (not a TTY) also every 15 s so a long model load shows life
            if line.split("] ", 1)[1] != last.split("] ", 1)[-1] or self._tty or now - last_print >= 15:
                self._progress(line)
                last_print = now
            last = line
            if time.monotonic() - t0 > cfg.start_timeout_s:
                pending = [f"worker {k} ({s})" for k, s in enumerate(states) if s != "READY"]
                if not router_ok:
                    pending += ["envoy", "dplb-epp"] if cfg.envoy else ["router"]
                tails = "\n".join(f"--- last lines of {c.log_path} ---\n{log_tail(c.log_path, 8)}"
                                  for c in self._children() if c.name in {p.split(' (')[0] for p in pending})
                raise StartTimeoutError(cfg.start_timeout_s, pending, tails)
            self._sleep(0.25)

    def front_ready(self) -> bool:
        """The front door answers: the router's ``GET /health`` is 200, or (``--gateway envoy``)
        Envoy's admin ``/ready`` is 200, the picker's ``/metrics`` answers and Envoy's pool cluster
        holds every worker (the picker writes the EDS file on its own health tick and Envoy loads it
        after that: until both happened a request is answered 503 although every slot is READY)."""
        cfg = self.cfg
        if cfg.envoy:
            from epp.envoy import POOL_CLUSTER

            return (http_ok(cfg.envoy_admin_url + "/ready")
                    and http_ok(f"http://{LOOPBACK}:{cfg.epp_metrics_port}/metrics")
                    and envoy_cluster_hosts(cfg.envoy_admin_url, POOL_CLUSTER) >= cfg.num_workers)
        return http_ok(cfg.url + "/health")

    def serve(self) -> int:
        """Step 6: stay in the foreground until a stop signal (returns 0) or the router dies (1)."""
        while True:
            self._check_stop()
            rc = self._check_children(starting=False)
            if rc is not None:
                return rc
            self.restart_due_agents()
            self.report_engines()
            self._sleep(0.5)

    def report_ready(self) -> None:
        """One line per worker once all are ready: its agent's and engine's pids and its model
        (:func:`describe_slot`), so an operator signals the process they mean."""
        try:
            snaps = self.segment.snapshot()
        except Exception:  # noqa: BLE001 - the lines are a courtesy; a torn read must not stop the launch
            return
        for k in range(min(self.cfg.num_workers, len(snaps))):
            self._say(f"dplb: worker {k}: READY, {describe_slot(snaps[k])}")

    def report_engines(self) -> None:
        """Print what changed in the workers' engines since the last call (from the slots): an
        engine that died (exit code, restart delay, log), each restart, READY again, gave up."""
        try:
            snaps = self.segment.snapshot()
        except Exception:  # noqa: BLE001 - a torn read is retried on the next call
            return
        now = _now_ns()
        for k in range(min(self.cfg.num_workers, len(snaps))):
            if k in self._agent_due or k in self._agent_gave_up:
                continue   # no agent runs: its slot is the launcher's (agent_died)
            s = snaps[k]
            state = getattr(getattr(s, "state", None), "name", "?")
            restarts = int(getattr(s, "restarts", 0) or 0)
            reason = getattr(getattr(s, "state_reason", None), "name", "NONE")
            cur = (state, restarts, reason)
            prev = self._engines.get(k)
            self._engines[k] = cur
            if k in self._agent_back and state == "READY":
                self._agent_back.discard(k)
                self._say(f"dplb: worker {k}: READY again after agent restart {self._agent_restarts.get(k, 0)}, "
                          f"{describe_slot(s)}")
            if prev is None or prev == cur:
                continue
            log = self.cfg.run_dir / f"engine-{k}.log"
            if restarts > prev[1]:
                # seen late, the slot may already be READY (reason none): the cause was the last one seen
                why = reason if reason != "NONE" else (prev[2] if prev[2] != "NONE" else "ENGINE_EXITED")
                self._say(f"dplb: worker {k}: engine restart {restarts} ({why.lower()})")
            if reason == "GAVE_UP" and prev[2] != "GAVE_UP":
                self._say(f"dplb: worker {k}: engine failed too often (last exit code {s.last_exit_code}); it stays "
                          f"DEAD until `curl -X POST {self.cfg.url}/dplb/workers/{k}/restart`; see {log}")
            elif state == "DEAD" and (prev[0] != "DEAD" or restarts > prev[1]):
                nxt = int(getattr(s, "next_restart_ns", 0) or 0)
                when = f"in {max(0.0, (nxt - now) / 1e9):.1f}s" if nxt else "after a backoff"
                self._say(f"dplb: worker {k}: engine {exit_words(int(s.last_exit_code))} ({reason.lower()}); "
                          f"its agent restarts it {when}; see {log}")
            elif state == "READY" and prev[0] != "READY" and restarts:
                self._say(f"dplb: worker {k}: READY again after engine restart {restarts}, {describe_slot(s)}")

    def shutdown(self) -> None:
        """Drain and stop the workers (:meth:`drain_workers`), then stop every child tree, unlink the
        segment, remove sockets. Safe to call twice. A launch that owns nothing (refused at step 0:
        another launch runs on this run dir or segment) leaves everything as it is."""
        if not self._locks:
            return
        children = self._children()
        if children:
            self.drain_workers(self.cfg.drain_timeout_s + STOP_MARGIN_S)
            stop_tree(children, grace_s=10.0)
        self.agents, self.router, self.epp = [], None, None
        if self.segment is not None:
            seg, self.segment = self.segment, None
            for fn in (seg.close, seg.unlink):
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - cleanup must go on; report it
                    self._say(f"dplb: segment cleanup: {type(e).__name__}: {e}")
            if os.path.exists(f"/dev/shm/{self.cfg.shm_name}"):
                try:
                    os.unlink(f"/dev/shm/{self.cfg.shm_name}")
                except OSError:
                    pass
        remove_sockets(self.cfg.run_dir)
        locks, self._locks = self._locks, []
        for f in locks:
            release_lock(f)
        front = (" and Envoy and dplb-epp" if self.cfg.envoy else " and the router") if self.cfg.with_router else ""
        self._say(f"dplb: stopped (workers, engines{front} stopped, segment {self.cfg.shm_name} removed)")

    def drain_workers(self, timeout_s: float = DRAIN_TIMEOUT_S + STOP_MARGIN_S) -> None:
        """SIGTERM to the agents alone, while the router still runs, and wait up to ``timeout_s``
        (the drain limit + :data:`STOP_MARGIN_S`) for them to exit: each marks its slot DRAINING
        (the router stops sending it requests), waits until the router's in-flight count for it is
        0 and stays so, or its drain limit has passed, and stops its engine. Stopping everything at
        once instead made each engine abort what it was generating (a stream ended with
        ``finish_reason: "abort"``). Skipped when our router is gone: nothing is in flight through
        it (with ``--no-router`` the routers are elsewhere and may still relay: always drained). A
        second Ctrl-C (:meth:`_on_signal`) kills everything at once."""
        router = self.router
        agents = [a for a in self.agents if a.poll() is None]
        if not agents:
            return
        if self.cfg.with_router and (router is None or router.poll() is not None):
            return
        if self.cfg.envoy and (self.epp is None or self.epp.poll() is not None):
            return   # no picker: Envoy routes nothing, nothing is in flight
        for a in agents:
            try:
                os.kill(a.pid, signal.SIGTERM)
            except OSError:
                pass
        start = time.monotonic()
        told = False
        while any(a.poll() is None for a in agents) and time.monotonic() - start < timeout_s:
            if not told and time.monotonic() - start > 1.0:
                told = True
                limit = timeout_s - STOP_MARGIN_S
                self._say(f"dplb: waiting for the workers to drain their requests and stop (drain limit {limit:g} s, "
                          f"--drain-timeout; up to {timeout_s:g} s in all; Ctrl-C again to stop at once)")
            time.sleep(0.05)

    def slot_states(self) -> list[str]:
        """State name of each worker's slot (``"-"`` before the agent claims it)."""
        try:
            snaps = self.segment.snapshot()
        except Exception:  # noqa: BLE001 - a torn read while starting is not fatal
            return ["?"] * self.cfg.num_workers
        out = []
        for k in range(self.cfg.num_workers):
            s = snaps[k] if k < len(snaps) else None
            name = getattr(getattr(s, "state", None), "name", None) or "-"
            out.append("-" if name == "EMPTY" else name)
        return out

    def served_models(self) -> list[str]:
        """Model names the workers serve (from their slots, in worker order), else the planned ones."""
        out: list[str] = []
        for k in range(self.cfg.num_workers):
            try:
                m = str(self.segment.read_slot(k).model or "")
            except Exception:  # noqa: BLE001 - the banner must not fail over a torn read
                m = ""
            if m and m not in out:
                out.append(m)
        return out or self.cfg.models or [DEFAULT_SIM_MODEL]

    def served_model(self) -> str:
        """The first model served (the banner's example request)."""
        return self.served_models()[0]

    def print_banner(self) -> None:
        """The ready banner: URL, a curl line, the segment dump command, logs, how to stop (with
        ``--no-router``: the segment and the command that starts a router on it)."""
        cfg = self.cfg
        if not cfg.with_router:
            lines = [
                "",
                (f"DPLB ready: {cfg.num_workers} worker(s) ({'/'.join(sorted({w.engine for w in cfg.workers}))}), "
                 f"no router (--no-router); segment {cfg.shm_name}"),
                f"  models           {', '.join(self.served_models())}",
                (f"  start a router   dplb-router --shm {cfg.shm_name} --port {cfg.port}   (same IPC namespace, "
                 f"and {cfg.run_dir} mounted at the same path: the engines' sockets are there)"),
                f"  live state       {dump_command()} --shm {cfg.shm_name}   (add --watch 1 to follow it)",
                f"  logs             {cfg.run_dir}/agent-<k>.log, {cfg.run_dir}/engine-<k>.log",
                "Press Ctrl-C to drain and stop every worker and engine.",
            ]
            self._say("\n".join(lines))
            return
        body = orjson.dumps({"model": self.served_model(), "messages": [{"role": "user", "content": "Hello!"}],
                             "max_tokens": 32}).decode()
        if cfg.envoy:
            self._say("\n".join([
                "",
                (f"DPLB ready: {cfg.num_workers} worker(s) ({'/'.join(sorted({w.engine for w in cfg.workers}))}), "
                 f"Envoy gateway on {cfg.url} (endpoint picker: dplb-epp on {LOOPBACK}:{cfg.epp_port})"),
                f"  OpenAI base URL  {cfg.url}/v1",
                f"  models           {', '.join(self.served_models())}",
                (f"  try              curl -s {cfg.url}/v1/chat/completions -H 'Content-Type: application/json' "
                 f"-d {shlex.quote(body)}"),
                f"  live state       {dump_command()} --shm {cfg.shm_name}   (add --watch 1 to follow it)",
                (f"  metrics          http://{LOOPBACK}:{cfg.epp_metrics_port}/metrics (dplb-epp), "
                 f"{cfg.envoy_admin_url}/stats/prometheus (Envoy)"),
                (f"  logs             {cfg.run_dir}/envoy.log, {cfg.run_dir}/envoy-access.log, {cfg.run_dir}/epp.log, "
                 f"{cfg.run_dir}/agent-<k>.log; Envoy's config: {cfg.envoy_config_path}"),
                "Press Ctrl-C to drain and stop every worker, engine, dplb-epp and Envoy.",
            ]))
            return
        # with router.api_key set the key goes in a header; the banner names a variable, not the key
        key = ' -H "Authorization: Bearer $DPLB_API_KEY"' if cfg.api_key_set else ""
        from router.config import is_loopback

        status_key = key if cfg.api_key_set and not is_loopback(cfg.host) else ""
        lines = [
            "",
            (f"DPLB ready: {cfg.num_workers} worker(s) ({'/'.join(sorted({w.engine for w in cfg.workers}))}), "
            f"router on {cfg.url}, policy {cfg.policy or cfg.router_policy}"),
            f"  OpenAI base URL  {cfg.url}/v1",
            f"  models           {', '.join(self.served_models())}",
            (f"  try              curl -s {cfg.url}/v1/chat/completions -H 'Content-Type: application/json'{key} "
             f"-d {shlex.quote(body)}"),
            *(["  API key          router.api_key is set: export DPLB_API_KEY=<the key> for the curl lines"]
              if cfg.api_key_set else []),
            f"  live state       {dump_command()} --shm {cfg.shm_name}   (add --watch 1 to follow it)",
            f"  router status    curl -s{status_key} {cfg.url}/dplb/status",
            (f"  metrics          {cfg.url}/metrics (router and workers), {cfg.url}/dplb/prometheus/targets "
            "(engines, Prometheus http_sd)"),
            *([f"                   also http://{cfg.host}:{cfg.metrics_port}/metrics (--metrics-port)"]
              if cfg.metrics_port else []),
            f"  logs             {cfg.run_dir}/router.log, {cfg.run_dir}/agent-<k>.log",
            "Press Ctrl-C to stop every worker, engine and the router.",
        ]
        self._say("\n".join(lines))

    # ---------------------------------------------------------------- helpers
    def _start(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> Child:
        try:
            return start_child(name, argv, log, env)
        except OSError as e:
            raise ChildStartError(name, None, str(log), "", reason=f"could not be started ({e})") from None

    def _tail_with_engine(self, c: Child) -> str:
        """Last lines of ``c``'s log, plus its engine's log (``engine-K.log``) for a worker."""
        text = log_tail(c.log_path, 20)
        if c in self.agents:
            eng = self.cfg.run_dir / f"engine-{self.agents.index(c)}.log"
            tail = log_tail(eng, 15)
            if tail:
                text += f"\n--- last lines of {eng} ---\n{tail}"
        return text

    def _children(self) -> list[Child]:
        return [*([self.router] if self.router else []), *([self.epp] if self.epp else []), *self.agents]

    def _check_children(self, starting: bool) -> int | None:
        reap_orphans({c.pid for c in self._children()})
        for c in self._children():
            rc = c.poll()
            if rc is None:
                continue
            if starting:
                raise ChildStartError(c.name, rc, str(c.log_path), self._tail_with_engine(c))
            if c.pid in self._reported_dead:
                continue
            self._reported_dead.add(c.pid)
            if c is self.router or c is self.epp:
                self._say(f"dplb: {c.name} {exit_words(rc)}; last lines of {c.log_path}:\n"
                          + log_tail(c.log_path, 10))
                self._say(f"dplb: the {'gateway' if self.cfg.envoy else 'router'} is gone; stopping")
                return 1
            self.agent_died(self.agents.index(c), rc)
        if self.agents and all(a.poll() is not None for a in self.agents) and not self._agent_due:
            self._say("dplb: every worker is gone; stopping")
            return 1
        return None

    # ------------------------------------------------------------ dead agents
    def agent_died(self, k: int, rc: int) -> None:
        """Worker ``k``'s agent exited with status ``rc`` after start-up: print it on one line (with
        its log's last lines), mark its slot DEAD and schedule its restart after the backoff of
        its :class:`RestartPolicy`, or give up past ``--agent-restart-max`` (module docstring)."""
        c = self.agents[k]
        tail = log_tail(c.log_path, 10)
        if rc == 0:
            self._say(f"dplb: {c.name} exited with status 0 (it was stopped and released its slot); not "
                      f"restarted; last lines of {c.log_path}:\n{tail}")
            return
        p = self.cfg.agent_restart
        policy = self._agent_policy.setdefault(k, RestartPolicy.from_params(p))
        delay = policy.failure()
        if delay is None:
            self._agent_gave_up.add(k)
            self._mark_slot_dead(k, rc, "GAVE_UP", 0)
            self._say(f"dplb: {c.name} {exit_words(rc)}; its agent died {policy.failures_in_window()} times "
                      f"within {p.window_s:g}s (--agent-restart-max {p.max_restarts}): not restarted again, its "
                      f"slot stays DEAD until the launch restarts; last lines of {c.log_path}:\n{tail}")
            return
        self._agent_due[k] = time.monotonic() + delay
        self._mark_slot_dead(k, rc, "AGENT_EXITED", _now_ns() + int(delay * 1e9))
        self._say(f"dplb: {c.name} {exit_words(rc)}; restarting its agent in {delay:.1f}s (restart "
                  f"{policy.failures_in_window()} of at most {p.max_restarts} within {p.window_s:g}s); "
                  f"last lines of {c.log_path}:\n{tail}")

    def restart_due_agents(self) -> None:
        """Start a new agent for every worker whose restart backoff has passed (same command line,
        same slot, same log appended to); one line each."""
        now = time.monotonic()
        for k, due in sorted(self._agent_due.items()):
            if now < due:
                continue
            del self._agent_due[k]
            n = self._agent_restarts[k] = self._agent_restarts.get(k, 0) + 1
            try:
                self.agents[k] = self._start(f"worker {k}", self.cfg.agent_argv(k), self.cfg.run_dir / f"agent-{k}.log",
                                             self.cfg.child_env(k))
            except LaunchError as e:
                self._say(f"dplb: worker {k}: agent restart {n} failed: {e}")
                self._agent_gave_up.add(k)
                continue
            self._engines.pop(k, None)
            self._agent_back.add(k)
            self._say(f"dplb: worker {k}: agent restarted (restart {n}, pid {self.agents[k].pid}); it claims slot "
                      f"{k} again and starts a fresh engine")

    def _mark_slot_dead(self, k: int, rc: int, reason: str, next_restart_ns: int) -> None:
        """Write DEAD into worker ``k``'s slot for its dead agent (the launcher is the slot's only
        writer until a new agent claims it): ``reason`` (a ``StateReason`` name), the agent's exit
        status, nothing running, the last heartbeat kept (its age stays true)."""
        try:
            from dplb_shm import StateReason, WorkerState

            hb = int(self.segment.read_slot(k).heartbeat_ns)
            self.segment.writer(k).publish(state=WorkerState.DEAD, state_reason=StateReason[reason],
                                           last_exit_code=int(rc), next_restart_ns=next_restart_ns,
                                           num_running=0, num_waiting=0, kv_cache_usage=-1.0,
                                           **({"heartbeat_ns": hb} if hb > 0 else {}))
        except Exception as e:  # noqa: BLE001 - a fake segment, or a closed one: the restart goes on
            self._say(f"dplb: worker {k}: could not mark its slot DEAD ({type(e).__name__}: {e})")

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._stop_sig is None:
            self._stop_sig = signum
        else:  # a second Ctrl-C: no more patience for graceful engine shutdown
            for c in self._children():
                try:
                    os.killpg(c.pid, signal.SIGKILL)
                except OSError:
                    pass

    def _check_stop(self) -> None:
        if self._stop_sig is not None:
            raise _Stop()

    def _sleep(self, s: float) -> None:
        """Sleep ``s`` seconds in steps of at most 50 ms, returning early on a stop signal."""
        end = time.monotonic() + s
        while self._stop_sig is None:
            left = end - time.monotonic()   # read the clock once: a second read may already be past ``end``
            if left <= 0:
                return
            time.sleep(min(0.05, left))

    def _progress(self, line: str, final: bool = False) -> None:
        if self._tty:
            self.out.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()


def describe_slot(s: Any) -> str:
    """``agent pid A, engine pid E, model M`` of a slot snapshot (``engine pid -`` when the agent
    spawned no engine: an attached server; ``model -`` when none is known yet)."""
    epid = int(getattr(s, "engine_pid", 0) or 0)
    return (f"agent pid {getattr(s, 'pid', '?')}, engine pid {epid or '-'}, "
            f"model {getattr(s, 'model', '') or '-'}")


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


def _now_ns() -> int:
    """CLOCK_MONOTONIC in ns (the slots' clock)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def dump_command() -> str:
    """How to run ``dplb-shm-dump`` from this shell: the bare name when it is on PATH, else its path."""
    if shutil.which("dplb-shm-dump"):
        return "dplb-shm-dump"
    sibling = Path(sys.executable).parent / "dplb-shm-dump"
    return str(sibling) if sibling.exists() else f"{sys.executable} -m dplb_shm.dump"


def _segment_class() -> Any:
    try:
        from dplb_shm import Segment
    except ImportError as e:
        raise LaunchError(f"cannot import the segment library dplb_shm ({e}); run `make install`") from None
    return Segment


def lock_dir() -> Path:
    """Where the segment-name locks live: ``$XDG_RUNTIME_DIR/dplb-locks``, else ``/tmp/dplb-locks``."""
    return Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp") / "dplb-locks"


def take_lock(path: Path, what: str) -> TextIO:
    """Take an exclusive, non-blocking ``flock`` on ``path`` (created, parents too) and write this
    pid into it; returns the open file, which holds the lock until closed or the process exits
    (the descriptor is not inherited by children). Raises :class:`UsageError` naming ``what`` and
    the holder's pid when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        f = open(path, "a+")  # noqa: SIM115 - held open for the launcher's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            pid = f.read().strip() or "unknown"
            f.close()
            raise UsageError(f"{what} belongs to a running DPLB launch (pid {pid}); stop it first, or start "
                             f"this one on another --port (and --run-dir)") from None
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()   # its owner unlinked it on the way out (release_lock) before we locked: open it anew
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def release_lock(f: TextIO) -> None:
    """Unlink a lock file :func:`take_lock` returned, then close it (unlinked while still held, so
    a launch that opened it meanwhile sees it gone and opens the path afresh)."""
    try:
        os.unlink(f.name)
    except OSError:
        pass
    f.close()


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`UsageError` when ``host:port`` cannot be bound (another router runs there)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise UsageError(f"port {port} on {host} is not free ({e.strerror}); is another DPLB running? "
                             f"Choose another with --port") from None


def segment_bytes(num_slots: int) -> int:
    """Size in bytes of a segment of ``num_slots`` slots: the 128-byte header plus 1,536 bytes per
    slot (``DPLB_HEADER_SIZE + num_slots * DPLB_SLOT_SIZE``, csrc/dplb_shm.h; 98,432 B for 64)."""
    from dplb_shm.layout import HEADER_SIZE, SLOT_SIZE

    return HEADER_SIZE + num_slots * SLOT_SIZE


def check_shm_space(shm_dir: Path, name: str, num_slots: int) -> None:
    """Raise :class:`UsageError` when ``shm_dir`` (``/dev/shm``) has less free space than the segment
    ``name`` of ``num_slots`` slots needs (:func:`segment_bytes`), counting the space of a stale
    segment of the same name that the launch replaces. The message names ``--shm-size``.

    Why before creating it: tmpfs accepts an ``ftruncate`` past its limit (the file is sparse), and
    the first write to a page beyond it kills the writer with SIGBUS, an error that names nothing.
    A container's ``/dev/shm`` is 64 MB unless ``--shm-size`` says otherwise, and the engines
    (NCCL, PyTorch's worker processes) share it. Nothing is checked when ``shm_dir`` cannot be
    read (no ``/dev/shm``: creating the segment then fails with its own error)."""
    need = segment_bytes(num_slots)
    try:
        st = os.statvfs(shm_dir)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    try:
        free += os.stat(shm_dir / name).st_blocks * 512   # the stale segment we unlink first
    except OSError:
        pass
    if free >= need:
        return
    total = st.f_blocks * st.f_frsize
    raise UsageError(
        f"{shm_dir} has {_kib(free)} free of {_kib(total)}, but the segment {name} needs {_kib(need)} "
        f"({num_slots} slots x 1536 B + 128 B header); give the container a larger /dev/shm: "
        f"docker/podman run --shm-size=1g (compose: shm_size: 1g; the engines use /dev/shm too), "
        f"or free space in {shm_dir}")


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1048576:.1f} MiB"


def prepare_run_dir(path: Path) -> None:
    """Create ``path`` (mode 0700) and remove stale ``*.sock`` files; logs are kept and appended to."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    remove_sockets(path)


def remove_sockets(path: Path) -> None:
    """Delete every ``*.sock`` in ``path`` (sockets of this launch's agents and engines)."""
    try:
        for p in path.glob("*.sock"):
            try:
                p.unlink()
            except OSError:
                pass
    except OSError:
        pass


def envoy_cluster_hosts(admin_url: str, cluster: str, timeout_s: float = 1.0) -> int:
    """How many hosts Envoy's cluster ``cluster`` holds now, from the admin API's
    ``GET /clusters?format=json`` (``cluster_statuses[].host_statuses[]``); 0 when the admin API
    does not answer, answers something else, or has no such cluster. Never raises."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(admin_url + "/clusters?format=json", timeout=timeout_s) as r:
            doc = orjson.loads(r.read())
        for c in doc.get("cluster_statuses") or []:
            if c.get("name") == cluster:
                return len(c.get("host_statuses") or [])
    except (urllib.error.URLError, OSError, ValueError, AttributeError, TypeError):
        pass
    return 0


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """True when ``GET url`` answers 200 (no proxy, loopback only in practice)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False

