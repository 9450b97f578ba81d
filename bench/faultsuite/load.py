"""Client side of the fault scenarios: send requests, classify every outcome, count.

Every request ends in exactly one class (what the issue asks the suite to count):

``ok``
    200 and a complete answer: a JSON body with ``choices`` (or SGLang's ``text``), or an SSE
    stream whose last event is ``data: [DONE]`` and that carries no error event.
``honest``
    failed with an honest error: a 4xx/5xx whose body is OpenAI-shaped
    (``{"error": {"message", "type", "param", "code"}}``), or a stream that ends with an SSE error
    event carrying that shape.
``lost``
    anything else: connection reset or refused, a client-side timeout (a hang), a stream cut
    without an error event or ``[DONE]``, a 200 with a body that is not an answer, an error body
    that is not OpenAI-shaped.

    outs = asyncio.run(steady(base, rate=40, duration=4, body=lambda i: chat(stream=i % 2 == 0)))
    tally(outs)   # {"sent": 160, "ok": 158, "honest": 2, "lost": 0}
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

CHAT = "/v1/chat/completions"


@dataclass
class Outcome:
    """One request: times are ``time.monotonic()`` seconds; ``worker`` is ``X-DPLB-Worker-ID``."""

    t_start: float
    t_end: float
    stream: bool
    kind: str = "lost"
    status: int | None = None
    worker: str | None = None
    detail: str = ""
    t_first: float | None = None
    body: bytes = b""
    #: the answer's headers (names lower-case), empty when no head came
    headers: dict[str, str] = field(default_factory=dict)


def chat(stream: bool = False, model: str | None = None, words: int = 8, max_tokens: int = 16, tag: Any = None,
         **extra: Any) -> dict[str, Any]:
    """A chat completion body (``words`` prompt words, ``max_tokens`` output tokens). ``tag``
    starts the prompt, so requests with different tags share no prefix (no cache affinity)."""
    text = " ".join([f"r{tag}"] * (tag is not None) + [f"w{i}" for i in range(words)])
    d: dict[str, Any] = {"messages": [{"role": "user", "content": text}],
                         "max_tokens": max_tokens, "stream": stream}
    if model:
        d["model"] = model
    d.update(extra)
    return d


def openai_error(obj: Any) -> bool:
    """True when ``obj`` is ``{"error": {"message": str (non-empty), "type", "param", "code"}}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("error"), dict):
        return False
    e = obj["error"]
    return {"message", "type", "param", "code"} <= set(e) and isinstance(e["message"], str) and bool(e["message"])


def sse_events(raw: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order (``[DONE]`` included, as bytes)."""
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                out.append(line[5:].strip())
    return out


def classify(o: Outcome) -> Outcome:
    """Fill ``o.kind``/``o.detail`` from ``o.status`` and ``o.body`` (see the module docstring)."""
    raw = o.body
    if o.status is None:
        o.kind = "lost"
        return o
    if o.status >= 400:
        try:
            ok = openai_error(orjson.loads(raw))
        except orjson.JSONDecodeError:
            ok = False
        o.kind = "honest" if ok else "lost"
        o.detail = o.detail or f"{o.status}: {raw[:200]!r}"
        return o
    if o.stream:
        ev = sse_events(raw)
        for e in ev:
            if e.startswith(b"{") and b'"error"' in e:
                try:
                    if openai_error(orjson.loads(e)):
                        o.kind, o.detail = "honest", f"sse error: {e[:200]!r}"
                        return o
                except orjson.JSONDecodeError:
                    pass
        if ev and ev[-1] == b"[DONE]":
            o.kind = "ok"
        else:
            o.kind, o.detail = "lost", f"stream cut after {len(ev)} events: {raw[-200:]!r}"
        return o
    try:
        d = orjson.loads(raw)
        good = isinstance(d, dict) and ("choices" in d or "text" in d)
    except orjson.JSONDecodeError:
        good = False
    o.kind = "ok" if good else "lost"
    if not good:
        o.detail = f"200 with a body that is no answer: {raw[:200]!r}"
    return o


async def send(client: httpx.AsyncClient, body: dict[str, Any] | bytes, path: str = CHAT,
               headers: dict[str, str] | None = None, timeout: float = 30.0,
               on_first: Callable[[Outcome], None] | None = None) -> Outcome:
    """Send one request through ``client`` and classify it. ``timeout``: the whole request (a
    request still running after it counts as lost: a hang). ``on_first`` runs at the first body chunk.
    The outcome keeps the answer's body and headers (``Outcome.headers``)."""
    stream = isinstance(body, dict) and bool(body.get("stream"))
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    hs = {"content-type": "application/json", **(headers or {})}
    o = Outcome(time.monotonic(), 0.0, stream)
    parts: list[bytes] = []
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", path, content=content, headers=hs) as r:
                o.status = r.status_code
                o.worker = r.headers.get("x-dplb-worker-id")
                o.headers = {k.lower(): v for k, v in r.headers.items()}
                async for chunk in r.aiter_raw():
                    if o.t_first is None:
                        o.t_first = time.monotonic()
                        if on_first is not None:
                            on_first(o)
                    parts.append(chunk)
    except TimeoutError:
        o.status, o.detail = None, f"no complete answer within {timeout}s (hang)"
    except httpx.HTTPError as e:
        o.status, o.detail = None, f"{type(e).__name__}: {e}"
    o.body = b"".join(parts)
    o.t_end = time.monotonic()
    return classify(o)


async def steady(base: str, rate: float, duration: float, body: Callable[[int], dict[str, Any]],
                 path: str = CHAT, timeout: float = 30.0,
                 headers: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
                 events: dict[float, Callable[[], Any]] | None = None) -> list[Outcome]:
    """Open-loop load: one request every ``1/rate`` s for ``duration`` s (``body(i)`` builds
    request ``i``; ``headers`` a dict or ``headers(i)``); ``events`` maps an offset in seconds to a callable run (in a thread) at that
    time, e.g. ``{1.5: kill_engine}``. Returns every request's outcome once all have ended."""
    n = max(1, int(rate * duration))
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=httpx.Timeout(timeout)) as client:
        t0 = time.monotonic()
        tasks: list[asyncio.Task] = []
        pending = sorted((events or {}).items())
        ev_tasks = []
        for i in range(n):
            due = t0 + i / rate
            while pending and t0 + pending[0][0] <= due:
                at, fn = pending.pop(0)
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                ev_tasks.append(asyncio.ensure_future(asyncio.to_thread(fn)))
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            hs = headers(i) if callable(headers) else headers
            tasks.append(asyncio.ensure_future(send(client, body(i), path, hs, timeout)))
        for at, fn in pending:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            ev_tasks.append(asyncio.ensure_future(asyncio.to_thread(fn)))
        outs = list(await asyncio.gather(*tasks))
        await asyncio.gather(*ev_tasks)
        return outs


def tally(outs: list[Outcome]) -> dict[str, int]:
    """``{"sent", "ok", "honest", "lost"}`` counts of ``outs``."""
    c = Counter(o.kind for o in outs)
    return {"sent": len(outs), "ok": c["ok"], "honest": c["honest"], "lost": c["lost"]}


def lost_details(outs: list[Outcome], n: int = 5) -> list[str]:
    """The first ``n`` lost requests, described (for assertion messages)."""
    return [f"{o.status} w={o.worker} {o.detail}" for o in outs if o.kind == "lost"][:n]
