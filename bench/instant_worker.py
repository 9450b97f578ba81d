"""The overhead benches' *instant worker*: a minimal asyncio HTTP/1.1 keep-alive server on a Unix
socket or loopback TCP port that answers every POST with a fixed ~300-byte chat completion
(:data:`RESP_BODY`), a streamed POST (``"stream":true``) with one SSE event per write every
``interval_s`` (an engine's tokens; ``burst`` K: K events per write every K x ``interval_s``), and the GETs an attached agent's engine adapter asks for. It
plays the role nginx plays in the field's router measurements: the engine costs nothing, so what a
router adds is all that is measured. Run by ``python -m bench.router_overhead --serve-worker SHM
SOCK CHUNKS INTERVAL`` (:func:`serve_worker`).
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

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
STREAM = {"chunks": 64, "interval_s": 0.002, "burst": 1}
#: a worker that does more than answer (:mod:`bench.events_rig`: publishes KV-cache events, serves
#: ``/dplb/state``): ``POST_HOOK[0]`` is called with each POST's body before the answer;
#: ``GET_HOOK[0]`` answers a GET path (the whole response) or None for the fixed answers
POST_HOOK: list[Callable[[bytes], None] | None] = [None]
GET_HOOK: list[Callable[[bytes], bytes | None] | None] = [None]


def _hchunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _fixed(body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + ctype + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


# GET answers an attached agent's engine adapter may ask for (readiness, model list, metrics)
GET_ANSWERS = {b"/v1/models": _fixed(b'{"object":"list","data":[{"id":"bench","object":"model"}]}'),
               b"/metrics": _fixed(b"", b"text/plain; version=0.0.4"),
               b"/health": _fixed(b"")}


def _dechunk(buf: bytes, at: int) -> tuple[bytes, int] | None:
    """The chunked body (RFC 9112 section 7.1, no trailers) starting at ``buf[at:]`` and the offset
    just past it; None while incomplete."""
    parts = []
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return None
        size = int(buf[at:eol].split(b";", 1)[0], 16)
        if size == 0:
            return (b"".join(parts), eol + 4) if len(buf) >= eol + 4 else None
        if len(buf) < eol + 2 + size + 2:
            return None
        parts.append(buf[eol + 2:eol + 2 + size])
        at = eol + 2 + size + 2


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
            if b"transfer-encoding: chunked" in head:   # a gateway streaming the body (Envoy's ext_proc STREAMED)
                got = _dechunk(self.buf, end + 4)
                if got is None:
                    return
                body, used = got
                self.buf = self.buf[used:]
            else:
                if len(self.buf) < end + 4 + n:
                    return
                body = self.buf[end + 4:end + 4 + n]
                self.buf = self.buf[end + 4 + n:]
            if head.startswith(b"get "):
                path = head[4:head.find(b" ", 4)].split(b"?", 1)[0]
                hook = GET_HOOK[0]
                got_ = hook(path) if hook is not None else None
                self.t.write(got_ if got_ is not None else GET_ANSWERS.get(path, GET_ANSWERS[b"/health"]))
                continue
            if POST_HOOK[0] is not None:
                POST_HOOK[0](body)
            if b'"stream":true' in body:
                self.t.write(STREAM_HEAD)
                self._tick(STREAM["chunks"])
            else:
                self.t.write(RESP)

    def _tick(self, left: int) -> None:
        """One SSE event per write, ``STREAM["interval_s"]`` apart (an engine's tokens); with
        ``STREAM["burst"]`` K > 1, K events per write, K x ``interval_s`` apart, each event its
        own HTTP chunk as an engine frames them: the same event rate, the tokens arriving
        together, as a reader finds them when an engine's writes pile up in the socket (a loaded
        router or engine; the simulated engines at a high time scale)."""
        if self.t.is_closing():
            return
        if left == 0:
            self.t.write(_hchunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return
        k = min(left, STREAM["burst"])
        self.t.write(_hchunk(CHUNK) * k)
        asyncio.get_running_loop().call_later(STREAM["interval_s"] * k, self._tick, left - k)


def serve_worker(shm: str, sock: str, chunks: int = 64, interval_s: float = 0.002, burst: int = 1) -> None:
    """Run the instant worker in this process (``--serve-worker``) until killed. ``shm`` "-": a
    bare engine (no slot; a worker agent attaches to it), else it claims slot 0 like an agent.
    ``sock``: a Unix socket path, or ``127.0.0.1:PORT`` to listen on loopback TCP. A stream has
    ``chunks`` events, ``burst`` per write, ``interval_s`` apart per event (:meth:`_Instant._tick`)."""
    import uvloop

    from dplb_shm import Segment, WorkerState

    STREAM.update(chunks=chunks, interval_s=interval_s, burst=max(1, burst))
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
