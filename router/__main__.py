"""``dplb-router`` / ``python -m router``: the OpenAI-compatible front door (default port 30000).

    dplb-router [--config dplb.yaml] [--host 127.0.0.1] [--port 30000] [--shm NAME] [--policy dplb]
                [--workers K] [--admin-token T] [--api-key KEY] [--log-level warning]
                [--access-log text|json|off] [--drain-timeout 30] [--metrics-port 29000] [--kv-events]

Built-in defaults < the config file < these flags, field by field (the launch script follows the same rule). ``--workers K`` runs K router processes (uvicorn workers) on the
same port; they share one segment, so in-flight counts and circuit states are one truth.
On SIGTERM/SIGINT the router stops accepting connections and keeps relaying the requests in
flight, streams included, until they end, up to ``--drain-timeout`` seconds (the drain limit, the
agents' default: ``dplb_protocol.limits.DRAIN_TIMEOUT_S``; uvicorn's ``timeout_graceful_shutdown``);
a second signal stops it at once. SIGHUP, SIGUSR1 and SIGUSR2 are logged and ignored (with
``--workers`` > 1, SIGHUP to the parent restarts the processes, uvicorn's meaning). Exit status 2
on an invalid config (the message names the field).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

from dplb_protocol.limits import DRAIN_TIMEOUT_S
from router.config import load_config
from router.errors import ConfigError
from router.policies import policy_names


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (every flag defaults to None = "not given, keep the file's value")."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="dplb-router", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="dplb.yaml (see dplb.example.yaml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--shm", help="segment name (default dplb-<port>)")
    p.add_argument("--policy", choices=policy_names())
    p.add_argument("--workers", type=int, help="router processes sharing the segment")
    p.add_argument("--admin-token")
    p.add_argument("--api-key")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", choices=["text", "json", "off"],
                   help="one line per proxied request (default text; router/access_log.py)")
    p.add_argument("--metrics-port", type=int,
                   help="also serve GET /metrics on this port of its own (config metrics.port; like SGLang router's "
                        "--prometheus-port); default: the main port only")
    p.add_argument("--kv-events", action="store_true", default=None,
                   help="route on the engines' KV-cache events (kv_events.enabled; each backend_servers "
                        "entry names its publisher)")
    p.add_argument("--share-url", metavar="URL",
                   help="Redis URL (share.url) the routers on other nodes share their in-flight load per engine and "
                        "their placements through (default: off)")
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="after SIGTERM, seconds the requests in flight may take to finish (default: %(default)g)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags, validate config, serve with uvicorn (uvloop + httptools) until stopped."""
    args = build_parser().parse_args(argv)
    if not args.drain_timeout >= 0:
        print(f"dplb-router: --drain-timeout must be >= 0, got {args.drain_timeout}", file=sys.stderr)
        return 2
    overrides = {"router.host": args.host, "router.port": args.port, "router.shm": args.shm,
                 "routing_policy.policy": args.policy, "router.workers": args.workers,
                 "router.admin_token": args.admin_token, "router.api_key": args.api_key,
                 "router.log_level": args.log_level, "router.access_log": args.access_log,
                 "metrics.port": args.metrics_port, "kv_events.enabled": args.kv_events, "share.url": args.share_url}
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"dplb-router: {e}", file=sys.stderr)
        return 2
    if cfg.admin_exposed():
        print(f"dplb-router: refusing to listen on {cfg.router.host} without router.admin_token: anyone reaching "
              "the port could drain, remove or add workers. Set router.admin_token (dplb-router --admin-token; "
              "with the launcher, in the file given to --config) or listen on "
              "127.0.0.1 (behind a reverse proxy, set the token too: every proxied client looks like loopback)",
              file=sys.stderr)
        return 2
    if cfg.metrics.port is not None:
        from router.metrics_port import reserve

        try:   # held until exit: the router processes bind it with SO_REUSEPORT (router/metrics_port.py)
            _held = reserve(cfg.router.host, cfg.metrics.port)
        except OSError as e:
            print(f"dplb-router: metrics.port {cfg.metrics.port} on {cfg.router.host}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    import uvicorn

    from router.app import configure_logging
    from router.logtext import uvicorn_log_config

    configure_logging(cfg.router.log_level)
    from router.server import ENV_BYTES, ENV_COUNT, LimitedHttpToolsProtocol

    # read by router.server.LimitedHttpToolsProtocol at import in every --workers process
    os.environ[ENV_BYTES] = str(cfg.router.max_header_bytes)
    os.environ[ENV_COUNT] = str(cfg.router.max_headers)
    LimitedHttpToolsProtocol.max_header_bytes = cfg.router.max_header_bytes   # this process imported it already
    LimitedHttpToolsProtocol.max_headers = cfg.router.max_headers
    # Any: uvicorn.run's keyword arguments (str, int, bool, float...), spread into its typed parameters
    common: dict[str, Any] = {"host": cfg.router.host, "port": cfg.router.port, "loop": "uvloop",  # type: ignore[explicit-any]
                              "http": "router.server:LimitedHttpToolsProtocol", "log_level": cfg.router.log_level, "access_log": False,
                              # uvicorn's handlers keep each record on one line too (router.logtext)
                              "log_config": uvicorn_log_config(),
                              "server_header": False, "date_header": False, "timeout_keep_alive": 30, "backlog": 4096,
                              # SIGTERM: stop accepting, relay what is in flight to its end (drain limit)
                              "timeout_graceful_shutdown": args.drain_timeout,
                              # no WebSocket endpoint: a request asking to upgrade is answered over HTTP
                              # (router.server.LimitedHttpToolsProtocol), not handed to a WebSocket handshake
                              "ws": "none",
                              # the router is the edge: no X-Forwarded-* rewriting middleware per request
                              "proxy_headers": False}
    if cfg.router.workers > 1:
        from router.app import CONFIG_ENV

        os.environ[CONFIG_ENV] = cfg.model_dump_json()
        # one /metrics truth across the processes: prometheus_client's multiprocess mode (each
        # process writes its values to files in this directory; /metrics aggregates them)
        prom_dir = tempfile.mkdtemp(prefix="dplb-router-prom-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
        try:
            from router.processes import serve_processes

            serve_processes(uvicorn.Config("router.app:create_app_from_env", factory=True,
                                           workers=cfg.router.workers, **common))
        finally:
            shutil.rmtree(prom_dir, ignore_errors=True)
    else:
        from router.app import create_app
        from router.processes import ignore_undocumented_signals

        ignore_undocumented_signals()   # SIGHUP/SIGUSR1/SIGUSR2: logged, not fatal
        uvicorn.run(create_app(cfg), **common)
    return 0


if __name__ == "__main__":
    sys.exit(main())
