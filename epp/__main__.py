"""``dplb-epp`` / ``python -m epp``: DPLB's router as the endpoint picker of an Envoy gateway.

    dplb-epp --shm dplb-30000                      # the agents' slots of a running DPLB node
    dplb-epp --endpoints-file endpoints.yaml       # engines without agents, in a private segment
    dplb-epp --pool NAME [--namespace NS] [--kubeconfig PATH]   # an InferencePool's Ready pods
    dplb-epp ... --print-envoy-config              # the Envoy bootstrap that routes through it
    dplb-epp --pool NAME --share-url redis://redis:6379/0   # replicas on several nodes, one view

Ports (loopback unless ``--host``): ext_proc 9002, gRPC health 9003, ``/metrics`` 9090 (GIE's
defaults; ``--metrics-port 0`` turns it off). With ``--shm`` the picker shares the node's router
lines, ledger and admin state (``--config``'s ``router.state_dir``, default
``/tmp/dplb-router-<router.port>``), so its accounting and the router's agree. Without it the
picker creates a private segment of ``--slots`` slots, removed at exit, with its state in
``/tmp/dplb-epp-<port>``. Built-in defaults < ``--config`` < flags. Exit status 2 on an invalid
config, endpoints file or flag combination.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import uuid
from typing import TYPE_CHECKING

from router.config import load_config
from router.errors import ConfigError
from router.policies import policy_names

if TYPE_CHECKING:
    from epp.kube import PoolWatcher

BODY_MODES = {"BUFFERED": 2, "FULL_DUPLEX_STREAMED": 4, "STREAMED": 1}
RESPONSE_BODY_MODES = {"STREAMED": 1, "FULL_DUPLEX_STREAMED": 4, "NONE": 0}
#: fallbacks after the pick with --envoy-eds (Envoy's pool cluster tries them on a failed attempt)
DEFAULT_FALLBACKS = 2


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="dplb-epp", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="dplb.yaml (routing policy, health checks, breaker; see dplb.example.yaml)")
    p.add_argument("--shm", help="segment of a running DPLB node (default: a private one)")
    p.add_argument("--endpoints-file", help="YAML list of {address: host:port, model, weight} to scrape")
    k = p.add_argument_group("Kubernetes discovery (epp.kube)")
    k.add_argument("--pool", help="InferencePool (inference.networking.k8s.io/v1) whose Ready pods to scrape")
    k.add_argument("--namespace", help="the pool's namespace (default: the kubeconfig context's, in cluster "
                                       "the service account's, else 'default')")
    k.add_argument("--kubeconfig", help="kubeconfig file (default: the in-cluster service account)")
    k.add_argument("--pool-resync", type=float, default=300.0, help="seconds between full re-lists")
    p.add_argument("--policy", choices=policy_names())
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9002, help="ext_proc gRPC port (0: any free one)")
    p.add_argument("--health-port", type=int, default=9003, help="gRPC health port (0: any free one)")
    p.add_argument("--metrics-port", type=int, default=9090, help="HTTP /metrics port (0: off)")
    p.add_argument("--request-body-mode", choices=sorted(BODY_MODES), default="STREAMED",
                   help="request body mode (--print-envoy-config; assumed when Envoy sends no protocol_config): "
                        "STREAMED (default: the body sent without waiting for the head's answer, which the picker "
                        "gives at the body's end: two exchanges per tiny request instead of four; the engine gets "
                        "the body chunked), BUFFERED (the whole body in one message, the head answered first) or "
                        "FULL_DUPLEX_STREAMED")
    p.add_argument("--response-body-mode", choices=list(RESPONSE_BODY_MODES), default="STREAMED",
                   help="response body mode (--print-envoy-config; assumed when Envoy sends no protocol_config): "
                        "STREAMED (default: the least picker CPU per streamed event that still sees every chunk, "
                        "bench/results/epp_latency.md), FULL_DUPLEX_STREAMED, or NONE (head and end only: no TTFT, "
                        "no token counts)")
    p.add_argument("--observe-response", action="store_true",
                   help="--print-envoy-config: the response side on a second ext_proc filter in Envoy's observability "
                        "mode (epp.observe: Envoy does not hold the answer for the picker; the same accounting; one "
                        "picker replica per Envoy; an aborted answer is counted 502 but not rewritten)")
    p.add_argument("--ext-proc-server", choices=["h2", "grpcio"], default="h2",
                   help="the ext_proc server: h2 (default: the h2 HTTP/2 library on the picker's event loop, epp.h2grpc; "
                        "about half of grpcio's CPU per request, bench/results/gateway.md) or grpcio (grpc.aio)")
    p.add_argument("--envoy-eds", metavar="PATH",
                   help="write the eligible endpoints to this EDS file for Envoy's pool cluster (override_host "
                        "load balancing, retries down the fallbacks: epp.envoy); --print-envoy-config renders it")
    p.add_argument("--fallbacks", type=int,
                   help=f"fallback endpoints after the pick in x-gateway-destination-endpoint (ip:port,ip:port...; "
                        f"default {DEFAULT_FALLBACKS} with --envoy-eds, else 0: Envoy's ORIGINAL_DST cluster reads one)")
    p.add_argument("--slots", type=int, default=64, help="slots of the private segment")
    p.add_argument("--state-dir", help="where the router lines' ledgers, the admin state and the scrape lock live "
                                       "(default: with --shm the node's routers' own, /tmp/dplb-router-<router.port>, "
                                       "so their accounting is shared; else /tmp/dplb-epp-<port>)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    e = p.add_argument_group("the engines' KV-cache events as the prefix index (epp.events)")
    e.add_argument("--kv-events", action="store_true",
                   help="subscribe to the KV-cache events each endpoint's kv_events (endpoints file) names and "
                        "match prompts against the engines' blocks; ready only once every subscriber caught up")
    e.add_argument("--kv-events-block-size", type=int, default=16, help="the engines' block size (default 16)")
    e.add_argument("--kv-events-vocab-size", type=int, default=128_256,
                   help="the (simulated) engines' vocabulary size for their word tokenizer (default 128256)")
    r = p.add_argument_group("replicas on several nodes: load and placements shared through Redis (the config "
                             "file's share section; these flags override it)")
    r.add_argument("--share-url", metavar="URL",
                   help="Redis URL (redis://host:6379/0; rediss:// for TLS) the replicas of this pool share their "
                        "in-flight load per engine and their placements through (default: off, each its own view)")
    r.add_argument("--share-prefix", help="key prefix in Redis: one per pool (default dplb)")
    r.add_argument("--share-interval-ms", type=float,
                   help="how often every replica's load is read besides the pushed changes, ms (default 100)")
    r.add_argument("--share-ttl-s", type=float,
                   help="how long a replica's load outlives its last write (a dead replica's), s (default 2; at "
                        "least 3 x the interval)")
    r.add_argument("--share-push-gap-ms", type=float,
                   help="the shortest time between two pushes of this replica's changes, ms (changes meanwhile go "
                        "together; default 1)")
    r.add_argument("--share-lookup-ms", type=float,
                   help="on a prefix miss, the longest a request waits for one read of the other replicas' pushes "
                        "not arrived yet, ms (0: never waits; default 10)")
    g = p.add_argument_group("Envoy bootstrap (--print-envoy-config)")
    g.add_argument("--print-envoy-config", action="store_true", help="print the Envoy bootstrap and exit")
    g.add_argument("--envoy-port", type=int, default=8081, help="Envoy's listener port")
    g.add_argument("--envoy-admin-port", type=int, default=9901)
    g.add_argument("--failure-mode-allow", action="store_true",
                   help="let requests through when the picker is unreachable (GIE FailOpen)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse flags, build the picker, serve until SIGTERM/SIGINT."""
    args = build_parser().parse_args(argv)
    if args.print_envoy_config:
        from epp.envoy import EnvoySettings, bootstrap_yaml

        sys.stdout.write(bootstrap_yaml(EnvoySettings(
            listen_port=args.envoy_port, admin_port=args.envoy_admin_port, epp_port=args.port, epp_host=args.host,
            failure_mode_allow=args.failure_mode_allow, request_body_mode=args.request_body_mode,
            response_body_mode=args.response_body_mode, pool_eds=args.envoy_eds,
            observe_response=args.observe_response)))
        return 0
    if args.fallbacks is not None and args.fallbacks < 0:
        print("dplb-epp: --fallbacks must be 0 or more", file=sys.stderr)
        return 2
    if not args.shm and not args.endpoints_file and not args.pool:
        print("dplb-epp: nothing to route to: give --shm (a DPLB node's segment), --endpoints-file and/or --pool",
              file=sys.stderr)
        return 2
    if (args.namespace or args.kubeconfig) and not args.pool:
        print("dplb-epp: --namespace and --kubeconfig go with --pool", file=sys.stderr)
        return 2
    if args.kv_events_block_size < 1 or args.kv_events_vocab_size < 1:
        print("dplb-epp: --kv-events-block-size and --kv-events-vocab-size must be positive", file=sys.stderr)
        return 2
    if args.pool_resync <= 0:
        print("dplb-epp: --pool-resync must be positive", file=sys.stderr)
        return 2
    private_dir = args.state_dir or f"/tmp/dplb-epp-{args.port}"
    overrides = {"routing_policy.policy": args.policy, "router.shm": args.shm,
                 "router.state_dir": args.state_dir if args.shm else private_dir,
                 "router.log_level": args.log_level, "share.url": args.share_url, "share.prefix": args.share_prefix,
                 "share.interval_ms": args.share_interval_ms, "share.ttl_s": args.share_ttl_s,
                 "share.push_gap_ms": args.share_push_gap_ms, "share.lookup_ms": args.share_lookup_ms}
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"dplb-epp: {e}", file=sys.stderr)
        return 2
    if cfg.share.url and args.shm:
        print("dplb-epp: share.url (--share-url) goes with a picker's own segment (--endpoints-file or --pool, no "
              "--shm): the router processes of one node already share its segment", file=sys.stderr)
        return 2
    if args.endpoints_file:
        from epp.discovery import EndpointsFileError, load_endpoints

        try:
            load_endpoints(args.endpoints_file)
        except (OSError, EndpointsFileError) as e:
            print(f"dplb-epp: {e}", file=sys.stderr)
            return 2
    kube = None
    if args.pool:
        from epp.kube import PoolWatcher, api_client, default_namespace

        try:
            api = api_client(args.kubeconfig)
        except Exception as e:   # noqa: BLE001  (kubernetes.config.ConfigException, OSError, YAML errors)
            print(f"dplb-epp: Kubernetes client config: {e}", file=sys.stderr)
            return 2
        kube = PoolWatcher(args.pool, args.namespace or default_namespace(args.kubeconfig), api,
                           resync_s=args.pool_resync)
    logging.basicConfig(level=cfg.router.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from router import logtext

    logtext.install()   # every record on one line, whatever a client or an endpoint put in it
    return asyncio.run(_run(args, cfg, kube))


async def _run(args: argparse.Namespace, cfg: object, kube: PoolWatcher | None = None) -> int:
    from dplb_shm import Segment
    from epp.picker import Picker
    from epp.server import serve
    from router.config import Config
    from router.state import remove_state_dir

    assert isinstance(cfg, Config)
    seg = None
    if not args.shm:
        seg = Segment.create(f"dplb-epp-{os.getpid()}-{uuid.uuid4().hex[:6]}", num_slots=args.slots)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    try:
        fallbacks = args.fallbacks if args.fallbacks is not None else DEFAULT_FALLBACKS if args.envoy_eds else 0
        picker = Picker(cfg, seg, args.endpoints_file, kube, fallbacks=fallbacks, eds_path=args.envoy_eds)
        if args.kv_events:
            from epp.events import EventsFeed, WordTokenizer

            picker.events = EventsFeed(args.kv_events_block_size, WordTokenizer(args.kv_events_vocab_size))
        if cfg.share.url:
            from epp.share import PickerShare

            picker.share = PickerShare(picker, cfg.share)
        await serve(picker, args.host, args.port, args.health_port, args.metrics_port or None,
                    BODY_MODES[args.request_body_mode], stop, RESPONSE_BODY_MODES[args.response_body_mode],
                    args.ext_proc_server)
    finally:
        if seg is not None:
            seg.unlink()
            seg.close()
            remove_state_dir(cfg.state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
