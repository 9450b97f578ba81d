"""Does the router's TTFT histogram agree with what clients measure? (issue 16)

``python -m bench.ttft_check [--workers 4] [--limit 200] [--replay-time-scale 1] [--engine-time-scale 1]``

Launches ``scripts/launch_dplb.sh`` with simulated engines (loopback, a private run dir and
segment, stopped with Ctrl-C semantics at the end), replays the first ``--limit`` requests of the
Mooncake conversation trace as streamed chat with :mod:`bench.replay` (the official ``openai``
client; TTFT = send to the first chunk that carries text), and compares the client's TTFTs with
the router's ``dplb_router_time_to_first_token_seconds`` histogram for the same requests (deltas
of ``/metrics`` before and after): means exactly, quantiles the way ``histogram_quantile``
interpolates buckets. Prints one JSON document (``--json-out`` writes it too).

What the two clocks cannot share: the router starts at the request's arrival and stops when the
first content chunk reaches it; the client also counts building and sending the request and
reading the chunk. On a box whose CPUs are saturated (client, router, agents and engines on two
cores) that remainder grows with the load; engines at real speed (``--engine-time-scale 1``) and
the trace's own pace keep it a few percent of the TTFT.

The same run also reads the other places a TTFT is shown (issue 32: under ``--time-scale 10`` the
dump and ``/dplb/status`` once showed ten times the client's): the engines' own histogram
(``vllm:time_to_first_token_seconds`` through ``/dplb/workers/<id>/metrics``, deltas: exact over
the run), and, sampled every second during the replay, each slot's ``ttft_ms`` (the agent's
window of the engine's recent TTFTs) as ``/dplb/status`` and the segment (what ``dplb-shm-dump``
prints) give it, and the routers' per-worker EWMA ``dplb_worker_recent_ttft_seconds``; the
sampled ones are averaged over samples and workers (``*_window_mean_ms``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from launcher.stack import ROOT, free_port, http_json, wait_for

ROUTE = "/v1/chat/completions"
FAMILY = "dplb_router_time_to_first_token_seconds"


def ttft_histogram(text: str, route: str | None = ROUTE, family: str = FAMILY) -> dict[str, Any]:
    """``{"count", "sum", "buckets": [(le, cumulative count)]}`` of the router's TTFT for ``route``
    (None: any), summed over the other labels (``model``); ``family``: another histogram, e.g.
    the engine's ``vllm:time_to_first_token_seconds``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"count": 0.0, "sum": 0.0, "buckets": []}
    buckets: dict[float, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith(family) or (route is not None and s.labels.get("route") != route):
                continue
            if s.name.endswith("_count"):
                out["count"] += s.value
            elif s.name.endswith("_sum"):
                out["sum"] += s.value
            elif s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    out["buckets"] = sorted(buckets.items())
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """``after − before`` of two :func:`ttft_histogram` readings."""
    prev = dict(before["buckets"])
    return {"count": after["count"] - before["count"], "sum": after["sum"] - before["sum"],
            "buckets": [(le, c - prev.get(le, 0.0)) for le, c in after["buckets"]]}


def bucket_quantile(phi: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: linear interpolation inside the bucket holding rank φ·n."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = phi * buckets[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_c) / max(1e-12, c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


def compare(router: dict[str, Any], client_ttft_ms: dict[str, Any]) -> dict[str, Any]:
    """The report: router vs client mean and p50/p90/p99 (ms) and the relative differences (%)."""
    n = router["count"]
    res: dict[str, Any] = {"router_requests": n, "router_mean_ms": round(router["sum"] / n * 1e3, 1) if n else None,
                           "client_mean_ms": client_ttft_ms.get("mean")}
    for q in (50, 90, 99):
        v = bucket_quantile(q / 100, router["buckets"])
        res[f"router_p{q}_ms"] = None if v is None else round(v * 1e3, 1)
        res[f"client_p{q}_ms"] = client_ttft_ms.get(f"p{q}")
    for k in ("mean", "p50", "p90", "p99"):
        r, c = res.get(f"router_{k}_ms"), res.get(f"client_{k}_ms")
        res[f"{k}_diff_pct"] = round((r - c) / c * 100, 2) if r is not None and c else None
    return res


ENGINE_FAMILY = "vllm:time_to_first_token_seconds"


def engine_ttft(base: str, workers: int) -> dict[str, Any]:
    """The engines' own TTFT histograms (``/dplb/workers/<id>/metrics`` on the router), summed."""
    import httpx

    total: dict[str, Any] = {"count": 0.0, "sum": 0.0, "buckets": []}
    for k in range(workers):
        h = ttft_histogram(httpx.get(f"{base}/dplb/workers/{k}/metrics", timeout=10).text, None, ENGINE_FAMILY)
        total["count"] += h["count"]
        total["sum"] += h["sum"]
    return total


class Sampler:
    """Every ``every_s`` seconds until stopped: each worker's TTFT as ``/dplb/status``
    (``latency_ms.ttft``), the segment (``ttft_ms``, the dump's column) and ``/metrics``
    (``dplb_worker_recent_ttft_seconds``) show it; positive values only (ms)."""

    def __init__(self, base: str, shm: str, every_s: float = 1.0) -> None:
        import threading

        self.base, self.shm, self.every_s = base, shm, every_s
        self.values: dict[str, list[float]] = {"status": [], "dump": [], "router_ewma": []}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        from dplb_shm import Segment

        seg = Segment.attach(self.shm)
        try:
            while not self.stop.wait(self.every_s):
                rows = httpx.get(self.base + "/dplb/status", timeout=10).json()["workers"]
                page = httpx.get(self.base + "/metrics", timeout=10).text
                ewma = {smp.labels.get("worker"): smp.value for fam in text_string_to_metric_families(page)
                        for smp in fam.samples if smp.name == "dplb_worker_recent_ttft_seconds"}
                for w in rows:
                    v = (w.get("latency_ms") or {}).get("ttft")
                    if v and v > 0:
                        self.values["status"].append(float(v))
                    snap = seg.read_slot(int(w["id"]))
                    if snap is not None and snap.ttft_ms > 0:
                        self.values["dump"].append(float(snap.ttft_ms))
                    r = ewma.get(str(w["id"]))
                    if r:
                        self.values["router_ewma"].append(r * 1e3)
        finally:
            seg.close()

    def means(self) -> dict[str, Any]:
        """``<source>_window_mean_ms`` and ``<source>_samples`` per source."""
        out: dict[str, Any] = {}
        for k, v in self.values.items():
            out[f"{k}_window_mean_ms"] = round(sum(v) / len(v), 1) if v else None
            out[f"{k}_samples"] = len(v)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ttft_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--limit", type=int, default=200, help="trace requests to replay")
    p.add_argument("--replay-time-scale", type=float, default=1.0, help="bench.replay --time-scale (1 = trace pace)")
    p.add_argument("--engine-time-scale", type=float, default=1.0, help="sim engines' --time-scale (1 = real speed)")
    p.add_argument("--json-out", default=None)
    a = p.parse_args(argv)
    port = free_port()
    d = Path(tempfile.mkdtemp(prefix="dplb-ttft-", dir="/tmp"))
    out = d / "launch.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "launch_dplb.sh"), "--num-workers", str(a.workers),
                                 "--port", str(port), "--run-dir", str(d / "rd"), "--time-scale",
                                 f"{a.engine_time_scale:g}", "--start-timeout", "300"],
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                env={**os.environ, "DPLB_PYTHON": sys.executable})
    try:
        wait_for(lambda: "DPLB ready" in out.read_text(errors="replace") or proc.poll() is not None, 360,
                 "the launch's ready banner")
        if proc.poll() is not None:
            sys.stderr.write(out.read_text(errors="replace")[-3000:])
            return 1
        base = f"http://127.0.0.1:{port}"
        http_json(base + "/dplb/status")
        import httpx

        before = ttft_histogram(httpx.get(base + "/metrics", timeout=10).text)
        engines_before = engine_ttft(base, a.workers)
        sampler = Sampler(base, f"dplb-{port}")
        sampler.thread.start()
        rep = d / "replay.json"
        cp = subprocess.run([sys.executable, "-m", "bench.replay", "--url", base + "/v1", "--limit", str(a.limit),
                             "--time-scale", f"{a.replay_time_scale:g}", "--json-out", str(rep)],
                            capture_output=True, text=True, cwd=ROOT, check=False)
        sys.stderr.write(cp.stdout)
        sampler.stop.set()
        sampler.thread.join(30)
        after = ttft_histogram(httpx.get(base + "/metrics", timeout=10).text)
        engines = delta(engine_ttft(base, a.workers), engines_before)
        client = json.loads(rep.read_text())
        res = {"workers": a.workers, "limit": a.limit, "replay_time_scale": a.replay_time_scale,
               "engine_time_scale": a.engine_time_scale, "completed": client["completed"],
               **compare(delta(after, before), client["ttft_ms"]),
               "engine_requests": engines["count"],
               "engine_mean_ms": round(engines["sum"] / engines["count"] * 1e3, 1) if engines["count"] else None,
               **sampler.means()}
        c_mean = client["ttft_ms"].get("mean")
        for k in ("engine_mean_ms", "status_window_mean_ms", "dump_window_mean_ms", "router_ewma_window_mean_ms"):
            v = res.get(k)
            res[k.replace("_ms", "_vs_client_pct")] = round((v - c_mean) / c_mean * 100, 2) if v and c_mean else None
        text = json.dumps(res, indent=2)
        print(text)
        if a.json_out:
            Path(a.json_out).write_text(text + "\n")
        return 0 if client["completed"] == a.limit else 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
