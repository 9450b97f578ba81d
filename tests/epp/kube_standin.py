"""A stand-in for the Kubernetes API server (the real one cannot run here): list and watch of pods
and of InferencePools in one namespace, over HTTP on 127.0.0.1.

- ``GET /api/v1/namespaces/NS/pods`` and ``GET /apis/inference.networking.k8s.io/v1/namespaces/NS/inferencepools``
  with ``labelSelector=k=v,...`` / ``fieldSelector=metadata.name=N``: a JSON list whose
  ``metadata.resourceVersion`` is the store's current one;
- with ``watch=true&resourceVersion=RV``: newline-delimited ``{"type", "object"}`` events after RV,
  then new ones as they come, until ``timeoutSeconds``; an RV older than the compaction point gets
  one ``ERROR`` event with a Status of code 410 (as the API server sends), as does every open watch
  when :meth:`KubeStandIn.expire` compacts.
"""
from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
PODS = "/api/v1/namespaces/{ns}/pods"


class KubeStandIn:
    """The store and its server; ``port`` after :meth:`start`. ``requests`` counts list calls per kind."""

    def __init__(self, namespace: str = "default") -> None:
        self.ns = namespace
        self.cond = threading.Condition()
        self.rv = 100
        self.compacted = 0
        self.objs: dict[str, dict[str, dict[str, Any]]] = {"pods": {}, "pools": {}}
        self.log: list[tuple[int, str, str, dict[str, Any]]] = []   # (rv, kind, type, object)
        self.lists = {"pods": 0, "pools": 0}
        self.watches = {"pods": 0, "pools": 0}
        self.httpd: ThreadingHTTPServer | None = None
        self.closing = False

    # ---- store ----
    def put(self, kind: str, obj: dict[str, Any]) -> None:
        """Create or replace ``obj`` (kind "pods" or "pools"), emitting ADDED or MODIFIED."""
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
            name = obj["metadata"]["name"]
            typ = "MODIFIED" if name in self.objs[kind] else "ADDED"
            self.objs[kind][name] = obj
            self.log.append((self.rv, kind, typ, obj))
            self.cond.notify_all()

    def delete(self, kind: str, name: str) -> None:
        """Delete object ``name``, emitting DELETED."""
        with self.cond:
            self.rv += 1
            obj = self.objs[kind].pop(name)
            obj = dict(obj, metadata=dict(obj["metadata"], resourceVersion=str(self.rv)))
            self.log.append((self.rv, kind, "DELETED", obj))
            self.cond.notify_all()

    def expire(self) -> None:
        """Compact the history: every open watch gets 410 and every older resourceVersion is gone."""
        with self.cond:
            self.rv += 1
            self.compacted = self.rv
            self.log.clear()
            self.cond.notify_all()

    # ---- server ----
    def start(self) -> None:
        """Serve on 127.0.0.1 (an ephemeral port) in a daemon thread."""
        standin = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"   # chunked watch streams, as the API server sends them

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                standin.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        assert self.httpd is not None
        return self.httpd.server_address[1]

    def stop(self) -> None:
        """Stop serving; open watches end."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()

    def kubeconfig(self, path: str) -> str:
        """Write a kubeconfig pointing at the stand-in to ``path``; returns ``path``."""
        cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "standin",
               "clusters": [{"name": "standin", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
               "users": [{"name": "u", "user": {"token": "t"}}],
               "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "u", "namespace": self.ns}}]}
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    @staticmethod
    def _match(kind: str, obj: dict[str, Any], q: dict[str, str]) -> bool:
        meta = obj.get("metadata", {})
        for part in filter(None, q.get("labelSelector", "").split(",")):
            k, _, v = part.partition("=")
            if (meta.get("labels") or {}).get(k) != v:
                return False
        fs = q.get("fieldSelector", "")
        return not (fs.startswith("metadata.name=") and meta.get("name") != fs.split("=", 1)[1])

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        u = urlparse(h.path)
        q = {k: v[0] for k, v in parse_qs(u.query).items()}
        kind = {PODS.format(ns=self.ns): "pods", POOLS.format(ns=self.ns): "pools"}.get(u.path)
        if kind is None:
            h.send_response(404)
            h.end_headers()
            return
        if q.get("watch") not in ("true", "1"):
            with self.cond:
                self.lists[kind] += 1
                items = [o for o in self.objs[kind].values() if self._match(kind, o, q)]
                body = json.dumps({"kind": "List", "metadata": {"resourceVersion": str(self.rv)}, "items": items})
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body.encode())))
            h.end_headers()
            h.wfile.write(body.encode())
            return
        self.watches[kind] += 1
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

        def chunk(data: bytes) -> None:
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        since = int(q.get("resourceVersion") or 0)
        end = time.monotonic() + float(q.get("timeoutSeconds") or 30)
        gone_at = self.compacted
        try:
            while True:
                with self.cond:
                    if since < self.compacted or self.compacted != gone_at:
                        ev = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                                          "message": "too old resource version"}}
                        chunk((json.dumps(ev) + "\n").encode())
                        break
                    out = [(rv, t, o) for rv, k, t, o in self.log if k == kind and rv > since and self._match(kind, o, q)]
                    if not out:
                        left = end - time.monotonic()
                        if left <= 0 or self.closing:
                            break
                        self.cond.wait(min(left, 0.5))
                        continue
                for rv, t, o in out:
                    chunk((json.dumps({"type": t, "object": o}) + "\n").encode())
                    since = rv
            h.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return


def pod(name: str, ip: str | None, labels: dict[str, str], ready: bool = True, **meta: Any) -> dict[str, Any]:
    """A pod object: ``ip`` (None: not scheduled yet), condition Ready as ``ready``."""
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels, **meta}, "status": status}


def pool(name: str, labels: dict[str, str], ports: list[int]) -> dict[str, Any]:
    """An InferencePool v1 object."""
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": labels}, "targetPorts": [{"number": p} for p in ports],
                     "endpointPickerRef": {"name": "dplb-epp", "port": {"number": 9002}}}}
