"""Command line of ``dplb-worker-agent`` and the validated :class:`AgentConfig` it produces.

``dplb-worker-agent --worker-id K --shm NAME --uds PATH --engine {sim,vllm,sglang,openai}
[--model M] [--gpus 0,1] [--tp-size N] [--engine-url URL] [--engine-host H] [--control-port P
[--control-host H]] [--state-interval-ms 200] [--run-dir DIR] [-- extra engine args...]``
(docs/INTERFACES.md).

Everything after a bare ``--`` goes to the engine unchanged.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from dplb_protocol.limits import DRAIN_TIMEOUT_S

from .engines import ENGINE_NAMES
from .errors import ConfigError
from .restart import DEFAULTS as RESTART
from .restart import add_restart_flags, restart_params

ENGINES = ENGINE_NAMES  # the table's (worker_agent/engines.py)

#: vLLM's and SGLang's default cap on concurrently running sequences (vLLM ``--max-num-seqs``
#: default 256 for the OpenAI server on GPUs; SGLang derives ``max_running_requests`` from memory)
DEFAULT_MAX_NUM_SEQS = 256

#: How long the agent gives its stopped engine after SIGTERM before SIGKILL (the adapters' ``stop``).
ENGINE_STOP_GRACE_S = 15.0


@dataclass
class AgentConfig:
    """Everything the agent was told on its command line, validated.

    Attributes (units in names): ``worker_id`` slot index; ``shm`` segment name (no leading
    slash); ``uds`` the Unix socket the agent's control API listens on (the slot's ``control``
    address; requests go to the engine, whose address is the slot's ``endpoint``);
    ``engine`` adapter name; ``model`` model path/name (``None``: the engine's default, asked from
    ``/v1/models``); ``gpus`` physical GPU indices; ``tp_size`` tensor-parallel size (default: number
    of GPUs, at least 1); ``engine_url`` base URL for ``openai``; ``engine_host``: make a spawned
    engine listen on TCP on this host (a free port) instead of its private Unix socket (a remote
    node's engine, reached by other nodes' routers; None = the engine's default: a Unix socket for
    sim and vllm, loopback TCP for sglang); ``control_port``/``control_host``: also serve the
    control API on TCP (how a remote node's routers mirror this agent; 0 = Unix socket only);
    ``state_interval_ms`` period of the engine/NVML/heartbeat refresh;
    ``max_num_seqs`` engine batch cap published in the slot; ``run_dir`` for engine sockets and
    logs; ``engine_python`` interpreter that runs the engine; ``engine_start_timeout_s``,
    ``drain_timeout_s`` bounds of start-up and drain; ``weight`` static slot weight;
    ``latency_window_s`` age beyond which latency samples leave the slot's windows (docs/DESIGN.md
    ``routing_policy.latency_window_sec``, 10); ``engine_args`` passed through verbatim.

    Engine restarts (a crashed engine, or one that failed to become ready, is started again):
    ``restart_max`` failures are restarted within any ``restart_window_s`` seconds (0: never
    restart); one more and the slot stays DEAD (reason ``gave_up``) until an admin restart. The
    n-th failure in the window waits ``min(restart_backoff_max_s, restart_backoff_s * 2**(n-1))``
    seconds before the restart.
    """

    worker_id: int
    shm: str
    uds: str
    engine: str = "sim"
    model: str | None = None
    gpus: list[int] = field(default_factory=list)
    tp_size: int = 1
    engine_url: str | None = None
    engine_host: str | None = None
    control_port: int = 0
    control_host: str = "127.0.0.1"
    state_interval_ms: int = 200
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    run_dir: str = ""
    engine_python: str = sys.executable
    engine_start_timeout_s: float = 900.0
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    weight: float = 1.0
    latency_window_s: float = 10.0
    restart_max: int = RESTART.max_restarts
    restart_window_s: float = RESTART.window_s
    restart_backoff_s: float = RESTART.backoff_s
    restart_backoff_max_s: float = RESTART.backoff_max_s
    log_level: str = "info"
    engine_args: list[str] = field(default_factory=list)

    @property
    def state_interval_s(self) -> float:
        """The state interval in seconds."""
        return self.state_interval_ms / 1000.0


def _gpu_list(s: str) -> list[int]:
    s = s.strip()
    if not s:
        return []
    try:
        ids = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError("--gpus", s, "expected comma-separated GPU indices like 0,1") from e
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError("--gpus", s, "GPU indices must be distinct and non-negative")
    return ids


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (without the pass-through part after ``--``)."""
    p = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="dplb-worker-agent",
        description="DPLB worker agent: keeps one inference engine on one GPU (group): starts and warms "
                    "it up, scrapes its metrics, restarts it, drains it, and publishes its address and live "
                    "state in the shared segment (routers forward requests to the engine directly). "
                    "Arguments after a bare -- are passed to the engine.")
    p.add_argument("--worker-id", type=int, required=True, help="slot index in the segment (0..slots-1)")
    p.add_argument("--shm", default=os.environ.get("DPLB_SHM", "dplb-30000"),
                   help="segment name without leading slash (default: dplb-30000)")
    p.add_argument("--uds", required=True,
                   help="Unix socket of the agent's control API (/health, /dplb/state, /dplb/restart; mode 0660)")
    p.add_argument("--engine", choices=ENGINES, default="sim", help="engine adapter (default: sim)")
    p.add_argument("--model", default=None, help="model path or name given to the engine")
    p.add_argument("--gpus", default="", help="physical GPU indices, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)")
    p.add_argument("--tp-size", type=int, default=0, help="tensor-parallel size (default: number of GPUs)")
    p.add_argument("--engine-url", default=None,
                   help="attach to a running OpenAI-compatible server (openai): its root, "
                        "http(s)://host:port or unix:/path (requests keep their /v1/... paths)")
    p.add_argument("--engine-host", default=None,
                   help="spawned engine listens on TCP on this host (free port) instead of its Unix socket: "
                        "a remote node's engine that other nodes' routers forward to (e.g. 0.0.0.0), or a vLLM before "
                        "0.10.1, which has no --uds (127.0.0.1)")
    p.add_argument("--control-port", type=int, default=0,
                   help="also serve the control API on TCP at this port (remote routers mirror the agent "
                        "through it; default: 0 = Unix socket only)")
    p.add_argument("--control-host", default="127.0.0.1",
                   help="host of --control-port (default: 127.0.0.1)")
    p.add_argument("--state-interval-ms", type=int, default=200,
                   help="period of engine metrics, NVML and heartbeat refresh (default: 200)")
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="engine batch cap published in the slot (default: the engine's "
                        "--max-num-seqs/--max-running-requests from the pass-through args, else 256)")
    p.add_argument("--run-dir", default=None, help="directory for engine sockets and logs (default: dir of --uds)")
    p.add_argument("--engine-python", default=os.environ.get("DPLB_ENGINE_PYTHON", sys.executable),
                   help="Python interpreter that runs the engine (default: $DPLB_ENGINE_PYTHON or this one)")
    p.add_argument("--engine-start-timeout", type=float, default=900.0,
                   help="seconds to wait for the engine to become ready (default: 900)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help=f"the drain limit: seconds the requests in flight may take to finish after SIGTERM "
                        f"before the engine is stopped anyway (default: {DRAIN_TIMEOUT_S:g})")
    p.add_argument("--weight", type=float, default=1.0, help="static weight written into the slot (default: 1.0)")
    p.add_argument("--latency-window-s", type=float, default=10.0,
                   help="latency samples older than this leave the slot's TTFT/TPOT/e2e windows "
                        "(default: 10; 0 = the last 32 samples whatever their age)")
    add_restart_flags(p, "", "engine failure",
                      "engine failures restarted within --restart-window; one more leaves the worker DEAD until "
                      f"an admin restart (default: {RESTART.max_restarts}; 0 = never restart)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def _flag_value(args: list[str], *names: str) -> str | None:
    """Value of ``--name V`` or ``--name=V`` in a pass-through argument list (last one wins)."""
    found = None
    for i, a in enumerate(args):
        for n in names:
            if a == n and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(n + "="):
                found = a.split("=", 1)[1]
    return found


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    """Parse and validate a command line into an :class:`AgentConfig`.

    Raises:
        SystemExit: on unknown flags or ``--help`` (argparse's behaviour).
        ConfigError: on values that parse but make no sense (names the flag and the value).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ns = build_parser().parse_args(argv)
    gpus = _gpu_list(ns.gpus)
    if ns.worker_id < 0:
        raise ConfigError("--worker-id", ns.worker_id, "must be >= 0")
    if ns.state_interval_ms < 10:
        raise ConfigError("--state-interval-ms", ns.state_interval_ms, "must be >= 10")
    if ns.latency_window_s < 0:
        raise ConfigError("--latency-window-s", ns.latency_window_s, "must be >= 0")
    try:
        restart = restart_params(ns, "")
    except ValueError as e:
        raise ConfigError(*e.args) from None
    if not 0 <= ns.control_port < 65536:
        raise ConfigError("--control-port", ns.control_port, "must be a TCP port (0 = none)")
    tp = ns.tp_size or max(1, len(gpus))
    if tp < 1:
        raise ConfigError("--tp-size", ns.tp_size, "must be >= 1")
    if gpus and tp > len(gpus):
        raise ConfigError("--tp-size", tp, f"larger than the {len(gpus)} GPUs given in --gpus")
    if ns.engine == "openai" and not ns.engine_url:
        raise ConfigError("--engine-url", None, "required with --engine openai")
    if ns.engine_url and not ns.engine_url.startswith(("http://", "unix:")):
        raise ConfigError("--engine-url", ns.engine_url, "must start with http:// or unix: (routers forward "
                          "plain HTTP straight to the engine)")
    if len(os.fsencode(ns.uds)) > 107:
        raise ConfigError("--uds", ns.uds, "Unix socket paths must be shorter than 108 bytes")
    max_num_seqs = ns.max_num_seqs
    if not max_num_seqs:
        v = _flag_value(extra, "--max-num-seqs", "--max-running-requests")
        try:
            max_num_seqs = int(v) if v else DEFAULT_MAX_NUM_SEQS
        except ValueError as e:
            raise ConfigError("--max-num-seqs", v, "expected an integer") from e
    run_dir = ns.run_dir or os.path.dirname(os.path.abspath(ns.uds))
    return AgentConfig(
        worker_id=ns.worker_id, shm=ns.shm.lstrip("/"), uds=os.path.abspath(ns.uds), engine=ns.engine,
        model=ns.model, gpus=gpus, tp_size=tp, engine_url=ns.engine_url, engine_host=ns.engine_host,
        control_port=ns.control_port, control_host=ns.control_host,
        state_interval_ms=ns.state_interval_ms, max_num_seqs=max_num_seqs,
        run_dir=run_dir, engine_python=ns.engine_python, engine_start_timeout_s=ns.engine_start_timeout,
        drain_timeout_s=ns.drain_timeout, weight=ns.weight, latency_window_s=ns.latency_window_s,
        restart_max=restart.max_restarts, restart_window_s=restart.window_s, restart_backoff_s=restart.backoff_s,
        restart_backoff_max_s=restart.backoff_max_s,
        log_level=ns.log_level, engine_args=extra,
    )
