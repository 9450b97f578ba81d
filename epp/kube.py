"""Kubernetes discovery for ``dplb-epp``: an InferencePool and its Ready pods, as scrape endpoints.

``dplb-epp --pool NAME [--namespace NS] [--kubeconfig PATH]`` (no ``--kubeconfig``: the in-cluster
service account) reads the InferencePool ``NAME`` of API ``inference.networking.k8s.io/v1``
(plural ``inferencepools``) and lists + watches the pods its selector matches. Field names, from
the Gateway API Inference Extension's v1 API reference (kubernetes-sigs/gateway-api-inference-extension,
``api/v1`` InferencePoolSpec, ``site-src/reference/spec.md``):

- ``spec.selector.matchLabels``: label → value; a pod belongs to the pool when it has all of them
  (the pods' namespace is the pool's);
- ``spec.targetPorts``: 1 to 8 entries ``{number: PORT}``; each Ready pod IP × each port is one
  endpoint, which is how the data-parallel ranks of one pod appear;
- ``spec.endpointPickerRef.failureMode`` (FailOpen / FailClose) is the gateway's business
  (Envoy's ``failure_mode_allow``), not read here.

A pod is an endpoint when its condition ``Ready`` is ``True``, ``status.podIP`` is set and it has no
``metadata.deletionTimestamp`` (terminating). Its model is the annotation ``dplb.io/model``, else the
label ``dplb.io/model``, else none (any model); its weight the annotation ``dplb.io/weight``
(positive number, default 1). IPv6 pod IPs are written ``[ip]:port``.

The watches (:class:`PoolWatcher`) run in one daemon thread each, never on the gRPC server's event
loop: the pool (``fieldSelector=metadata.name=NAME``) and its pods (``labelSelector`` from
matchLabels). Each lists (a consistent snapshot with its ``metadata.resourceVersion``), then
watches from that resourceVersion (``timeoutSeconds`` ``watch_timeout_s``; a watch that ends is
resumed from the last event's resourceVersion). An ``ERROR`` event or HTTP status 410 Gone (the
resourceVersion is too old, compacted) makes it re-list; the endpoints stay as they were until the
new list replaces them, so nothing leaves for a moment. Every ``resync_s`` it re-lists anyway. A
change of the pool's selector or ports re-selects at once: the pod watch is cut and re-listed with
the new selector. Other errors back off ``backoff_s`` and retry, keeping the last endpoints.

The endpoints (address → ``{"model", "weight"}``, the shape :func:`epp.discovery.load_endpoints`
gives) go into :class:`epp.discovery.ScrapeManager`'s ``wanted`` through :meth:`PoolWatcher.poll`,
called on the health tick like the endpoints file's.

RBAC: ``get``, ``list``, ``watch`` on ``pods`` (core group) and on ``inferencepools`` (group
``inference.networking.k8s.io``) in the pool's namespace.
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

if TYPE_CHECKING:
    from kubernetes.client import ApiClient
    from urllib3 import HTTPResponse

    from router.admin_store import MirrorSpec

log = logging.getLogger("dplb.epp.kube")

# Any: a Kubernetes object as the API server's JSON gives it (a pod, an InferencePool, a watch
# event's object), read with .get() at every level; the one explicit Any of epp/
KubeObject = dict[str, Any]  # type: ignore[explicit-any]
#: a pool's selector and target ports (:func:`pool_spec`)
PoolSpec = tuple[dict[str, str], list[int]]

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
MODEL_KEY, WEIGHT_KEY = "dplb.io/model", "dplb.io/weight"
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class Gone(Exception):
    """The API server answered 410 Gone (or an ERROR event): re-list."""


def pod_ready(pod: KubeObject) -> bool:
    """True for a pod whose condition Ready is True, with a pod IP, not terminating."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def selects(match_labels: dict[str, str], pod: KubeObject) -> bool:
    """True when ``pod``'s labels contain every ``match_labels`` pair (an empty selector selects none,
    so a pool without a selector routes nowhere rather than to every pod of the namespace)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def pool_spec(pool: KubeObject) -> PoolSpec:
    """``(matchLabels, target port numbers)`` of an InferencePool object; raises ValueError for a
    pool without matchLabels or with 0 or more than 8 valid ports."""
    spec = pool.get("spec") or {}
    ml = (spec.get("selector") or {}).get("matchLabels") or {}
    if not isinstance(ml, dict) or not ml:
        raise ValueError("spec.selector.matchLabels is empty")
    ports = []
    for p in spec.get("targetPorts") or []:
        n = p.get("number") if isinstance(p, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and 0 < n < 65536:
            ports.append(n)
    if not 1 <= len(ports) <= 8:
        raise ValueError(f"spec.targetPorts must hold 1 to 8 port numbers, not {spec.get('targetPorts')!r}")
    return {str(k): str(v) for k, v in ml.items()}, ports


def pod_endpoints(pod: KubeObject, ports: list[int]) -> dict[str, MirrorSpec]:
    """The endpoints of one Ready pod: ``ip:port`` for each target port → ``{"model", "weight"}``."""
    meta = pod.get("metadata") or {}
    ann, labels = meta.get("annotations") or {}, meta.get("labels") or {}
    model = ann.get(MODEL_KEY) or labels.get(MODEL_KEY) or ""
    try:
        weight = float(ann.get(WEIGHT_KEY, 1.0))
    except (TypeError, ValueError):
        weight = 1.0
    if not math.isfinite(weight) or weight <= 0:
        weight = 1.0
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    return {f"{host}:{port}": {"model": model, "weight": weight} for port in ports}


def default_namespace(kubeconfig: str | None) -> str:
    """The namespace when ``--namespace`` is not given: the kubeconfig's current context's, in
    cluster the service account's, else ``default``."""
    if kubeconfig:
        from kubernetes import config

        try:
            _, ctx = config.list_kube_config_contexts(kubeconfig)
            return str(ctx.get("context", {}).get("namespace") or "default")
        except Exception:   # noqa: BLE001  (a kubeconfig without contexts: the loader reports it later)
            return "default"
    try:
        return Path(SA_NAMESPACE).read_text().strip() or "default"
    except OSError:
        return "default"


def api_client(kubeconfig: str | None) -> ApiClient:
    """A ``kubernetes.client.ApiClient`` from ``kubeconfig``, or the in-cluster config when None
    (raises ``kubernetes.config.ConfigException`` when neither is usable)."""
    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    cfg = client.Configuration()
    config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)


class PoolWatcher:
    """The endpoints of InferencePool ``pool`` in ``namespace`` (module docstring), kept current by
    two watch threads. ``resync_s``: the period of the full re-list (s); ``watch_timeout_s``: the
    server-side length of one watch (s); ``backoff_s``: the wait after a failed request (s)."""

    def __init__(self, pool: str, namespace: str, api: ApiClient, resync_s: float = 300.0,
                 watch_timeout_s: int = 60, backoff_s: float = 1.0) -> None:
        from kubernetes import client

        self.pool, self.namespace = pool, namespace
        self.core, self.custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.resync_s, self.watch_timeout_s, self.backoff_s = resync_s, watch_timeout_s, backoff_s
        self._lock = threading.Lock()
        self._spec: PoolSpec | None = None
        self._pods: dict[str, KubeObject] = {}
        self._version = 0          # bumped on every change of the endpoints
        self._polled = -1
        self._stop = threading.Event()
        self._reselect = threading.Event()
        self._pod_resp: HTTPResponse | None = None
        self._pool_resp: HTTPResponse | None = None
        self.relists = 0           # pod lists done (tests and logs)
        self._threads = [threading.Thread(target=self._loop, args=(self._pool_round,), daemon=True, name="epp-kube-pool"),
                         threading.Thread(target=self._loop, args=(self._pod_round,), daemon=True, name="epp-kube-pods")]

    # ---- public ----
    def start(self) -> None:
        """Start the watch threads."""
        for t in self._threads:
            t.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the watches (cuts the open streams) and join the threads for up to ``timeout_s``
        each (a watcher never started stops too)."""
        self._stop.set()
        self._cut()
        self._cut(self._pool_resp)
        for t in self._threads:
            if t.ident is not None:
                t.join(timeout_s)

    def endpoints(self) -> dict[str, MirrorSpec]:
        """The current endpoints: address → ``{"model", "weight"}`` (empty without a valid pool)."""
        with self._lock:
            return self._endpoints_locked()

    def poll(self) -> dict[str, MirrorSpec] | None:
        """The endpoints when they changed since the last call, else None (the endpoints file's
        interface)."""
        with self._lock:
            if self._version == self._polled:
                return None
            self._polled = self._version
            return self._endpoints_locked()

    # ---- state ----
    def _endpoints_locked(self) -> dict[str, MirrorSpec]:
        if self._spec is None:
            return {}
        ml, ports = self._spec
        out: dict[str, MirrorSpec] = {}
        for pod in self._pods.values():
            if selects(ml, pod) and pod_ready(pod):
                out.update(pod_endpoints(pod, ports))
        return out

    def _set(self, spec: PoolSpec | None | Literal[False] = False, pods: dict[str, KubeObject] | None = None,
             event: tuple[str, KubeObject] | None = None) -> None:
        with self._lock:
            before = self._endpoints_locked()
            if spec is not False:
                self._spec = spec
            if pods is not None:
                self._pods = pods
            if event is not None:
                kind, pod = event
                name = pod.get("metadata", {}).get("name", "")
                if kind == "DELETED":
                    self._pods.pop(name, None)
                else:
                    self._pods[name] = pod
            after = self._endpoints_locked()
            if after != before:
                self._version += 1
                log.info("pool %s/%s: %d endpoint(s)", self.namespace, self.pool, len(after))

    # ---- the watch loops ----
    def _loop(self, round_fn: Callable[[], None]) -> None:
        while not self._stop.is_set():
            try:
                round_fn()
            except Exception as e:   # noqa: BLE001  (API or connection errors: keep the endpoints, retry)
                if self._stop.is_set():
                    return
                log.warning("pool %s/%s: %s (retrying in %.1fs)", self.namespace, self.pool, e, self.backoff_s)
                self._stop.wait(self.backoff_s)

    def _cut(self, resp: HTTPResponse | None = None) -> None:
        """Shut the open pod watch's connection (or ``resp``'s), ending its blocked read.

        The watch thread may close or release the response at any moment (its stream ended, a
        410, a re-list), and urllib3's ``HTTPResponse.shutdown`` then raises ``ValueError`` (closed:
        no socket to shut) or ``RuntimeError`` (released to the pool): either way no read is
        blocked on it any more, so there is nothing to cut."""
        resp = resp if resp is not None else self._pod_resp
        if resp is not None:
            try:
                resp.shutdown()
            except (OSError, ValueError, RuntimeError):
                log.debug("cutting the watch", exc_info=True)

    def _stream(self, fn: Callable[[str], object], rv: str,
                pods: bool) -> Iterator[tuple[str | None, KubeObject, str]]:
        """Yield ``(type, object, resourceVersion)`` of a watch from ``rv`` (``fn(rv)`` opens it:
        the pods' when ``pods``, else the pool's); raises :class:`Gone`."""
        from kubernetes.client.rest import ApiException
        from kubernetes.watch.watch import iter_resp_lines

        try:
            # with _preload_content=False the client hands over the raw urllib3 response
            resp = cast("HTTPResponse", fn(rv))
        except ApiException as e:
            if e.status == 410:
                raise Gone() from None
            raise
        if pods:
            self._pod_resp = resp
            if self._reselect.is_set():
                self._cut(resp)
        else:
            self._pool_resp = resp
        if self._stop.is_set():
            self._cut(resp)
        try:
            for line in iter_resp_lines(resp):
                if self._stop.is_set():
                    return
                ev = json.loads(line)
                obj = ev.get("object") or {}
                if ev.get("type") == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone()
                    raise RuntimeError(f"watch error: {obj.get('message') or obj}")
                yield ev.get("type"), obj, (obj.get("metadata") or {}).get("resourceVersion") or rv
        except Gone:
            raise
        except Exception:
            if self._stop.is_set() or self._reselect.is_set():
                return          # cut on purpose
            raise
        finally:
            if pods:
                self._pod_resp = None
            else:
                self._pool_resp = None
            resp.release_conn()

    def _pool_round(self) -> None:
        """List the pool, then watch it until the resync is due or the watch is Gone."""
        fsel = f"metadata.name={self.pool}"
        resp = self.custom.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                         field_selector=fsel, _preload_content=False)
        body = json.loads(resp.data)  # type: ignore[attr-defined]  # the raw response
        self._apply_pool(body.get("items") or [])
        rv = body.get("metadata", {}).get("resourceVersion", "")
        deadline = time.monotonic() + self.resync_s

        def watch_pool(rv: str) -> object:
            return self.custom.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, field_selector=fsel, watch=True, resource_version=rv,
                timeout_seconds=self.watch_timeout_s, allow_watch_bookmarks=True, _preload_content=False)

        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                for kind, obj, new_rv in self._stream(watch_pool, rv, pods=False):
                    rv = new_rv
                    if kind == "BOOKMARK":
                        continue
                    self._apply_pool([] if kind == "DELETED" else [obj])
        except Gone:
            log.info("pool %s/%s: watch expired (410 Gone), re-listing", self.namespace, self.pool)

    def _apply_pool(self, items: list[KubeObject]) -> None:
        spec = None
        for it in items:
            if (it.get("metadata") or {}).get("name") == self.pool:
                try:
                    spec = pool_spec(it)
                except ValueError as e:
                    log.warning("InferencePool %s/%s: %s (no endpoints)", self.namespace, self.pool, e)
        if not items:
            log.warning("InferencePool %s/%s not found (no endpoints)", self.namespace, self.pool)
        with self._lock:
            old = self._spec
        if spec != old:
            self._set(spec=spec)
            if spec is None or old is None or spec[0] != old[0]:
                self._reselect.set()
                self._cut()

    def _pod_round(self) -> None:
        """List the selected pods, then watch them until the resync, a Gone, or a new selector."""
        self._reselect.clear()
        with self._lock:
            spec = self._spec
        if spec is None:
            self._set(pods={})
            self._reselect.wait(self.backoff_s)
            return
        lsel = ",".join(f"{k}={v}" for k, v in sorted(spec[0].items()))
        resp = self.core.list_namespaced_pod(self.namespace, label_selector=lsel, _preload_content=False)
        body = json.loads(resp.data)  # type: ignore[attr-defined]  # the raw response
        self.relists += 1
        self._set(pods={(p.get("metadata") or {}).get("name", ""): p for p in body.get("items") or []})
        rv = body.get("metadata", {}).get("resourceVersion", "")
        deadline = time.monotonic() + self.resync_s

        def watch_pods(rv: str) -> object:
            return self.core.list_namespaced_pod(
                self.namespace, label_selector=lsel, watch=True, resource_version=rv,
                timeout_seconds=self.watch_timeout_s, allow_watch_bookmarks=True, _preload_content=False)

        try:
            while not self._stop.is_set() and not self._reselect.is_set() and time.monotonic() < deadline:
                for kind, obj, new_rv in self._stream(watch_pods, rv, pods=True):
                    rv = new_rv
                    if kind in ("ADDED", "MODIFIED", "DELETED"):
                        self._set(event=(kind, obj))
        except Gone:
            log.info("pool %s/%s: pod watch expired (410 Gone), re-listing", self.namespace, self.pool)


__all__ = [
    "GROUP",
    "MODEL_KEY",
    "PLURAL",
    "VERSION",
    "WEIGHT_KEY",
    "PoolWatcher",
    "api_client",
    "default_namespace",
    "pod_endpoints",
    "pod_ready",
    "pool_spec",
    "selects",
]
