"""Router overhead: added latency (p50/p99) of routed vs direct-to-worker requests, and the
requests/s one router process sustains. ``python -m bench.router_overhead [--policy dplb] ...``

Setup (everything on loopback, cleaned up on exit):

* an *instant worker*: a minimal asyncio HTTP/1.1 server on a Unix socket that claims slot 0 of a
  fresh segment, publishes READY with its socket as endpoint, heartbeats, and answers every POST
  with a fixed ~300-byte chat completion (the role nginx plays in the field's measurements, see
  ``docs/peers-and-engines.md``);
* one router process (``python -m router``) in front of it, optionally pinned to one core.

Latency: ``--requests`` sequential requests over one keep-alive connection, with the same raw
socket client, first straight to the worker's socket, then to the router's TCP port (interleaved in
rounds so machine noise hits both alike). Added latency = routed percentile − direct percentile.

Throughput: ``--conns`` keep-alive connections in a closed loop for ``--seconds``; reports the
measured req/s (bounded by whatever the 2-core machine has left for client and worker) and the
router's CPU seconds per request (psutil), hence req/s per fully used router core.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from launcher.stack import agent_argv, free_port, router_argv

BODY = (b'{"model":"bench","messages":[{"role":"user","content":"Say hello in one word, please."}],'
        b'"max_tokens":8}')
RESP_BODY = (b'{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,'
             b'"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,'
             b'"completion_tokens":1,"total_tokens":10}}')
RESP = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: " + str(len(RESP_BODY)).encode()
        + b"\r\n\r\n" + RESP_BODY)


def _fixed(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


# GET answers an attached agent's engine adapter may ask for (readiness, model list, metrics)
GET_ANSWERS = {b"/v1/models": _fixed(b'{"object":"list","data":[{"id":"bench","object":"model"}]}'),
               b"/metrics": _fixed(b"", b"text/plain; version=0.0.4"),
               b"/health": _fixed(b"")}


# ------------------------------------------------------------------------------ instant worker


class _Instant(asyncio.Protocol):
    """HTTP/1.1 keep-alive server answering RESP to each request (GET /health included)."""

    def connection_made(self, transport):  # type: ignore[override]
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            n = 0
            i = head.find(b"content-length:")
            if i >= 0:
                n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
            if len(self.buf) < end + 4 + n:
                return
            self.buf = self.buf[end + 4 + n:]
            if head.startswith(b"get "):
                path = head[4:head.find(b" ", 4)].split(b"?", 1)[0]
                self.t.write(GET_ANSWERS.get(path, GET_ANSWERS[b"/health"]))
            else:
                self.t.write(RESP)


def serve_worker(shm: str, sock: str) -> None:
    """Run the instant worker in this process (``--serve-worker``) until killed. ``shm`` "-": a
    bare engine (no slot; a worker agent attaches to it), else it claims slot 0 like an agent."""
    import uvloop

    from dplb_shm import Segment, WorkerState

    w = None
    if shm != "-":
        seg = Segment.attach(shm)
        w = seg.writer(0)
        w.claim(worker_id=0, pid=os.getpid(), endpoint=sock, model="bench", max_num_seqs=256)

    async def main() -> None:
        srv = await asyncio.get_running_loop().create_unix_server(_Instant, sock)
        if w is not None:
            w.set_state(WorkerState.READY)
        async with srv:
            while True:
                await asyncio.sleep(0.1)
                if w is not None:
                    w.heartbeat()

    uvloop.run(main())


# -------------------------------------------------------------------------------------- client


def _request(host_header: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host_header + b"\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)


def _read_response(s: socket.socket, buf: bytearray) -> None:
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = bytes(buf[:end]).lower()
            i = head.find(b"content-length:")
            j = head.find(b"\r\n", i)
            n = int(head[i + 15:j if j > 0 else None])
            if len(buf) >= end + 4 + n:
                del buf[:end + 4 + n]
                return
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk


def sequential(connect, n: int) -> list[float]:
    """``n`` sequential requests on one keep-alive connection; per-request latency in ms."""
    s = connect()
    req = _request(b"bench")
    buf = bytearray()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(req)
            _read_response(s, buf)
            out.append((time.perf_counter() - t0) * 1000.0)
    finally:
        s.close()
    return out


def closed_loop(port: int, conns: int, seconds: float) -> int:
    """``conns`` threads, each a keep-alive connection in a closed loop; total completed requests."""
    stop = time.monotonic() + seconds
    counts = [0] * conns
    req = _request(b"bench")

    def run(k: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        try:
            while time.monotonic() < stop:
                s.sendall(req)
                _read_response(s, buf)
                counts[k] += 1
        finally:
            s.close()

    ts = [threading.Thread(target=run, args=(k,)) for k in range(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts)


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(p / 100.0 * len(ys) + 0.5) - 1))]


# ---------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print the figures (see module docstring)."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="python -m bench.router_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="dplb")
    ap.add_argument("--requests", type=int, default=3000, help="sequential requests per path (latency)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--pin", type=int, default=0, help="pin the router to this CPU (-1: no pinning)")
    ap.add_argument("--shm", help="segment name to create (default: a fresh dplb-bench-<hex>)")
    ap.add_argument("--through-agent", action="store_true",
                    help="put a real worker agent (--engine openai) between router and instant engine: "
                         "measures router + agent hop together against the engine alone")
    ap.add_argument("--serve-worker", nargs=2, metavar=("SHM", "SOCK"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_worker:
        serve_worker(*a.serve_worker)
        return 0

    import psutil

    from dplb_shm import Segment

    shm = a.shm or f"dplb-bench-{uuid.uuid4().hex[:8]}"
    d = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
    sock = os.path.join(d, "w0.sock")
    seg = Segment.create(shm, num_slots=8)
    children: list[subprocess.Popen] = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        children.append(subprocess.Popen([sys.executable, "-m", "bench.router_overhead", "--serve-worker",
                                          "-" if a.through_agent else shm, sock], cwd=root, start_new_session=True))
        if a.through_agent:
            t_end = time.monotonic() + 20
            while not os.path.exists(sock) and time.monotonic() < t_end:
                time.sleep(0.05)
            children.append(subprocess.Popen(
                agent_argv(0, shm, os.path.join(d, "agent-0.sock"), engine="openai", engine_url=f"unix:{sock}",
                           model="bench", run_dir=d), cwd=root, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        port = free_port()
        rcmd = router_argv(port=port, shm=shm, policy=a.policy, log_level="warning")
        if a.pin >= 0:
            rcmd = ["taskset", "-c", str(a.pin)] + rcmd
        children.append(subprocess.Popen(rcmd, cwd=root, start_new_session=True, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL))
        router_pid = children[-1].pid

        def direct() -> socket.socket:
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            return s

        def routed() -> socket.socket:
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s

        import urllib.error
        import urllib.request

        deadline = time.monotonic() + 60
        while True:  # until the router has a ready worker (GET /health → 200)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("router or worker did not come up")
            time.sleep(0.2)
        sequential(direct, 500)
        sequential(routed, 500)   # warm-up: pools, caches, JIT-free but allocator warm
        dl: list[float] = []
        rl: list[float] = []
        for _ in range(a.rounds):
            dl += sequential(direct, a.requests // a.rounds)
            rl += sequential(routed, a.requests // a.rounds)
        proc = psutil.Process(router_pid)  # taskset execs the router in place: same pid
        c0 = sum(proc.cpu_times()[:2])
        t0 = time.perf_counter()
        n = closed_loop(port, a.conns, a.seconds)
        wall = time.perf_counter() - t0
        cpu = sum(proc.cpu_times()[:2]) - c0
        hop = "router + agent" if a.through_agent else "router"
        print(f"policy={a.policy}  router pinned to CPU {a.pin if a.pin >= 0 else 'none'}  "
              f"{len(dl)} sequential requests per path")
        print(f"direct to {'engine' if a.through_agent else 'worker'} : p50 {pct(dl, 50):.3f} ms   "
              f"p99 {pct(dl, 99):.3f} ms")
        print(f"through {hop:14s}: p50 {pct(rl, 50):.3f} ms   p99 {pct(rl, 99):.3f} ms")
        print(f"added by {hop:13s}: p50 {pct(rl, 50) - pct(dl, 50):.3f} ms   p99 {pct(rl, 99) - pct(dl, 99):.3f} ms")
        print(f"closed loop, {a.conns} connections, {a.seconds:.0f} s: {n / wall:,.0f} req/s measured; "
              f"router CPU {cpu * 1e6 / max(n, 1):.0f} µs/request → {n / max(cpu, 1e-9):,.0f} req/s per router core")
        return 0
    finally:
        for c in children:
            try:
                os.killpg(c.pid, 15)
            except ProcessLookupError:
                pass
        for c in children:
            try:
                c.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(c.pid, 9)
        seg.close()
        import dplb_shm

        dplb_shm.unlink(shm, missing_ok=True)
        import shutil

        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
