"""What the launcher prints once every worker is ready: the banner (:func:`banner`, one per front
door: the router, Envoy + ``dplb-epp``, or none with ``--no-router``) and the one-line description
of a worker's processes (:func:`describe_slot`)."""
from __future__ import annotations

import shlex
import shutil
import sys
from pathlib import Path

import orjson

from launcher.plan import LaunchPlan
from launcher.stack import LOOPBACK


def describe_slot(s: object) -> str:
    """``agent pid A, engine pid E, model M`` of a slot snapshot (``engine pid -`` when the agent
    spawned no engine: an attached server; ``model -`` when none is known yet)."""
    epid = int(getattr(s, "engine_pid", 0) or 0)
    return (f"agent pid {getattr(s, 'pid', '?')}, engine pid {epid or '-'}, "
            f"model {getattr(s, 'model', '') or '-'}")


def dump_command() -> str:
    """How to run ``dplb-shm-dump`` from this shell: the bare name when it is on PATH, else its path."""
    if shutil.which("dplb-shm-dump"):
        return "dplb-shm-dump"
    sibling = Path(sys.executable).parent / "dplb-shm-dump"
    return str(sibling) if sibling.exists() else f"{sys.executable} -m dplb_shm.dump"


def banner(cfg: LaunchPlan, models: list[str]) -> str:
    """The ready banner of ``cfg`` serving ``models`` (non-empty, the first is the example
    request's): URL, a curl line, the segment dump command, logs, how to stop (with
    ``--no-router``: the segment and the command that starts a router on it)."""
    if not cfg.with_router:
        return _no_router_banner(cfg, models)
    body = orjson.dumps({"model": models[0], "messages": [{"role": "user", "content": "Hello!"}],
                         "max_tokens": 32}).decode()
    if cfg.envoy:
        return _envoy_banner(cfg, models, body)
    return _router_banner(cfg, models, body)


def _engines(cfg: LaunchPlan) -> str:
    return "/".join(sorted({w.engine for w in cfg.workers}))


def _no_router_banner(cfg: LaunchPlan, models: list[str]) -> str:
    return "\n".join([
        "",
        (f"DPLB ready: {cfg.num_workers} worker(s) ({_engines(cfg)}), "
         f"no router (--no-router); segment {cfg.shm_name}"),
        f"  models           {', '.join(models)}",
        (f"  start a router   dplb-router --shm {cfg.shm_name} --port {cfg.port}   (same IPC namespace, "
         f"and {cfg.run_dir} mounted at the same path: the engines' sockets are there)"),
        f"  live state       {dump_command()} --shm {cfg.shm_name}   (add --watch 1 to follow it)",
        f"  logs             {cfg.run_dir}/agent-<k>.log, {cfg.run_dir}/engine-<k>.log",
        "Press Ctrl-C to drain and stop every worker and engine.",
    ])


def _envoy_banner(cfg: LaunchPlan, models: list[str], body: str) -> str:
    return "\n".join([
        "",
        (f"DPLB ready: {cfg.num_workers} worker(s) ({_engines(cfg)}), "
         f"Envoy gateway on {cfg.url} (endpoint picker: dplb-epp on {LOOPBACK}:{cfg.epp_port})"),
        f"  OpenAI base URL  {cfg.url}/v1",
        f"  models           {', '.join(models)}",
        (f"  try              curl -s {cfg.url}/v1/chat/completions -H 'Content-Type: application/json' "
         f"-d {shlex.quote(body)}"),
        f"  live state       {dump_command()} --shm {cfg.shm_name}   (add --watch 1 to follow it)",
        (f"  metrics          http://{LOOPBACK}:{cfg.epp_metrics_port}/metrics (dplb-epp), "
         f"{cfg.envoy_admin_url}/stats/prometheus (Envoy)"),
        (f"  logs             {cfg.run_dir}/envoy.log, {cfg.run_dir}/envoy-access.log, {cfg.run_dir}/epp.log, "
         f"{cfg.run_dir}/agent-<k>.log; Envoy's config: {cfg.envoy_config_path}"),
        "Press Ctrl-C to drain and stop every worker, engine, dplb-epp and Envoy.",
    ])


def _router_banner(cfg: LaunchPlan, models: list[str], body: str) -> str:
    # with router.api_key set the key goes in a header; the banner names a variable, not the key
    key = ' -H "Authorization: Bearer $DPLB_API_KEY"' if cfg.api_key_set else ""
    from router.config import is_loopback

    status_key = key if cfg.api_key_set and not is_loopback(cfg.host) else ""
    return "\n".join([
        "",
        (f"DPLB ready: {cfg.num_workers} worker(s) ({_engines(cfg)}), "
         f"router on {cfg.url}, policy {cfg.policy or cfg.router_policy}"),
        f"  OpenAI base URL  {cfg.url}/v1",
        f"  models           {', '.join(models)}",
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
    ])
