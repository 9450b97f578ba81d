"""Generation endpoints: ``/v1/completions``, ``/v1/chat/completions`` (vLLM's OpenAI shapes) and
SGLang's ``/generate``; streaming as Server-Sent Events, one event per token written as the step
that computed it ends (so a client measures the model's inter-token latency), ``data: [DONE]`` last.
A chat stream's role-only event comes with the first token, after the prefill, as in vLLM.

Route handlers only parse, submit to the :class:`~sim_engine.runner.EngineRunner` and format; a
client that disconnects (stream or not) aborts its requests, which frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import AsyncIterator, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sim_engine.engine import EngineCore
from sim_engine.protocol import (
    GenParams,
    load_json,
    parse_chat,
    parse_completion,
    parse_generate,
)
from sim_engine.request import SimRequest
from sim_engine.runner import EngineRunner, OutputChannel

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def json_response(obj: object, status: int = 200, headers: dict | None = None) -> Response:
    """An ``application/json`` response encoded with orjson."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


class Generation:
    """One HTTP generation request: its engine requests (choices) and output channel."""

    def __init__(self, server: SimServer, params: GenParams, rid: str) -> None:
        self.server = server
        self.params = params
        self.rid = rid
        self.created = int(time.time())
        core = server.core
        self.reqs: list[SimRequest] = []
        bs = core.config.block_size
        for p_idx, prompt in enumerate(params.prompts):
            mt = params.max_tokens if params.max_tokens is not None else core.default_max_tokens(len(prompt))
            for j in range(params.n):
                i = p_idx * params.n + j
                sub = f"{rid}-{i}"
                if sub in core.requests:
                    sub = f"{sub}-{uuid.uuid4().hex[:8]}"
                self.reqs.append(SimRequest(sub, prompt, mt, bs, params.stop))
        self.prompt_tokens = sum(len(p) for p in params.prompts)
        self.headers = {"X-Request-Id": rid}  # echoed, as vLLM does with --enable-request-id-headers
        self.channel: OutputChannel = server.runner.submit(self.reqs)

    # ---- text helpers --------------------------------------------------------------------
    @staticmethod
    def final_text(req: SimRequest) -> str:
        """Generated text; for a stop finish, cut before the matched stop string (as vLLM does)."""
        full = "".join(" " + w for w in req.output)
        if req.finish_reason == "stop" and req.stop_matched:
            cut = full.find(req.stop_matched)
            if cut >= 0:
                return full[:cut]
        return full

    def delta(self, req: SimRequest, k: int) -> tuple[str, str | None]:
        """Text of token ``k`` (1-based) and the finish reason when it is the last one
        (``k == -1``: finished without a new token, empty text)."""
        if k < 0:
            return "", req.finish_reason
        if k == len(req.output) and req.finish_reason not in (None, "abort"):
            if req.finish_reason == "stop" and req.stop_matched:
                full = self.final_text(req)
                sent = sum(len(w) + 1 for w in req.output[:-1])
                return full[sent:], "stop"
            return " " + req.output[k - 1], req.finish_reason
        return " " + req.output[k - 1], None

    def usage(self) -> dict:
        """OpenAI ``usage`` object."""
        comp = sum(len(r.output) for r in self.reqs)
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + comp,
            "completion_tokens": comp,
            "prompt_tokens_details": None,
        }

    def abort(self) -> None:
        """Abort every unfinished choice (frees blocks now)."""
        self.server.runner.abort(self.reqs)

    # ---- waiting -------------------------------------------------------------------------
    async def wait_all(self, request: Request) -> bool:
        """Wait until every choice finished; False (after aborting) if the client went away."""
        ch = self.channel

        async def consume() -> None:
            while not ch.done:
                await ch.drain()

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (work, gone):
                t.cancel()
        # decided by the consumer, not by ch.done afterwards: an event pushed between the two
        # (abort_all at shutdown) must not turn a finished answer into a 499
        if work.done() and not work.cancelled() and work.exception() is None:
            return True
        self.abort()
        return False


async def wait_disconnect(request: Request) -> None:
    """Return when the ASGI server reports ``http.disconnect`` (body must already be read)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _chunk(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk_writer(base: dict, kind: str) -> Callable[[int, str, str | None], bytes]:
    """SSE token-chunk encoder for one response: the constant JSON around a token (id, object,
    created, model) is encoded once; per token only the index, text and finish reason are.

    ``kind``: ``"text"`` (``text_completion``: ``choices[0].text``) or ``"chat"``
    (``chat.completion.chunk``: ``choices[0].delta.content``). Returns ``write(index, text,
    finish_reason) -> b"data: {...}\\n\\n"`` — the same JSON ``orjson.dumps`` gives for the dict."""
    head = b"data: " + orjson.dumps({**base, "choices": []})[:-3] + b'[{"index":'
    if kind == "text":
        pre, post, end = b',"text":', b',"logprobs":null,"finish_reason":', b',"stop_reason":null}]}\n\n'
    else:
        pre, post, end = b',"delta":{"content":', b'},"logprobs":null,"finish_reason":', b"}]}\n\n"
    dumps = orjson.dumps

    def write(idx: int, text: str, fr: str | None) -> bytes:
        return b"".join(
            (head, str(idx).encode(), pre, dumps(text), post, b"null" if fr is None else dumps(fr), end)
        )

    return write


async def _sse(
    gen: Generation,
    make_chunk: Callable[[int, str, str | None], bytes],
    role_chunk: Callable[[int], bytes] | None,
    usage_chunk: Callable[[], dict] | None,
) -> AsyncIterator[bytes]:
    """SSE body: one event per token, each its own write, as the engine's steps produce them;
    then usage (if asked), then [DONE]. ``role_chunk(index)`` (chat): the role-only event each
    choice sends just before its first token, as vLLM does (its first output after the prefill),
    never before the prefill. Cancellation (client gone) aborts the unfinished choices in ``finally``."""
    try:
        ch = gen.channel
        started: set[int] = set()
        while not ch.done:
            for idx, req, k in await ch.drain():
                if role_chunk is not None and idx not in started:
                    started.add(idx)
                    yield role_chunk(idx)
                text, fr = gen.delta(req, k)
                yield make_chunk(idx, text, fr)
        if usage_chunk is not None:
            yield _chunk(usage_chunk())
        yield b"data: [DONE]\n\n"
    finally:
        gen.abort()


class Routes:
    """Collects Starlette routes with FastAPI-style decorators (``@r.get(path)``, ``@r.post(path)``).

    Endpoints are coroutines taking the :class:`Request` (or nothing). Plain Starlette instead of
    FastAPI keeps engine start-up at ~0.1 s of imports instead of ~1.5 s (FastAPI's pydantic/OpenAPI
    models), which matters when a launcher starts eight engines on two cores; the engine uses none
    of FastAPI's validation or docs."""

    def __init__(self) -> None:
        self.routes: list[Route] = []

    def route(self, path: str, methods: list[str]) -> Callable:
        """Register the decorated coroutine for ``path`` and ``methods``."""

        def deco(fn: Callable) -> Callable:
            if fn.__code__.co_argcount == 0:
                inner = fn

                async def endpoint(request: Request) -> Response:
                    return await inner()

            else:
                endpoint = fn
            self.routes.append(Route(path, endpoint, methods=methods))
            return fn

        return deco

    def get(self, path: str) -> Callable:
        """``@r.get(path)``."""
        return self.route(path, ["GET"])

    def post(self, path: str) -> Callable:
        """``@r.post(path)``."""
        return self.route(path, ["POST"])


def build_router(server: SimServer) -> Routes:
    """Routes for the generation endpoints of ``server``."""
    r = Routes()
    model = server.config.model

    def rid_for(request: Request, prefix: str) -> str:
        h = request.headers.get("x-request-id")
        return h if h else f"{prefix}-{uuid.uuid4().hex}"

    @r.post("/v1/completions")
    async def completions(request: Request) -> Response:
        """POST /v1/completions (vLLM/OpenAI shape); SSE when ``stream``."""
        params = parse_completion(load_json(await request.body()), model)
        gen = Generation(server, params, rid_for(request, "cmpl"))
        base = {"id": gen.rid, "object": "text_completion", "created": gen.created, "model": model}
        if params.stream:
            mk = chunk_writer(base, "text")
            uc = (lambda: {**base, "choices": [], "usage": gen.usage()}) if params.include_usage else None
            return EngineStream(server, gen, _sse(gen, mk, None, uc))
        async with server.load():
            if not await gen.wait_all(request):
                return Response(status_code=499)
        choices = [
            {
                "index": i,
                "text": gen.final_text(q),
                "logprobs": None,
                "finish_reason": q.finish_reason,
                "stop_reason": q.stop_matched,
            }
            for i, q in enumerate(gen.reqs)
        ]
        return json_response({**base, "choices": choices, "usage": gen.usage()}, headers=gen.headers)

    @r.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        """POST /v1/chat/completions (vLLM/OpenAI shape); SSE when ``stream``."""
        params = parse_chat(load_json(await request.body()), model)
        gen = Generation(server, params, rid_for(request, "chatcmpl"))
        if params.stream:
            base = {"id": gen.rid, "object": "chat.completion.chunk", "created": gen.created, "model": model}
            mk = chunk_writer(base, "chat")

            def role(i: int) -> bytes:
                return _chunk({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})

            uc = (lambda: {**base, "choices": [], "usage": gen.usage()}) if params.include_usage else None
            return EngineStream(server, gen, _sse(gen, mk, role, uc))
        async with server.load():
            if not await gen.wait_all(request):
                return Response(status_code=499)
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": gen.final_text(q), "tool_calls": []},
                "logprobs": None,
                "finish_reason": q.finish_reason,
                "stop_reason": q.stop_matched,
            }
            for i, q in enumerate(gen.reqs)
        ]
        return json_response(
            {
                "id": gen.rid,
                "object": "chat.completion",
                "created": gen.created,
                "model": model,
                "choices": choices,
                "usage": gen.usage(),
            },
            headers=gen.headers,
        )

    @r.route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        """POST /generate (SGLang shape: ``text``/``input_ids``, ``sampling_params``, ``stream``)."""
        params = parse_generate(load_json(await request.body()))
        gen = Generation(server, params, params.request_id or uuid.uuid4().hex)
        t0 = time.monotonic()

        def meta(q: SimRequest) -> dict:
            fr = None
            if q.finish_reason == "length":
                fr = {"type": "length", "length": len(q.output)}
            elif q.finish_reason == "stop":
                fr = {"type": "stop", "matched": q.stop_matched}
            elif q.finish_reason == "abort":
                fr = {"type": "abort", "message": "aborted"}
            return {
                "id": q.request_id,
                "finish_reason": fr,
                "prompt_tokens": q.num_prompt_tokens,
                "completion_tokens": len(q.output),
                "cached_tokens": q.num_cached_tokens,
                "e2e_latency": time.monotonic() - t0,
            }

        if params.stream:

            async def body() -> AsyncIterator[bytes]:
                try:
                    ch = gen.channel
                    while not ch.done:
                        for idx, q, k in await ch.drain():
                            text = "".join(" " + w for w in q.output[:k])
                            if (k < 0 or k == len(q.output)) and q.finish_reason is not None:
                                text = gen.final_text(q)
                            yield _chunk({"text": text, "index": idx, "meta_info": meta(q)})
                    yield b"data: [DONE]\n\n"
                finally:
                    gen.abort()

            return EngineStream(server, gen, body())
        async with server.load():
            if not await gen.wait_all(request):
                return Response(status_code=499)
        outs = [{"text": gen.final_text(q), "meta_info": meta(q), "index": i} for i, q in enumerate(gen.reqs)]
        return json_response(outs[0] if len(outs) == 1 else outs, headers=gen.headers)

    return r


class SimServer:
    """Process-wide state shared by the routes: config, core, runner, metrics registry, load count."""

    def __init__(self, core: EngineCore, runner: EngineRunner) -> None:
        self.core = core
        self.config = core.config
        self.runner = runner
        self.server_load = 0  # HTTP generation requests in progress (vLLM's /load)
        self.get_load_format = "sglang"  # or "vllm": shape of GET /get_load
        # how often routers called the peer endpoints (shown in /sim/state; tests check them)
        self.peer_calls: collections.Counter[str] = collections.Counter()
        self.started = time.time()

    def load(self) -> _LoadGuard:
        """Context manager counting one in-progress request for ``/load``."""
        return _LoadGuard(self)


class EngineStream(StreamingResponse):
    """An SSE response bound to a :class:`Generation`: counts in ``/load`` while it runs and aborts
    the generation's unfinished choices however the response ends (client gone before or during
    the body, server shutdown, error) — even when the body generator never started."""

    def __init__(self, server: SimServer, gen: Generation, body: AsyncIterator[bytes]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **gen.headers})
        self.server = server
        self.gen = gen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.server.server_load += 1
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.server.server_load -= 1
            self.gen.abort()


class _LoadGuard:
    def __init__(self, s: SimServer) -> None:
        self.s = s

    async def __aenter__(self) -> None:
        self.s.server_load += 1

    async def __aexit__(self, *exc: object) -> None:
        self.s.server_load -= 1
