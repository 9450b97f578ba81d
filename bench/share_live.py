"""Live prefix hit rate of picker replicas behind one Envoy: 1 picker, 2 pickers each on its own
view, 2 pickers sharing their load and placements through Redis (``dplb-epp --share-url``,
epp/share.py), on two workloads, one request at a time (so the engine that served each request is
the one whose counters moved):

* ``sessions``: interleaved chat sessions over a long system prompt each; every turn after the
  first should land on the engine holding its history;
* ``shared-prompt``: a few long documents, each asked several questions, interleaved: every
  question after a document's first should land on the engine that holds the document.

Hit rate: the engines' prefix-cache hit tokens / queried prompt tokens (their vLLM counters).
Every configuration starts fresh engines (empty caches), pickers, Envoy and (when sharing) a
redis-server on loopback with no persistence; everything is stopped at the end::

    python -m bench.share_live [--sessions 5 --turns 4 --docs 5 --questions 4 --words 3000 --gap-ms 0]
                               [--runs N] [--only "shared (Redis)" ...]

``--idle-s N`` measures instead what sharing costs while no request comes: the CPU of each of two
pickers and of redis-server over ``N`` seconds (their /proc times), without sharing, with the
pushes and the default poll, and with a poll of ``--idle-interval-ms`` (5: the poll-only design's).
``--busy N`` measures the CPU per request instead: ``N`` short requests from 4 concurrent clients
through two pickers, without and with sharing (each request pushes its dispatch and its end; each
prompt is new, so with lookups on each is a prefix miss that reads Redis once before its pick).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

from epp.envoy import EnvoySettings, bootstrap, envoy_argv
from launcher.stack import ProcessGroup, free_port, wait_for, wait_for_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def metric_sum(text: str, pattern: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{pattern} (\S+)$", text, re.MULTILINE))


class Stack:
    """Two simulated engines, ``pickers`` pickers (``args`` each), one Envoy; a Redis with ``share``."""

    def __init__(self, pickers: int, args: list[str], share: bool, run_dir: str) -> None:
        self.procs = ProcessGroup(grace_s=3.0)
        self.run_dir = run_dir
        self.engines: list[str] = []
        self.pids: dict[str, int] = {}   # "redis", "picker-<i>": process ids (the idle cost)
        try:
            self._start(pickers, args, share)
        except BaseException:
            self.procs.close()
            raise

    def _start(self, n: int, args: list[str], share: bool) -> None:
        d, p = self.run_dir, self.procs
        extra = list(args)
        if share:
            port = free_port()
            self.pids["redis"] = p.start(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                                          "--appendonly", "no", "--dir", d], log=f"{d}/redis.log").popen.pid
            wait_for_port(port, timeout=30)
            extra += ["--share-url", f"redis://127.0.0.1:{port}/0"]
        lines = []
        for i in range(2):
            port = free_port()
            pub, replay = f"ipc://{d}/kv-{i}", f"ipc://{d}/kv-replay-{i}"
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
                   "buffer_steps": 10000}
            p.start([sys.executable, "-m", "sim_engine", "--host", "127.0.0.1", "--port", str(port), "--time-scale", "50",
                     "--model", "sim-model", "--kv-events-config", json.dumps(cfg)], log=f"{d}/engine-{i}.log",
                    cwd=str(ROOT))
            wait_for_port(port, timeout=60)
            self.engines.append(f"127.0.0.1:{port}")
            lines.append(f"- {{address: '127.0.0.1:{port}', model: sim-model, kv_events: '{pub}', "
                         f"kv_events_replay: '{replay}'}}\n")
        eps = Path(d) / "endpoints.yaml"
        eps.write_text("".join(lines))
        ports = []
        for i in range(n):
            port = free_port()
            c = p.start([str(BIN / "dplb-epp"), "--endpoints-file", str(eps), "--policy", "dplb", *extra, "--port",
                         str(port), "--health-port", str(free_port()), "--metrics-port", "0", "--state-dir", f"{d}/state-{i}",
                         "--log-level", "info"], log=f"{d}/epp-{i}.log", cwd=str(ROOT))
            self.pids[f"picker-{i}"] = c.popen.pid
            wait_for_port(port, timeout=60)
            ports.append(port)
        lport, admin = free_port(), free_port()
        boot = bootstrap(EnvoySettings(listen_port=lport, admin_port=admin, epp_port=ports[0]))
        (epp,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == "epp"]  # type: ignore[index,union-attr]
        lb = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
        for port in ports[1:]:
            lb.append({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}})
        (Path(d) / "envoy.yaml").write_text(yaml.safe_dump(boot))
        p.start(envoy_argv(f"{d}/envoy.yaml"), log=f"{d}/envoy.log", cwd=str(ROOT))
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE", 90, "Envoy")
        logs = [Path(d) / f"epp-{i}.log" for i in range(n)]
        wait_for(lambda: all("picker ready" in x.read_text() for x in logs), 60, "pickers ready")
        self.base = f"http://127.0.0.1:{lport}"
        wait_for(lambda: httpx.post(self.base + "/v1/chat/completions", timeout=30, json={
            "model": "sim-model", "max_tokens": 1, "messages": [{"role": "user", "content": "warm up"}]}).status_code
            == 200, 60, "a first answer")

    def counters(self, c: httpx.Client) -> list[tuple[float, float]]:
        out = []
        for addr in self.engines:
            text = c.get(f"http://{addr}/metrics").text
            out.append((metric_sum(text, r"vllm:prefix_cache_queries_total\S*"),
                        metric_sum(text, r"vllm:prefix_cache_hits_total\S*")))
        return out

    def run(self, conversations: list[list[dict[str, str]]], gap_s: float = 0.0) -> dict[str, float]:
        """Send the requests in order, one at a time, ``gap_s`` apart (after each answer); the hit
        rate over them and their number."""
        queried = hit = 0.0
        n = 0
        with httpx.Client(timeout=60) as c:
            base0 = self.counters(c)
            for msgs in conversations:
                r = c.post(self.base + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 4,
                                                                       "messages": msgs})
                r.raise_for_status()
                n += 1
                time.sleep(gap_s)
            after = self.counters(c)
        for (q0, h0), (q1, h1) in zip(base0, after):
            queried, hit = queried + q1 - q0, hit + h1 - h0
        return {"hit_rate": hit / queried if queried else 0.0, "requests": n}

    def cpu(self) -> dict[str, float]:
        """Each of :attr:`pids`' CPU time so far, s (utime + stime from /proc)."""
        out = {}
        for name, pid in self.pids.items():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return out

    def idle_cpu(self, seconds: float) -> dict[str, float]:
        """Each of :attr:`pids`' CPU over ``seconds`` with no request, as a share of one core."""
        time.sleep(3.0)   # past the start and the warm-up request
        c0, t0 = self.cpu(), time.monotonic()
        time.sleep(seconds)
        c1, t1 = self.cpu(), time.monotonic()
        return {k: (c1[k] - c0[k]) / (t1 - t0) for k in c0}

    def busy_cpu(self, n: int, clients: int = 4) -> dict[str, float]:
        """Each of :attr:`pids`' CPU per request, ms, over ``n`` short requests from ``clients``
        concurrent clients (each request a prompt of its own)."""
        from concurrent.futures import ThreadPoolExecutor

        def one(c: httpx.Client, i: int) -> None:
            c.post(self.base + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 2, "messages": [
                {"role": "user", "content": f"request {i} " + " ".join(f"w{j}" for j in range(50))}]}).raise_for_status()

        time.sleep(3.0)
        with ThreadPoolExecutor(clients) as ex, httpx.Client(timeout=60) as c:
            c0 = self.cpu()
            list(ex.map(lambda i: one(c, i), range(n)))
            c1 = self.cpu()
        return {k: 1000.0 * (c1[k] - c0[k]) / n for k in c0}

    def close(self) -> None:
        self.procs.close()


@contextlib.contextmanager
def temp_stack(pickers: int, args: list[str], share: bool) -> Iterator[Stack]:
    """A :class:`Stack` in a fresh run directory under /tmp; closed and the directory removed on exit."""
    d = tempfile.mkdtemp(prefix="dplb-bench-share-", dir="/tmp")
    try:
        st = Stack(pickers, args, share, d)
        try:
            yield st
        finally:
            st.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def session_requests(sessions: int, turns: int, words: int) -> list[list[dict[str, str]]]:
    """Each session's turn t carries the history so far (answers as a fixed text: the engines'
    answers are not needed for the prefix), interleaved across sessions."""
    hist = [[{"role": "system", "content": " ".join(f"s{s}w{j}" for j in range(words))}] for s in range(sessions)]
    out = []
    for t in range(turns):
        for s in range(sessions):
            hist[s].append({"role": "user", "content": " ".join(f"s{s}t{t}u{j}" for j in range(40))})
            out.append(list(hist[s]))
            hist[s].append({"role": "assistant", "content": f"answer {s} {t}"})
    return out


def shared_prompt_requests(docs: int, questions: int, words: int) -> list[list[dict[str, str]]]:
    """``docs`` documents, each asked ``questions`` questions, interleaved."""
    return [[{"role": "system", "content": " ".join(f"d{d}w{j}" for j in range(words))},
             {"role": "user", "content": f"question {q} about document {d}"}]
            for q in range(questions) for d in range(docs)]


CONFIGS = [("1 picker", 1, [], False), ("2 pickers, own views", 2, [], False),
           ("2 pickers, shared (Redis), no lookup on a miss", 2, ["--share-lookup-ms", "0"], True),
           ("2 pickers, shared (Redis)", 2, [], True), ("2 pickers, shared + --kv-events", 2, ["--kv-events"], True)]


def idle(seconds: float, interval_ms: float) -> int:
    """Print the idle CPU table (``--idle-s``)."""
    print("| configuration | picker 0 | picker 1 | redis-server |")
    print("|---|---|---|---|")
    for name, args, share in [("2 pickers, no sharing", [], False), ("2 pickers, shared (pushes, default poll)", [], True),
                              (f"2 pickers, shared, --share-interval-ms {interval_ms:g}",
                               ["--share-interval-ms", str(interval_ms)], True)]:
        with temp_stack(2, args, share) as st:
            c = st.idle_cpu(seconds)
        cell = [f"{100 * c[k]:.1f} %" if k in c else "-" for k in ("picker-0", "picker-1", "redis")]
        print(f"| {name} | " + " | ".join(cell) + " |", flush=True)
    return 0


def busy(n: int) -> int:
    """Print the CPU per request table (``--busy``)."""
    print("| configuration | picker 0, ms/request | picker 1, ms/request | redis-server, ms/request |")
    print("|---|---|---|---|")
    for name, args, share in [("2 pickers, no sharing", [], False),
                              ("2 pickers, shared, no lookup on a miss (--share-lookup-ms 0)", ["--share-lookup-ms", "0"], True),
                              ("2 pickers, shared (every request here is a miss: a lookup each)", [], True)]:
        with temp_stack(2, args, share) as st:
            c = st.busy_cpu(n)
        cell = [f"{c[k]:.2f}" if k in c else "-" for k in ("picker-0", "picker-1", "redis")]
        print(f"| {name} | " + " | ".join(cell) + " |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.share_live", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=5)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--docs", type=int, default=5)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--words", type=int, default=3000)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="pause after each answer before the next request, ms (0: back to back)")
    ap.add_argument("--idle-s", type=float, default=0.0,
                    help="measure the idle CPU of the pickers and Redis over this many seconds instead (0: off)")
    ap.add_argument("--busy", type=int, default=0,
                    help="measure the CPU per request of the pickers and Redis over this many requests instead (0: off)")
    ap.add_argument("--idle-interval-ms", type=float, default=5.0,
                    help="the shorter poll --idle-s measures besides the default (default 5)")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run only the hit-rate configurations whose name contains TEXT (repeatable; default all)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the hit-rate table this many times (default 1)")
    a = ap.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    if a.idle_s > 0:
        return idle(a.idle_s, a.idle_interval_ms)
    if a.busy > 0:
        return busy(a.busy)
    workloads = {"sessions": session_requests(a.sessions, a.turns, a.words),
                 "shared-prompt": shared_prompt_requests(a.docs, a.questions, a.words)}
    print("| run | configuration | " + " | ".join(f"{w} hit rate" for w in workloads) + " |")
    print("|---|---|" + "---|" * len(workloads))
    for run in range(1, a.runs + 1):
        for name, n, args, share in CONFIGS:
            if a.only and not any(t in name for t in a.only):
                continue
            row = []
            for reqs in workloads.values():
                with temp_stack(n, args, share) as st:
                    row.append(st.run(reqs, a.gap_ms / 1000.0)["hit_rate"])
            print(f"| {run} | {name} | " + " | ".join(f"{x:.3f}" for x in row) + " |", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
