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

SSE relay (``--streams`` > 0): that many concurrent streamed requests, each answered by the instant
worker with one SSE event (a ~150-byte chat chunk) every ``--chunk-interval-ms`` (each event its own
write, as an engine emits one per token), ``--chunks`` events per stream, streams restarted as
they end, for ``--seconds``. Prints the events the client received and the router's CPU seconds:
**SSE chunks relayed per router core per second** = events / router CPU seconds, the client's
socket reads per event, and the inter-token latency the client saw (p50/p90/p99 of the gap since
the event before, 0 for an event that came in the same read as the one before): a router that
holds events back to write several at once relays more per core-second and adds that to the ITL.

``--versus PEER``: DPLB's router and the peer's (bench/peers.py), both pinned to the same core in
front of the same instant worker (TCP), measured in alternating blocks within one run instead of
one system per run: ``--blocks`` blocks, each ``--block-requests`` sequential requests straight to
the worker and through each router (the routers' order alternating from block to block), so the
machine's drift, which on a shared VM moves a p50 by tens of µs between runs, hits both alike.
Prints each router's added p50 (median over the blocks) and, per block, DPLB's minus the peer's;
then ``--rounds`` closed loops per router, alternating, for the CPU per request. ``--versus`` may
be given several times (the order rotates per block and round); ``--versus baseline`` runs a second
DPLB checkout (``--baseline-dir``, built) as the peer: before/after figures from one run.

Long prompts (``--prompt-bytes N``): the latency blocks and closed loops send chat requests of
about N bytes, 10/11 of each one of 20 shared documents (:func:`long_prompt_requests`), after one
pass over them (the prefix index warm); ``--rate R`` paces the closed loops at R requests/s in all.

``--profile FILE``: record the router with py-spy during the closed loop (and the SSE phase, to
``FILE`` with ``.sse`` before the suffix) and write the functions with the most samples (own and
inclusive) as text.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Self

from launcher.stack import agent_argv, free_port, router_argv

BODY = (b'{"model":"bench","messages":[{"role":"user","content":"Say hello in one word, please."}],'
        b'"max_tokens":8}')
RESP_BODY = (b'{"id":"chatcmpl-bench","object":"chat.completion","created":0,"model":"bench","choices":[{"index":0,'
             b'"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,'
             b'"completion_tokens":1,"total_tokens":10}}')
RESP = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: " + str(len(RESP_BODY)).encode()
        + b"\r\n\r\n" + RESP_BODY)


CHUNK = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":0,"model":"bench","choices":'
         b'[{"index":0,"delta":{"content":" tok"},"finish_reason":null}]}\n\n')
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
               b"transfer-encoding: chunked\r\n\r\n")
#: stream parameters of the instant worker (set from the command line of --serve-worker)
STREAM = {"chunks": 64, "interval_s": 0.002}


def _hchunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


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
            body = self.buf[end + 4:end + 4 + n]
            self.buf = self.buf[end + 4 + n:]
            if head.startswith(b"get "):
                path = head[4:head.find(b" ", 4)].split(b"?", 1)[0]
                self.t.write(GET_ANSWERS.get(path, GET_ANSWERS[b"/health"]))
            elif b'"stream":true' in body:
                self.t.write(STREAM_HEAD)
                self._tick(STREAM["chunks"])
            else:
                self.t.write(RESP)

    def _tick(self, left: int) -> None:
        """One SSE event per write, ``STREAM["interval_s"]`` apart (an engine's tokens)."""
        if self.t.is_closing():
            return
        if left == 0:
            self.t.write(_hchunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return
        self.t.write(_hchunk(CHUNK))
        asyncio.get_running_loop().call_later(STREAM["interval_s"], self._tick, left - 1)


def serve_worker(shm: str, sock: str, chunks: int = 64, interval_s: float = 0.002) -> None:
    """Run the instant worker in this process (``--serve-worker``) until killed. ``shm`` "-": a
    bare engine (no slot; a worker agent attaches to it), else it claims slot 0 like an agent.
    ``sock``: a Unix socket path, or ``127.0.0.1:PORT`` to listen on loopback TCP."""
    import uvloop

    from dplb_shm import Segment, WorkerState

    STREAM.update(chunks=chunks, interval_s=interval_s)
    w = None
    if shm != "-":
        seg = Segment.attach(shm)
        w = seg.writer(0)
        w.claim(worker_id=0, pid=os.getpid(), endpoint=sock, model="bench", max_num_seqs=256)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        if sock.startswith("/"):
            srv = await loop.create_unix_server(_Instant, sock)
        else:
            host, _, port = sock.rpartition(":")
            srv = await loop.create_server(_Instant, host, int(port))
        if w is not None:
            w.set_state(WorkerState.READY)
        async with srv:
            while True:
                await asyncio.sleep(0.1)
                if w is not None:
                    w.heartbeat()

    uvloop.run(main())


# -------------------------------------------------------------------------------------- client


def _request(host_header: bytes, body: bytes = BODY) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host_header + b"\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def long_prompt_requests(prompt_bytes: int, prefixes: int = 20, pool: int = 60, seed: int = 0) -> list[bytes]:
    """``pool`` chat requests whose prompts are about ``prompt_bytes`` long: a system message that
    is one of ``prefixes`` shared documents (10/11 of the prompt: 200 KB of a 220 KB prompt, the
    shape of RAG and agent traffic) and a user message of its own (the rest); words of 2-8 letters,
    about 4 bytes a token. Deterministic for a ``seed``."""
    import random

    import orjson

    rnd = random.Random(seed)
    vocab = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 8))) for _ in range(5000)]

    def text(n: int) -> str:
        out: list[str] = []
        size = 0
        while size < n:
            w = rnd.choice(vocab)
            out.append(w)
            size += len(w) + 1
        return " ".join(out)

    shared = max(1, prompt_bytes * 10 // 11)
    docs = [text(shared) for _ in range(prefixes)]
    return [_request(b"bench", orjson.dumps({"model": "bench", "max_tokens": 8, "messages": [
        {"role": "system", "content": docs[i % prefixes]},
        {"role": "user", "content": text(prompt_bytes - shared)}]})) for i in range(pool)]


def _read_response(s: socket.socket, buf: bytearray) -> int:
    """Read one response off ``s`` (``Content-Length`` or chunked: Envoy drops the length of a
    body its ext_proc filter streams to the picker); returns its status."""
    def fill() -> None:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        buf.extend(chunk)

    while (end := buf.find(b"\r\n\r\n")) < 0:
        fill()
    head = bytes(buf[:end]).lower()
    status = int(head[9:12])
    del buf[:end + 4]
    i = head.find(b"content-length:")
    if i >= 0:
        j = head.find(b"\r\n", i)
        n = int(head[i + 15:j if j > 0 else None])
        while len(buf) < n:
            fill()
        del buf[:n]
        return status
    while True:   # chunked: size line, data, CRLF; a 0 size ends it (no trailers here)
        while (eol := buf.find(b"\r\n")) < 0:
            fill()
        size = int(bytes(buf[:eol]).split(b";")[0], 16)
        while len(buf) < eol + 2 + size + 2:
            fill()
        del buf[:eol + 2 + size + 2]
        if size == 0:
            return status


def sequential(connect, n: int, req: bytes | None = None) -> list[float]:
    """``n`` sequential requests (``req``, default a non-streamed chat) on one keep-alive
    connection; per-request latency in ms (for a stream: to its last byte)."""
    s = connect()
    req = req or _request(b"bench")
    buf = bytearray()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(req)
            if _read_response(s, buf) != 200:
                raise SystemExit("a sequential request was not answered 200: the figures would be invalid")
            out.append((time.perf_counter() - t0) * 1000.0)
    finally:
        s.close()
    return out


NON_200: list[int] = []


def closed_loop(port: int, conns: int, seconds: float, reqs: list[bytes] | None = None, rate: float = 0.0) -> int:
    """``conns`` threads, each a keep-alive connection in a closed loop; total requests answered
    200 (any other status is kept in :data:`NON_200` and reported: a fast error is no throughput).
    ``reqs``: the requests, each connection cycling through them from its own offset (default: the
    tiny chat); ``rate`` > 0: paced at ``rate`` requests/s over all connections (each connection
    sends at most one every ``conns / rate`` s) instead of as fast as answers come."""
    stop = time.monotonic() + seconds
    counts = [0] * conns
    reqs = reqs or [_request(b"bench")]

    def run(k: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        i = k * 7
        gap = conns / rate if rate > 0 else 0.0
        t_next = time.monotonic() + gap * k / conns
        try:
            while time.monotonic() < stop:
                if gap:
                    delay = t_next - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    t_next += gap
                req = reqs[i % len(reqs)]
                i += 1
                s.sendall(req)
                st = _read_response(s, buf)
                if st == 200:
                    counts[k] += 1
                else:
                    NON_200.append(st)
        finally:
            s.close()

    ts = [threading.Thread(target=run, args=(k,)) for k in range(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts)


STREAM_BODY = (b'{"model":"bench","messages":[{"role":"user","content":"Say hello."}],"max_tokens":64,'
               b'"stream":true}')


STREAM_ERRORS: list[str] = []


def stream_loop(port: int, streams: int, seconds: float, gaps: list[float] | None = None) -> tuple[int, int]:
    """``streams`` threads, each a keep-alive connection sending streamed requests back to back
    until ``seconds`` pass; returns the SSE events received (``data:`` lines, [DONE] excluded) and
    the client's socket reads that brought them (fewer reads than events: the router held events
    back and sent them together). A stream answered with anything but 200, or cut, ends its
    thread; :data:`STREAM_ERRORS` says why. ``gaps``: when given, gets the inter-token latency the
    client saw (s): for every event after a stream's first, the time since the event before it
    (0 for an event that came in the same read as the one before)."""
    stop = time.monotonic() + seconds
    counts = [0] * streams
    reads = [0] * streams
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
           b"content-length: " + str(len(STREAM_BODY)).encode() + b"\r\n\r\n" + STREAM_BODY)

    def run(k: int) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mine: list[float] = []
        try:
            while time.monotonic() < stop:
                s.sendall(req)
                buf = b""
                last = None
                while not buf.endswith(b"0\r\n\r\n"):   # the chunked body's terminator
                    chunk = s.recv(262144)
                    reads[k] += 1
                    if gaps is not None:
                        n = chunk.count(b"data: {")
                        if n:
                            t = time.perf_counter()
                            if last is not None:
                                mine.append(t - last)
                            mine.extend([0.0] * (n - 1))
                            last = t
                    if not chunk:
                        raise ConnectionError("closed")
                    if not buf and not chunk.startswith(b"HTTP/1.1 200"):
                        raise ConnectionError(chunk[:300].decode("latin-1"))
                    buf += chunk
                    if len(buf) > 1 << 16:
                        counts[k] += buf.count(b"data: {")
                        buf = buf[-16:]
                counts[k] += buf.count(b"data: {")
        except OSError as e:
            STREAM_ERRORS.append(repr(e))
        finally:
            s.close()
            if gaps is not None:
                gaps.extend(mine)   # list.extend is atomic under the GIL

    ts = [threading.Thread(target=run, args=(k,)) for k in range(streams)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts), sum(reads)


class Profiler:
    """py-spy recording of one process for the length of a ``with`` block; :meth:`write` turns
    the raw stacks into the top functions by own and inclusive samples."""

    def __init__(self, pid: int, out: str | None) -> None:
        self.pid, self.out, self.p = pid, out, None
        self.raw = (out + ".raw") if out else None

    def __enter__(self) -> Self:
        if self.out:
            import shutil

            spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
            self.p = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--format", "raw", "--rate", "250",
                                       "--nonblocking", "--output", self.raw], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.p is not None:
            self.p.send_signal(2)
            try:
                self.p.wait(20)
            except subprocess.TimeoutExpired:
                self.p.kill()
            self.write()

    def write(self, top: int = 40) -> None:
        from collections import Counter

        own: Counter[str] = Counter()
        incl: Counter[str] = Counter()
        total = 0
        try:
            lines = open(self.raw).read().splitlines()  # noqa: SIM115
        except OSError:
            return
        for line in lines:
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            k = int(n)
            total += k
            frames = [f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0].rsplit("/", 2)[-1] + ")"
                      if " (" in f else f for f in stack.split(";")]
            own[frames[-1]] += k
            for f in set(frames):
                incl[f] += k
        with open(self.out, "w") as f:
            f.write(f"py-spy samples: {total} (rate 250/s)\n\nown time (top {top})\n")
            for name, k in own.most_common(top):
                f.write(f"{100.0 * k / max(total, 1):6.2f}%  {name}\n")
            f.write(f"\ninclusive time (top {top})\n")
            for name, k in incl.most_common(top):
                f.write(f"{100.0 * k / max(total, 1):6.2f}%  {name}\n")
        os.unlink(self.raw)


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(p / 100.0 * len(ys) + 0.5) - 1))]


def versus(a: argparse.Namespace, launch: Callable[[str | None, str], tuple[int, int]],
           direct: Callable[[], socket.socket], to_port: Callable[[int], Callable[[], socket.socket]],
           cpu_of: Callable[[int], Callable[[], float]]) -> int:
    """``--versus``: DPLB's router and each of ``a.versus`` (peers, or ``baseline``: DPLB from
    ``--baseline-dir``) side by side, measured in alternating blocks and rounds (module
    docstring; the order rotates from one block or round to the next). Prints the figures;
    returns the exit status."""
    systems = [("dplb", *launch(None, "router.log"))]
    systems += [(v, *launch(v, f"{v}.log")) for v in a.versus]
    others = [name for name, _, _ in systems[1:]]
    print(f"dplb versus {', '.join(others)} (peer policy {a.peer_policy}, dplb policy {a.policy}): all pinned to CPU "
          f"{a.pin if a.pin >= 0 else 'none'}, worker on TCP; {a.blocks} blocks of {a.block_requests} sequential "
          "requests per path")

    def order(k: int) -> list[tuple[str, int, int]]:
        r = k % len(systems)
        return systems[r:] + systems[:r]

    reqs = long_prompt_requests(a.prompt_bytes) if a.prompt_bytes else None
    one = reqs[0] if reqs else None
    warm = 500 if not reqs else 50
    failed: dict[str, list[int]] = {name: [] for name, _, _ in systems}
    for name, port, _ in systems:
        if reqs:
            before = len(NON_200)
            closed_loop(port, 2, 3.0, reqs)   # the shared documents seen once (the prefix index warm)
            failed[name] += NON_200[before:]
        sequential(to_port(port), warm, one)   # warm-up
    sequential(direct, warm, one)
    added: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    for b in range(a.blocks):
        d_p50 = pct(sequential(direct, a.block_requests, one), 50)
        for name, port, _ in order(b):
            added[name].append(pct(sequential(to_port(port), a.block_requests, one), 50) - d_p50)
    if a.blocks:
        for name, xs in added.items():
            print(f"added p50, {name:8s}: {1000 * statistics.median(xs):.0f} µs median of blocks "
                  f"[{1000 * min(xs):.0f}–{1000 * max(xs):.0f}]")
        for other in others:
            diff = [x - y for x, y in zip(added["dplb"], added[other], strict=True)]
            print(f"dplb minus {other}, per block: median {1000 * statistics.median(diff):+.0f} µs; dplb at or "
                  f"below in {sum(x <= 0 for x in diff)} of {len(diff)} blocks")
    cpu: dict[str, list[float]] = {name: [] for name, _, _ in systems}
    for r in range(a.rounds):
        for name, port, pid in order(r):
            measure = cpu_of(pid)
            c0 = measure()
            before = len(NON_200)
            n = closed_loop(port, a.conns, a.seconds, reqs, a.rate)
            cpu[name].append((measure() - c0) * 1e6 / max(n, 1))
            failed[name] += NON_200[before:]
    if a.rounds:
        what = f"{a.prompt_bytes / 1000:g} KB prompts" if reqs else "tiny chat"
        pace = f"paced at {a.rate:g}/s" if a.rate > 0 else "closed loops"
        for name, xs in cpu.items():
            print(f"router CPU per request ({what}), {name:8s}: {statistics.median(xs):.0f} µs median of {len(xs)} "
                  f"rounds [{min(xs):.0f}–{max(xs):.0f}] ({a.conns} connections, {pace}, {a.seconds:g} s each)")
        for other in others:
            ratios = [x / y for x, y in zip(cpu["dplb"], cpu[other], strict=True)]
            print(f"dplb / {other}: {statistics.median(cpu['dplb']) / statistics.median(cpu[other]):.2f}× "
                  f"(per round [{min(ratios):.2f}–{max(ratios):.2f}])")
    if NON_200:
        from collections import Counter

        print(f"  INVALID: {len(NON_200)} answers were not 200: "
              + ", ".join(f"{k} {dict(Counter(v))}" for k, v in failed.items() if v))
        return 1
    return 0


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
                    help="attach a real worker agent (--engine openai) to the instant engine, as deployed: the "
                         "agent publishes the engine's address and the router forwards straight to it (one hop)")
    ap.add_argument("--streams", type=int, default=32, help="concurrent streams of the SSE phase (0: skip it)")
    ap.add_argument("--chunks", type=int, default=64, help="SSE events per stream")
    ap.add_argument("--chunk-interval-ms", type=float, default=2.0, help="gap between two events of a stream")
    ap.add_argument("--workers", type=int, default=0, help="router processes (--workers of the router; 0: one, "
                    "unpinned with --pin -1, else pinned to CPUs pin..pin+k-1)")
    ap.add_argument("--tcp", action="store_true", help="the instant worker listens on loopback TCP (as the peers need)")
    ap.add_argument("--peer", choices=("sglang", "vllm", "smg"), help="measure this peer router (bench/peers.py) instead of "
                    "DPLB's, pinned the same way, in front of the same instant worker (implies --tcp)")
    ap.add_argument("--peer-policy", default="round_robin", help="the peer's policy (default: round_robin)")
    ap.add_argument("--versus", choices=("sglang", "vllm", "smg", "baseline", "no-access-log"), action="append",
                    help="run DPLB's router and this peer's (repeatable; baseline: DPLB from --baseline-dir; "
                    "no-access-log: DPLB's router with --access-log off, the access log's share) side by "
                    "side and measure them in alternating blocks (implies --tcp; see the module docstring)")
    ap.add_argument("--baseline-dir", help="a second DPLB checkout, built (make build), run as --versus baseline: "
                    "before/after figures in the same run")
    ap.add_argument("--blocks", type=int, default=20, help="alternating blocks of --versus")
    ap.add_argument("--block-requests", type=int, default=300, help="sequential requests per path and block (--versus)")
    ap.add_argument("--profile", metavar="FILE", help="py-spy the router during the closed loop; top functions to FILE")
    ap.add_argument("--skip-latency", action="store_true", help="skip the sequential latency phase")
    ap.add_argument("--prompt-bytes", type=int, default=0, help="long prompts of about this many bytes (20 shared "
                    "documents making 10/11 of each, bench.router_overhead.long_prompt_requests) instead of the tiny "
                    "chat, in the closed loops and the latency blocks")
    ap.add_argument("--rate", type=float, default=0.0, help="pace the closed loops at this many requests/s in all "
                    "(0: as fast as answers come)")
    ap.add_argument("--serve-worker", nargs=4, metavar=("SHM", "SOCK", "CHUNKS", "INTERVAL"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_worker:
        shm_, sock_, ch, iv = a.serve_worker
        serve_worker(shm_, sock_, int(ch), float(iv))
        return 0

    import psutil

    from dplb_shm import Segment

    shm = a.shm or f"dplb-bench-{uuid.uuid4().hex[:8]}"
    d = tempfile.mkdtemp(prefix="dplb-bench-", dir="/tmp")
    if a.versus and (a.peer or a.workers or a.through_agent):
        ap.error("--versus runs DPLB's router beside the peer: not with --peer, --workers or --through-agent")
    tcp = a.tcp or a.peer is not None or a.versus is not None
    sock = f"127.0.0.1:{free_port()}" if tcp else os.path.join(d, "w0.sock")
    seg = Segment.create(shm, num_slots=8)
    children: list[subprocess.Popen] = []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        children.append(subprocess.Popen([sys.executable, "-m", "bench.router_overhead", "--serve-worker",
                                          "-" if a.through_agent else shm, sock, str(a.chunks),
                                          str(a.chunk_interval_ms / 1000.0)], cwd=root, start_new_session=True))
        if tcp:
            from launcher.stack import wait_for_port

            wait_for_port(int(sock.rpartition(":")[2]), timeout=20)
        if a.through_agent:
            t_end = time.monotonic() + 20
            while not tcp and not os.path.exists(sock) and time.monotonic() < t_end:
                time.sleep(0.05)
            children.append(subprocess.Popen(
                agent_argv(0, shm, os.path.join(d, "agent-0.sock"), engine="openai",
                           engine_url=f"http://{sock}" if tcp else f"unix:{sock}", model="bench", run_dir=d),
                cwd=root, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        import urllib.error
        import urllib.request

        def launch(peer: str | None, log: str) -> tuple[int, int]:
            """Start DPLB's router (``peer`` None) or ``peer``'s in front of the worker, pinned as
            asked; wait until it has a ready worker (GET /health → 200). Returns (port, pid)."""
            port = free_port()
            cwd, env = root, None
            if peer == "baseline":
                if not a.baseline_dir:
                    raise SystemExit("--versus baseline needs --baseline-dir")
                cwd, env = a.baseline_dir, {**os.environ, "PYTHONPATH": os.path.abspath(a.baseline_dir)}
                rcmd = router_argv(port=port, shm=shm, policy=a.policy, log_level="warning")
            elif peer == "no-access-log":
                rcmd = router_argv(port=port, shm=shm, policy=a.policy, log_level="warning", extra=["--access-log", "off"])
            elif peer:
                from bench.peers import ensure_peer, peer_command

                ensure_peer(peer)
                rcmd = peer_command(peer, a.peer_policy, port, free_port(), [f"http://{sock}"])
            else:
                rcmd = router_argv(port=port, shm=shm, policy=a.policy, log_level="warning",
                                   workers=a.workers or None)
            rlog = open(os.path.join(d, log), "wb")  # noqa: SIM115 - closed with the run dir
            if a.pin >= 0:
                cpus = f"{a.pin}" if a.workers <= 1 else f"{a.pin}-{a.pin + a.workers - 1}"
                rcmd = ["taskset", "-c", cpus] + rcmd
            children.append(subprocess.Popen(rcmd, cwd=cwd, env=env, start_new_session=True, stdout=rlog, stderr=rlog))
            deadline = time.monotonic() + 60
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (OSError, urllib.error.URLError):
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("router or worker did not come up")
                time.sleep(0.2)
            return port, children[-1].pid

        def direct() -> socket.socket:
            if tcp:
                s = socket.create_connection(("127.0.0.1", int(sock.rpartition(":")[2])))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s
            s = socket.socket(socket.AF_UNIX)
            s.connect(sock)
            return s

        def to_port(p: int) -> Callable[[], socket.socket]:
            def connect() -> socket.socket:
                s = socket.create_connection(("127.0.0.1", p))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return s
            return connect

        def cpu_of(pid: int) -> Callable[[], float]:
            proc = psutil.Process(pid)  # taskset execs the router in place: same pid

            def router_cpu() -> float:
                """CPU seconds (user + system) of the router and its --workers processes."""
                ps = [proc] + proc.children(recursive=True)
                tot = 0.0
                for p in ps:
                    try:
                        tot += sum(p.cpu_times()[:2])
                    except psutil.NoSuchProcess:
                        pass
                return tot
            return router_cpu

        if a.versus:
            return versus(a, launch, direct, to_port, cpu_of)
        port, router_pid = launch(a.peer, "router.log")
        routed = to_port(port)
        router_cpu = cpu_of(router_pid)

        hop = a.peer + " router" if a.peer else "router" if not a.through_agent else "router (agent attached)"
        print(f"system={a.peer + '/' + a.peer_policy if a.peer else 'dplb'}  worker on {'TCP' if tcp else 'a Unix socket'}  "
              f"policy={a.policy}  router pinned to CPU {a.pin if a.pin >= 0 else 'none'}"
              + (f"  router processes={a.workers}" if a.workers else ""))
        reqs = long_prompt_requests(a.prompt_bytes) if a.prompt_bytes else None
        one = reqs[0] if reqs else None
        if reqs:
            closed_loop(port, 2, 3.0, reqs)   # the shared documents seen once (the prefix index warm)
        if not a.skip_latency:
            sequential(direct, 500, one)
            sequential(routed, 500, one)   # warm-up: pools, caches, JIT-free but allocator warm
            dl: list[float] = []
            rl: list[float] = []
            for _ in range(a.rounds):
                dl += sequential(direct, a.requests // a.rounds, one)
                rl += sequential(routed, a.requests // a.rounds, one)
            print(f"{len(dl)} sequential requests per path")
            print(f"direct to {'engine' if a.through_agent else 'worker'} : p50 {pct(dl, 50):.3f} ms   "
                  f"p99 {pct(dl, 99):.3f} ms")
            print(f"through {hop:14s}: p50 {pct(rl, 50):.3f} ms   p99 {pct(rl, 99):.3f} ms")
            print(f"added by {hop:13s}: p50 {pct(rl, 50) - pct(dl, 50):.3f} ms   p99 {pct(rl, 99) - pct(dl, 99):.3f} ms")
        with Profiler(router_pid, a.profile):
            c0 = router_cpu()
            t0 = time.perf_counter()
            n = closed_loop(port, a.conns, a.seconds, reqs, a.rate)
            wall = time.perf_counter() - t0
            cpu = router_cpu() - c0
        print(f"closed loop, {a.conns} connections, {a.seconds:.0f} s: {n / wall:,.0f} req/s measured; "
              f"router CPU {cpu * 1e6 / max(n, 1):.0f} µs/request → {n / max(cpu, 1e-9):,.0f} req/s per router core")
        if NON_200:
            from collections import Counter

            print(f"  INVALID: {len(NON_200)} answers were not 200 ({dict(Counter(NON_200))}); slot 0: "
                  f"{seg.read_slot(0).state.name}; router's view: "
                  f"{urllib.request.urlopen(f'http://127.0.0.1:{port}/dplb/status', timeout=5).read()[:600]!r}; "
                  "router log tail:")
            with open(os.path.join(d, "router.log"), errors="replace") as f:
                print("".join(f.readlines()[-15:]))
        if a.streams > 0:
            prof = None
            if a.profile:
                root_, ext = os.path.splitext(a.profile)
                prof = root_ + ".sse" + ext
            with Profiler(router_pid, prof):
                c0 = router_cpu()
                t0 = time.perf_counter()
                gaps: list[float] = []
                ev, reads = stream_loop(port, a.streams, a.seconds, gaps)
                wall = time.perf_counter() - t0
                cpu = router_cpu() - c0
            print(f"SSE relay, {a.streams} streams, one event per {a.chunk_interval_ms:g} ms: {ev / wall:,.0f} "
                  f"events/s measured; router CPU {cpu:.2f} s → {ev / max(cpu, 1e-9):,.0f} SSE chunks relayed "
                  f"per router core per second; {reads / max(ev, 1):.2f} client reads per event")
            if gaps:
                held = sum(1 for g in gaps if g == 0.0) / len(gaps)
                print(f"  inter-token latency at the client (the engine sends one event per {a.chunk_interval_ms:g} "
                      f"ms): p50 {pct(gaps, 50) * 1e3:.2f} ms, p90 {pct(gaps, 90) * 1e3:.2f} ms, p99 "
                      f"{pct(gaps, 99) * 1e3:.2f} ms; {held:.0%} of events arrived in the same read as the one "
                      "before")
            if STREAM_ERRORS:
                print(f"  {len(STREAM_ERRORS)} stream(s) failed; first: {STREAM_ERRORS[0][:300]}")
                with open(os.path.join(d, "router.log"), errors="replace") as f:
                    print("  router log tail:\n" + "".join(f.readlines()[-15:]))
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
