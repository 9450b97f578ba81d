"""The load generator: sends prepared OpenAI requests and times them on the client side.

Two shapes:

- open loop (:func:`run_open`): request ``i`` leaves at ``start + spec.at`` whatever happens to
  the others (trace replay, Poisson arrivals, a burst at t=0);
- sessions (:func:`run_sessions`): each conversation's first turn leaves at its ``at``, every later
  turn ``think`` seconds after the previous turn's answer ended (closed loop per user);
- closed loop (:func:`run_closed`): ``concurrency`` clients each send the next request as soon as
  their previous one ended (router overhead, scaling).

Times (seconds, ``time.perf_counter``): TTFT = request sent → first SSE chunk carrying content
(non-streaming: = e2e); e2e = request sent → last byte. Output tokens come from the response's
``usage.completion_tokens`` (streams ask for it with ``stream_options.include_usage``), falling
back to the number of content chunks. A request is an error when the status is not 200, the
connection fails, it times out, or a stream ends without ``data: [DONE]``.

Bodies are serialized with orjson before the clock starts, so the client's own CPU stays small.
One aiohttp session per run, keep-alive connections, no connection limit.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

WORKER_HEADER = "X-DPLB-Worker-ID"


@dataclass(frozen=True)
class RequestSpec:
    """One request to send.

    ``at``: send offset in seconds from the run's start (open loop; ignored in closed loop);
    ``path``: e.g. ``/v1/chat/completions``; ``body``: the JSON body already encoded;
    ``stream``: whether the body asks for SSE; ``tag``: free label (e.g. ``"long"``) for analysis;
    ``session``: conversation id for :func:`run_sessions` (−1: none); ``think``: seconds between
    the previous turn's end and this turn's send in :func:`run_sessions` (0 for a first turn);
    ``headers``: extra request headers (e.g. a priority class), ``(name, value)`` pairs.
    """

    at: float
    path: str
    body: bytes
    stream: bool
    tag: str = ""
    session: int = -1
    think: float = 0.0
    headers: tuple[tuple[str, str], ...] = ()


@dataclass
class Result:
    """What the client saw for one request (seconds; ``ttft``/``e2e`` are ``None`` on error)."""

    ok: bool
    status: int
    sent_at: float
    ttft: float | None
    e2e: float | None
    output_tokens: int
    worker: str | None
    tag: str
    error: str = ""


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int, stream: bool, **extra: object) -> bytes:
    """An OpenAI chat-completions body (orjson bytes); streams ask for the usage chunk.

    ``temperature`` 0 and ``ignore_eos`` so every engine generates exactly ``max_tokens``.
    """
    body: dict[str, object] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                               "temperature": 0.0, "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return orjson.dumps(body)


async def _one(session: aiohttp.ClientSession, base: str, spec: RequestSpec, t0: float,
               timeout_s: float) -> Result:
    sent = time.perf_counter()
    ttft: float | None = None
    status = 0
    worker: str | None = None
    try:
        async with session.post(base + spec.path, data=spec.body,
                                headers={"Content-Type": "application/json", **dict(spec.headers)},
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            status = resp.status
            worker = resp.headers.get(WORKER_HEADER)
            if status != 200:
                text = (await resp.read())[:300].decode("utf-8", "replace")
                return Result(False, status, sent - t0, None, None, 0, worker, spec.tag, f"HTTP {status}: {text}")
            if not spec.stream:
                data = orjson.loads(await resp.read())
                end = time.perf_counter()
                usage = data.get("usage") or {}
                return Result(True, status, sent - t0, end - sent, end - sent,
                              int(usage.get("completion_tokens") or 0), worker, spec.tag)
            chunks = 0
            usage_tokens: int | None = None
            done = False
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                if ttft is not None and b'"usage":{' not in payload:
                    chunks += 1 if b'"content":"' in payload and b'"content":""' not in payload else 0
                    continue
                obj = orjson.loads(payload)
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    text = (c.get("delta") or {}).get("content") or c.get("text") or ""
                    if text:
                        chunks += 1
                        if ttft is None:
                            ttft = time.perf_counter() - sent
                usage = obj.get("usage")
                if usage:
                    usage_tokens = int(usage.get("completion_tokens") or 0)
            end = time.perf_counter()
            if not done:
                return Result(False, status, sent - t0, None, None, 0, worker, spec.tag, "stream ended without [DONE]")
            if ttft is None:  # zero-token answer: first byte is the end
                ttft = end - sent
            return Result(True, status, sent - t0, ttft, end - sent,
                          usage_tokens if usage_tokens is not None else chunks, worker, spec.tag)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return Result(False, status, sent - t0, None, None, 0, worker, spec.tag, f"{type(e).__name__}: {e}")


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=None),
                                 read_bufsize=1 << 18, auto_decompress=False)


async def run_open(base: str, specs: Sequence[RequestSpec], timeout_s: float = 600.0) -> tuple[list[Result], float]:
    """Send every spec at its ``at`` offset; return ``(results in spec order, wall seconds)``.

    Wall seconds run from the first send to the last completion.
    """
    async with _session() as session:
        t0 = time.perf_counter()
        tasks = []
        for spec in sorted(specs, key=lambda s: s.at):
            delay = t0 + spec.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, base, spec, t0, timeout_s)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


async def run_closed(base: str, specs: Sequence[RequestSpec], concurrency: int,
                     timeout_s: float = 600.0) -> tuple[list[Result], float]:
    """Send the specs in order from ``concurrency`` loops; return ``(results, wall seconds)``."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    results: list[Result | None] = [None] * len(specs)
    it = iter(range(len(specs)))

    async with _session() as session:
        t0 = time.perf_counter()

        async def loop() -> None:
            for i in it:
                results[i] = await _one(session, base, specs[i], t0, timeout_s)

        await asyncio.gather(*(loop() for _ in range(min(concurrency, len(specs)) or 1)))
        return [r for r in results if r is not None], time.perf_counter() - t0


async def run_sessions(base: str, specs: Sequence[RequestSpec], timeout_s: float = 600.0) -> tuple[list[Result], float]:
    """Replay conversations closed-loop; return ``(results in spec order, wall seconds)``.

    Specs with the same ``session`` form one conversation, in list order. Its first turn is sent
    at ``start + at``; each later turn ``think`` seconds after the previous one finished (an
    error ends nothing: the user still sends the next turn). Specs with ``session`` −1 are sent
    open-loop at their offset. Wall seconds run from the start to the last completion.
    """
    results: list[Result | None] = [None] * len(specs)
    convs: dict[int, list[int]] = {}
    for i, s in enumerate(specs):
        convs.setdefault(s.session if s.session >= 0 else -1 - i, []).append(i)

    async with _session() as session:
        t0 = time.perf_counter()

        async def user(idx: list[int]) -> None:
            delay = t0 + specs[idx[0]].at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for k, i in enumerate(idx):
                if k and specs[i].think > 0:
                    await asyncio.sleep(specs[i].think)
                results[i] = await _one(session, base, specs[i], t0, timeout_s)

        await asyncio.gather(*(user(idx) for idx in convs.values()))
        return [r for r in results if r is not None], time.perf_counter() - t0
