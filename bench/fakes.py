"""Small fake workers for router and fault-injection tests (``python -m bench.fakes``).

A fake agent is a real HTTP server on a Unix socket (or loopback TCP) that, unless ``--no-shm``,
claims slot ``--worker-id`` of segment ``--shm``, publishes READY with its socket as endpoint,
heartbeats every 100 ms and counts its in-flight requests in the slot (like a worker agent).

Behaviour (``mode``), set at start (``--mode``), at run time (``POST /fake/mode``) or per request
(header ``X-Fake-Mode``, which the router forwards untouched):

======== ===============================================================================
ok       answer at once (OpenAI shape; ``stream: true`` → SSE chunks then ``[DONE]``)
slow     wait ``delay`` seconds, then answer
500      answer 500 (OpenAI error body);  ``400`` and ``429`` likewise; ``600``: a status that is
         not an HTTP status; ``103``: an interim answer (Early Hints), then the answer as ``ok``;
         ``499``: an empty 499 (what an engine that dropped the request answers)
hang     never answer (until the client goes away)
drop     close the connection before sending any byte
stream   SSE: ``chunks`` chunks, ``delay`` seconds apart (every streamed answer ends with a usage
         chunk when ``stream_options.include_usage`` is set, then ``[DONE]``)
break    SSE: two chunks, then close the connection mid-stream
utf8     SSE: ``chunks`` chunks, then one event (text :data:`UTF8_TEXT`) written in two parts
         ``delay`` seconds apart, split inside a 4-byte UTF-8 character
abort    an engine-side abort: a non-streamed answer with ``finish_reason: "abort"``; a stream of
         ``chunks`` content chunks (0: none) then a ``finish_reason: "abort"`` event and ``[DONE]``
         (vLLM's answer to a request its engine dropped: its drain limit, a stop)
======== ===============================================================================

Header ``X-Fake-First-Delay: S`` (streams): send the response head at once, then wait S seconds
before the first chunk (an engine in a long prefill). Header ``X-Fake-Role-First: 1`` (chat
streams): send a role-only event (``delta: {"role": "assistant", "content": ""}``) with the head,
before that wait, as some servers do before the prefill.

Every non-stream JSON answer carries ``"fake": {"worker_id", "path", "headers", "body"}`` — the
headers and the parsed body exactly as received. ``GET /fake/stats`` returns counters (requests,
by path, active, disconnects) and the last request seen; ``GET /health`` answers 200 (503 when the
mode is ``unhealthy``); ``GET /dplb/state`` serves the slot as JSON like a real agent.

Helpers for tests: :func:`start_fake` and :func:`start_router` (process handles that tests stop
through the ``procs`` fixture) and :class:`FakeClient` (talk to a fake over its socket).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from aiohttp import web

MODEL = "fake-model"
#: text of the ``utf8`` mode's last event (multi-byte characters of 2, 3 and 4 bytes)
UTF8_TEXT = "héllo wörld 你好 😀 done"


class FakeAgent:
    """The fake's server state; see the module docstring for modes."""

    def __init__(self, worker_id: int, model: str, mode: str, delay: float, chunks: int, writer: Any = None,
                 seg: Any = None) -> None:
        self.worker_id = worker_id
        self.model = model
        self.mode = mode
        self.delay = delay
        self.chunks = chunks
        self.writer = writer
        self.seg = seg
        self.stats: dict[str, Any] = {"requests": 0, "by_path": {}, "active": 0, "max_active": 0,
                                      "disconnects": 0, "completed": 0, "last": None}

    def _inflight(self, delta: int) -> None:
        self.stats["active"] += delta
        self.stats["max_active"] = max(self.stats["max_active"], self.stats["active"])
        if self.writer is not None:
            self.writer.inflight_add(delta)
            self.writer.publish(num_running=self.stats["active"])

    def completion(self, path: str, body: Any, headers: dict[str, str]) -> dict[str, Any]:
        text = f"hello from fake worker {self.worker_id}"
        fake = {"worker_id": self.worker_id, "path": path, "headers": headers, "body": body}
        now = int(time.time())
        if path == "/v1/chat/completions":
            return {"id": "chatcmpl-fake", "object": "chat.completion", "created": now, "model": self.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": "stop", "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}, "fake": fake}
        if path == "/v1/completions":
            return {"id": "cmpl-fake", "object": "text_completion", "created": now, "model": self.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}, "fake": fake}
        return {"text": text, "meta_info": {"id": "fake"}, "fake": fake}

    def abort_chunk(self, path: str) -> bytes:
        """The event an engine sends for a request it aborted: no content, ``finish_reason: "abort"``."""
        key = "text" if path == "/v1/completions" else "delta"
        obj = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": self.model,
               "choices": [{"index": 0, key: "" if key == "text" else {}, "finish_reason": "abort", "logprobs": None}]}
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def chunk(self, path: str, i: int, last: bool) -> bytes:
        now = int(time.time())
        if path == "/v1/completions":
            obj = {"id": "cmpl-fake", "object": "text_completion", "created": now, "model": self.model,
                   "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": "stop" if last else None,
                                "logprobs": None}]}
        else:
            obj = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": now, "model": self.model,
                   "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": "stop" if last else None,
                                "logprobs": None}], "worker_id": self.worker_id}
        return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _mode_answer(request: web.Request, mode: str, delay: float) -> web.Response | None:
    """What ``mode`` answers before (or instead of) an answer: an early end (drop, 600, 499, an
    OpenAI error), else None after its wait (hang, slow) or interim answer (103)."""
    from aiohttp import web

    if mode == "drop":
        request.transport.close()
        return web.Response(status=500)
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "slow":
        await asyncio.sleep(delay)
    if mode == "103" and request.transport is not None:
        # an interim answer (Early Hints) first; the answer follows as for ``ok``
        request.transport.write(b"HTTP/1.1 103 Early Hints\r\nlink: </hint.css>; rel=preload\r\n\r\n")
    if mode == "600":
        return web.Response(status=600, body=b"not final")
    if mode == "499":
        return web.Response(status=499)
    if mode in ("500", "400", "429"):
        code = int(mode)
        err = {"error": {"message": f"fake {code}", "type": "fake", "param": None, "code": code}}
        return web.json_response(err, status=code)
    return None


async def _stream_answer(agent: FakeAgent, request: web.Request, body: Any, mode: str, delay: float,
                         chunks: int) -> web.StreamResponse:
    """A streamed answer as ``mode`` says (stream, break, utf8, abort, ok; module docstring)."""
    from aiohttp import web

    path = request.path
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                                       "x-fake-worker": str(agent.worker_id)})
    await resp.prepare(request)
    if request.headers.get("x-fake-role-first") == "1" and path == "/v1/chat/completions":
        role = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": agent.model,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None, "logprobs": None}]}
        await resp.write(b"data: " + orjson.dumps(role) + b"\n\n")
    first_delay = float(request.headers.get("x-fake-first-delay", 0))
    if first_delay > 0:   # StreamResponse.prepare sent the head already
        await asyncio.sleep(first_delay)
    n = 2 if mode == "break" else max(0, chunks) if mode == "abort" else max(1, chunks)
    for i in range(n):
        if i and mode == "stream":
            await asyncio.sleep(delay)
        await resp.write(agent.chunk(path, i, i == n - 1 and mode not in ("break", "abort")))
    if mode == "abort":
        await resp.write(agent.abort_chunk(path))
    if mode == "break":
        await asyncio.sleep(0.05)
        request.transport.close()
        return resp
    if mode == "utf8":  # one event whose bytes are split inside a 4-byte UTF-8 character
        ev = agent.chunk(path, n, True).replace(f"t{n} ".encode(), UTF8_TEXT.encode())
        cut = ev.index("😀".encode()) + 2
        await resp.write(ev[:cut])
        await asyncio.sleep(delay)
        await resp.write(ev[cut:])
    so = body.get("stream_options") if isinstance(body, dict) else None
    if isinstance(so, dict) and so.get("include_usage"):
        usage = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": agent.model,
                 "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                          "total_tokens": n + 1}}
        await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    agent.stats["completed"] += 1
    return resp


async def _answer(agent: FakeAgent, request: web.Request) -> web.StreamResponse:
    """The fake's answer to any POST: counted in its stats, shaped by its mode (module docstring)."""
    from aiohttp import web

    path = request.path
    raw = await request.read()
    try:
        body = orjson.loads(raw) if raw else None
    except orjson.JSONDecodeError:
        body = {"_raw": raw.decode("latin-1")}
    headers = {str(k).lower(): v for k, v in request.headers.items()}
    st = agent.stats
    st["requests"] += 1
    st["by_path"][path] = st["by_path"].get(path, 0) + 1
    st["last"] = {"path": path, "headers": headers, "body": body}
    mode = request.headers.get("x-fake-mode", agent.mode)
    delay = float(request.headers.get("x-fake-delay", agent.delay))
    chunks = int(request.headers.get("x-fake-chunks", agent.chunks))
    stream = isinstance(body, dict) and body.get("stream") is True
    agent._inflight(+1)
    try:
        early = await _mode_answer(request, mode, delay)
        if early is not None:
            return early
        if stream or mode in ("stream", "break", "utf8"):
            return await _stream_answer(agent, request, body, mode, delay, chunks)
        st["completed"] += 1
        answer = agent.completion(path, body, headers)
        if mode == "abort" and answer.get("choices"):
            answer["choices"][0]["finish_reason"] = "abort"
        return web.Response(body=orjson.dumps(answer),
                            content_type="application/json", headers={"x-fake-worker": str(agent.worker_id)})
    except asyncio.CancelledError:
        st["disconnects"] += 1
        raise
    finally:
        agent._inflight(-1)


def build_app(agent: FakeAgent):
    """The aiohttp application of a fake agent."""
    from aiohttp import web

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _answer(agent, request)

    async def health(_: web.Request) -> web.Response:
        if agent.mode == "unhealthy":
            return web.Response(status=503, text="unhealthy")
        return web.Response(text="ok")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": agent.model, "object": "model", "max_model_len": 4096}]})

    async def stats(_: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(agent.stats), content_type="application/json")

    async def set_mode(request: web.Request) -> web.Response:
        d = await request.json()
        agent.mode = d.get("mode", agent.mode)
        agent.delay = float(d.get("delay", agent.delay))
        agent.chunks = int(d.get("chunks", agent.chunks))
        if d.get("reset_stats"):
            agent.stats.update({"requests": 0, "by_path": {}, "max_active": agent.stats["active"],
                                "disconnects": 0, "completed": 0, "last": None})
        if "state" in d and agent.writer is not None:
            agent.writer.set_state(int(d["state"]))
        return web.json_response({"mode": agent.mode})

    async def dplb_state(_: web.Request) -> web.Response:
        if agent.seg is not None:
            d = agent.seg.read_slot(agent.worker_id).to_dict()
        else:
            d = {"worker_id": agent.worker_id, "state": "ready", "model": agent.model, "num_running": agent.stats["active"],
                 "num_waiting": 0, "inflight": agent.stats["active"], "kv_cache_usage": 0.1, "max_num_seqs": 256,
                 "weight": 1.0}
        return web.Response(body=orjson.dumps(d), content_type="application/json")

    async def engine_metrics(_: web.Request) -> web.Response:
        text = ("# HELP fake_requests_total Requests the fake answered.\n# TYPE fake_requests_total counter\n"
                f'fake_requests_total{{model_name="{agent.model}"}} {agent.stats["requests"]}\n')
        return web.Response(text=text, content_type="text/plain")

    app = web.Application(client_max_size=1 << 30)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", engine_metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/fake/stats", stats)
    app.router.add_post("/fake/mode", set_mode)
    app.router.add_get("/dplb/state", dplb_state)
    app.router.add_route("POST", r"/{tail:[\s\S]*}", handle)   # any path, line breaks included
    return app


async def _serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    writer = seg = None
    if args.shm:
        from dplb_shm import Segment, WorkerState

        seg = Segment.attach(args.shm)
        writer = seg.writer(args.worker_id)
        writer.claim(worker_id=args.worker_id, pid=os.getpid(),
                     endpoint=args.uds or f"127.0.0.1:{args.port}", gpu_ids=[], weight=args.weight,
                     model=args.model, max_num_seqs=args.max_num_seqs)
    agent = FakeAgent(args.worker_id, args.model, args.mode, args.delay, args.chunks, writer, seg)
    runner = web.AppRunner(build_app(agent), access_log=None, handle_signals=True, handler_cancellation=True)
    await runner.setup()
    if args.uds:
        site: Any = web.UnixSite(runner, args.uds)
    else:
        site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    if writer is not None:
        writer.publish(kv_cache_usage=args.kv, num_running=0, num_waiting=args.waiting)
        writer.set_state(WorkerState.READY if not args.starting else WorkerState.STARTING)
    try:
        while True:
            await asyncio.sleep(0.1)
            if writer is not None and not args.no_heartbeat:
                writer.heartbeat()
    finally:
        if writer is not None:
            writer.release()
            seg.close()
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    """Run one fake agent until SIGTERM/SIGINT (releasing its slot on the way out)."""
    p = argparse.ArgumentParser(prog="python -m bench.fakes")
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--shm", help="segment to claim a slot in (omit with --no-shm behaviour)")
    p.add_argument("--uds")
    p.add_argument("--port", type=int)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--mode", default="ok")
    p.add_argument("--delay", type=float, default=0.05)
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--kv", type=float, default=0.1)
    p.add_argument("--waiting", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--starting", action="store_true", help="stay STARTING instead of READY")
    p.add_argument("--no-heartbeat", action="store_true")
    args = p.parse_args(argv)
    if not args.uds and not args.port:
        p.error("--uds or --port is required")
    import signal

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


# --------------------------------------------------------------------------------------------
# helpers for tests


@dataclass
class FakeHandle:
    """A started fake: ``proc`` (Popen), ``worker_id``, ``endpoint`` (socket path or host:port)."""

    proc: Any
    worker_id: int
    endpoint: str

    def client(self) -> FakeClient:
        return FakeClient(self.endpoint)


class FakeClient:
    """Synchronous httpx client to a fake's control endpoints."""

    def __init__(self, endpoint: str) -> None:
        import httpx

        if endpoint.startswith("/"):
            self._c = httpx.Client(transport=httpx.HTTPTransport(uds=endpoint), base_url="http://fake", timeout=10)
        else:
            self._c = httpx.Client(base_url=f"http://{endpoint}", timeout=10)

    def set_mode(self, mode: str | None = None, **kw: Any) -> None:
        """Change mode/delay/chunks/state (``reset_stats=True`` zeroes the counters)."""
        if mode is not None:
            kw["mode"] = mode
        self._c.post("/fake/mode", json=kw).raise_for_status()

    def stats(self) -> dict[str, Any]:
        """The fake's counters and last request."""
        return self._c.get("/fake/stats").json()

    def close(self) -> None:
        self._c.close()


def start_fake(procs: Any, shm: str | None, worker_id: int, run_dir: str, *args: str, port: int | None = None,
               wait: bool = True) -> FakeHandle:
    """Start ``python -m bench.fakes`` through ``procs`` (killed at teardown) and wait for its socket."""
    from launcher.stack import ROOT, wait_for_port, wait_for_unix_socket

    argv = [sys.executable, "-m", "bench.fakes", "--worker-id", str(worker_id)]
    if shm:
        argv += ["--shm", shm]
    if port is None:
        sock = os.path.join(run_dir, f"fake-{worker_id}.sock")
        argv += ["--uds", sock]
        endpoint = sock
    else:
        argv += ["--port", str(port)]
        endpoint = f"127.0.0.1:{port}"
    p = procs.start(argv + list(args), log=os.path.join(run_dir, f"fake-{worker_id}.log"), cwd=str(ROOT))
    if wait:
        if port is None:
            wait_for_unix_socket(endpoint, timeout=20)
        else:
            wait_for_port(port, timeout=20)
    return FakeHandle(p, worker_id, endpoint)


def start_router(procs: Any, shm: str, run_dir: str, config: dict[str, Any] | None = None, *args: str,
                 ready_workers: int = 1, timeout: float = 60.0) -> str:
    """Start ``python -m router`` on a free loopback port with ``config`` (a dplb.yaml as a dict)
    and wait until ``/dplb/status`` lists ``ready_workers`` eligible workers; returns the base URL."""
    import httpx
    import yaml

    from launcher.stack import ROOT, free_port, router_argv, wait_for

    port = free_port()
    cfg = dict(config or {})
    r = dict(cfg.get("router", {}))
    r.setdefault("state_dir", os.path.join(run_dir, f"router-{port}"))
    cfg["router"] = r
    path = Path(run_dir) / f"router-{port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = router_argv(port=port, shm=shm, config=path, extra=args)
    procs.start(argv, log=os.path.join(run_dir, f"router-{port}.log"), cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        rows = httpx.get(base + "/dplb/status", timeout=2).json()["workers"]
        return sum(1 for w in rows if w["eligible"]) >= ready_workers

    wait_for(ready, timeout, f"router {base} with {ready_workers} ready workers")
    return base


if __name__ == "__main__":
    sys.exit(main())
