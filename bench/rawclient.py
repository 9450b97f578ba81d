"""The overhead benches' raw socket client: requests as the bytes a client sends, sequential
requests on one keep-alive connection (latency), closed loops over several connections
(throughput, router CPU per request), streamed loops (SSE relay, the inter-token latency a client
sees) and the percentile they are reported with. Used by :mod:`bench.router_overhead`,
:mod:`bench.router_inproc`, :mod:`bench.prefix_work` and :mod:`bench.epp`.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

BODY = (b'{"model":"bench","messages":[{"role":"user","content":"Say hello in one word, please."}],'
        b'"max_tokens":8}')

def chat_request(host_header: bytes, body: bytes = BODY) -> bytes:
    """A ``POST /v1/chat/completions`` of ``body`` (default the tiny chat :data:`BODY`) as the
    bytes a client sends, with ``host_header`` as its Host."""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: " + host_header + b"\r\ncontent-type: application/json"
            b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def connector(port: int) -> Callable[[], socket.socket]:
    """A function that opens a connection to loopback TCP ``port`` (TCP_NODELAY set)."""
    def connect() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s
    return connect


def in_threads(run: Callable[[int], None], n: int) -> None:
    """``run(k)`` for ``k`` in ``0..n-1``, each in a thread of its own, all started, then all joined."""
    ts = [threading.Thread(target=run, args=(k,)) for k in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


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
    return [chat_request(b"bench", orjson.dumps({"model": "bench", "max_tokens": 8, "messages": [
        {"role": "system", "content": docs[i % prefixes]},
        {"role": "user", "content": text(prompt_bytes - shared)}]})) for i in range(pool)]


def read_response(s: socket.socket, buf: bytearray) -> int:
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
    req = req or chat_request(b"bench")
    buf = bytearray()
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            s.sendall(req)
            if read_response(s, buf) != 200:
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
    reqs = reqs or [chat_request(b"bench")]

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
                st = read_response(s, buf)
                if st == 200:
                    counts[k] += 1
                else:
                    NON_200.append(st)
        finally:
            s.close()

    in_threads(run, conns)
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
    req = chat_request(b"bench", STREAM_BODY)

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

    in_threads(run, streams)
    return sum(counts), sum(reads)


def pct(xs: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(p / 100.0 * len(ys) + 0.5) - 1))]
