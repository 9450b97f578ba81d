"""A set of simulated engines (``python -m sim_engine``) started with the same flags for everyone.

Every system under test (DPLB and each peer) gets a fresh set, so no system inherits another's
prefix cache. Engines listen on ``127.0.0.1:<free port>``. The engines' own Prometheus counters
(vLLM names, see issue 3) are the ground truth for prefix-cache hit rate and per-worker share:

- ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens; vLLM's meaning)
- ``vllm:request_success_total`` (finished requests, summed over its labels)
- ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (gauges, idle check)
"""
from __future__ import annotations

import sys
import time
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from bench.errors import StartupError
from bench.procs import LOOPBACK, Child, ProcessSet, free_port, wait_until

#: counter samples the harness diffs around every workload
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total",
            "vllm:generation_tokens_total", "vllm:prompt_tokens_total")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class EngineFlags:
    """Flags every engine of a run gets (identical for every system).

    ``time_scale``: ``--time-scale`` (simulated seconds per wall second); ``seed``: base seed
    (engine ``i`` gets ``seed + i``); ``extra``: further ``sim_engine`` flags, verbatim.
    """

    time_scale: float
    seed: int = 1234
    extra: tuple[str, ...] = ("--log-level", "warning")

    def argv(self, i: int) -> list[str]:
        """The flags for engine ``i`` (without host/port and slowdown)."""
        return ["--time-scale", repr(self.time_scale), "--seed", str(self.seed + i), *self.extra]


@dataclass
class EngineSet:
    """``n`` running sim engines; ``urls[i]`` is engine ``i``'s base URL (``http://127.0.0.1:P``)."""

    flags: EngineFlags
    slowdowns: tuple[float, ...]
    urls: list[str] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)

    @property
    def n(self) -> int:
        """Number of engines."""
        return len(self.slowdowns)


def start_engines(procs: ProcessSet, n: int, flags: EngineFlags, slowdowns: tuple[float, ...] | None = None,
                  tag: str = "engine", ready_timeout_s: float = 90.0) -> EngineSet:
    """Start ``n`` engines through ``procs`` and wait until every one answers ``GET /health`` 200.

    ``slowdowns``: per-engine ``--slowdown`` factors (default all 1.0; the flag is only passed
    when != 1). Raises :class:`StartupError` if an engine exits or is not ready in time.
    """
    slow = tuple(slowdowns) if slowdowns is not None else tuple(1.0 for _ in range(n))
    if len(slow) != n:
        raise StartupError("engines", f"{len(slow)} slowdown factors for {n} engines")
    es = EngineSet(flags, slow)
    for i in range(n):
        port = free_port()
        args = [sys.executable, "-m", "sim_engine", "--host", LOOPBACK, "--port", str(port), *flags.argv(i)]
        if slow[i] != 1.0:
            args += ["--slowdown", repr(slow[i])]
        es.children.append(procs.start(args, name=f"{tag}-{i}"))
        es.urls.append(f"http://{LOOPBACK}:{port}")
    for i, url in enumerate(es.urls):
        wait_until(lambda u=url: http_get(u + "/health", 1.0)[0] == 200, ready_timeout_s,
                   f"sim engine {i} at {url}", children=[es.children[i]])
    return es


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """``GET url`` on loopback; returns ``(status, body)``; raises ``OSError`` on connection errors."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def parse_metrics(text: str) -> dict[str, float]:
    """Sum every sample of the :data:`COUNTERS` and :data:`GAUGES` names in a Prometheus text page.

    Labels are summed over (vLLM labels counters by model, engine, finished reason). Names that
    are absent read as 0.0.
    """
    want = set(COUNTERS) | set(GAUGES)
    out = {k: 0.0 for k in want}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[s.name] += float(s.value)
    return out


def scrape(urls: list[str]) -> list[dict[str, float]]:
    """Scrape ``/metrics`` of every engine; one dict per engine (see :func:`parse_metrics`)."""
    res = []
    for u in urls:
        status, body = http_get(u + "/metrics", 5.0)
        if status != 200:
            raise StartupError(u, f"/metrics answered {status}")
        res.append(parse_metrics(body.decode("utf-8", "replace")))
    return res


def wait_idle(urls: list[str], timeout_s: float = 120.0) -> bool:
    """Wait until no engine has running or waiting requests; False if still busy after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            m = scrape(urls)
            if all(x["vllm:num_requests_running"] + x["vllm:num_requests_waiting"] == 0 for x in m):
                return True
        except (OSError, StartupError):
            pass
        time.sleep(0.25)
    return False


def counter_delta(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[dict[str, float]]:
    """Per-engine difference ``after - before`` of the :data:`COUNTERS`."""
    return [{k: a[k] - b[k] for k in COUNTERS} for b, a in zip(before, after)]
