"""Replay a Mooncake trace against an OpenAI-compatible endpoint with the official ``openai`` client.

``python -m bench.replay [TRACE] --url http://127.0.0.1:30000/v1 --limit 1000 --time-scale 0.5``
(console script ``dplb-replay``). Every request is sent by ``openai.AsyncOpenAI`` at
``timestamp × time_scale`` seconds after the start (open loop: a slow server does not slow the
arrivals), streamed by default, with ``max_tokens = output_length`` and the prompt text of
:func:`dplb_trace.mooncake.prompt_for` (prefix sharing of the trace preserved).

Measured per request (client side, ``time.perf_counter``):

- TTFT: from just before the request is sent to the first chunk that carries text;
- end-to-end latency (e2e): from send to the end of the stream;
- TPOT: ``(e2e − TTFT) / (output tokens − 1)`` (vLLM's ``benchmark_serving`` definition);
- output tokens: ``usage.completion_tokens`` from the final chunk when the server sends usage
  (``stream_options.include_usage``), else the number of text-carrying chunks;
- the worker that served it: the ``X-DPLB-Worker-ID`` response header;
- send lag: how late the request left compared with its schedule (a large lag means the client,
  not the server, limited the rate).

Report (:func:`summarize`): p50/p90/p99 of TTFT, e2e and TPOT, output tokens/s (all output
tokens / wall time from the first scheduled send to the last completion), requests/s, errors by
type, and each worker's share; printed as a table, written as JSON with ``--json-out``. Exit
status: 0 when every request succeeded, 1 when any failed, 2 when the replay could not start.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import orjson

from bench.errors import BenchError, ReplayError
from dplb_protocol.wire import WORKER_HEADER
from dplb_trace.errors import TraceFormatError
from dplb_trace.mooncake import DEFAULT_TRACE, TraceRequest, load_trace, prompt_for
from launcher.cli import DefaultsFormatter


@dataclass
class RequestResult:
    """Outcome of one replayed request; times in seconds, ``None`` when not measured."""

    index: int
    ok: bool
    input_tokens: int
    max_tokens: int
    output_tokens: int = 0
    worker_id: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    scheduled_s: float = 0.0
    send_lag_s: float = 0.0
    error: str | None = None


@dataclass
class ReplayOptions:
    """How to replay (see the CLI flags of the same names)."""

    base_url: str = "http://127.0.0.1:30000/v1"
    model: str | None = None
    api: str = "chat"  # "chat" → /v1/chat/completions, "completions" → /v1/completions
    stream: bool = True
    time_scale: float = 1.0
    max_tokens_cap: int | None = None
    timeout_s: float = 600.0
    api_key: str | None = None
    include_usage: bool = True
    ignore_eos: bool = False
    max_concurrency: int | None = None
    typed_chunks: bool = False  # decode chunks into the client's pydantic types (slower)
    extra_headers: dict[str, str] = field(default_factory=dict)


def normalize_base_url(url: str) -> str:
    """``http://h:p`` → ``http://h:p/v1``; a URL that already has a path is kept as is."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ReplayError(url, "the URL must look like http://127.0.0.1:30000/v1")
    return url.rstrip("/") + "/v1" if parts.path in ("", "/") else url.rstrip("/")


#: the API key the client sends when neither ``ReplayOptions.api_key`` nor ``OPENAI_API_KEY`` gives one
DEFAULT_API_KEY = "dplb-replay"


def api_key(explicit: str | None = None) -> str:
    """The API key the replay client sends (``Authorization: Bearer ...``): ``explicit``, else the
    ``OPENAI_API_KEY`` environment variable, else :data:`DEFAULT_API_KEY`. The router's admission
    queue takes a request without another tenant key for the tenant of this key's digest
    (docs/admission.md), so a harness request that is not part of the measured load sends the same
    key (:func:`bench.systems.probe`)."""
    return explicit or os.environ.get("OPENAI_API_KEY") or DEFAULT_API_KEY


def make_client(opts: ReplayOptions) -> openai.AsyncOpenAI:
    """An ``AsyncOpenAI`` client for ``opts`` with retries off (a retried request would hide errors)."""
    return openai.AsyncOpenAI(base_url=normalize_base_url(opts.base_url), api_key=api_key(opts.api_key),
                              max_retries=0, timeout=opts.timeout_s)


async def resolve_model(client: openai.AsyncOpenAI, model: str | None) -> str:
    """``model`` itself, or the first id that ``GET /v1/models`` lists; :class:`ReplayError` if none."""
    if model:
        return model
    try:
        page = await client.models.list()
    except openai.OpenAIError as e:
        raise ReplayError(str(client.base_url), f"cannot list models ({type(e).__name__}: {e})") from None
    ids = [m.id for m in page.data]
    if not ids:
        raise ReplayError(str(client.base_url), "GET /v1/models lists no model")
    return ids[0]


class StreamError(Exception):
    """An SSE stream that carried an ``error`` event or a line that is not JSON."""


async def _sse_objects(resp: Any) -> Any:
    """Yield the JSON object of every ``data:`` line of an OpenAI SSE stream until ``[DONE]``.

    The transport is the openai client's own response; decoding with orjson instead of building
    a pydantic chunk object per token keeps the client from becoming the bottleneck (about 3×
    less client CPU per token here). Raises :class:`StreamError` on an ``error`` event.
    """
    async for line in resp.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise StreamError(f"not JSON: {data[:100]!r}") from None
        if isinstance(obj, dict) and obj.get("error"):
            err = obj["error"]
            raise StreamError(str(err.get("message", err) if isinstance(err, dict) else err)[:200])
        if isinstance(obj, dict):
            yield obj


def _error_text(e: BaseException) -> str:
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {str(e.message)[:200]}"
    return f"{type(e).__name__}: {str(e)[:200]}"


async def send_one(client: openai.AsyncOpenAI, model: str, req: TraceRequest, prompt: str,
                   opts: ReplayOptions) -> RequestResult:
    """Send one request (streamed or not) and measure it; never raises for server errors."""
    max_tokens = req.output_length if opts.max_tokens_cap is None else min(req.output_length, opts.max_tokens_cap)
    res = RequestResult(index=req.index, ok=False, input_tokens=req.input_length, max_tokens=max_tokens)
    kw: dict[str, Any] = {"model": model, "max_tokens": max_tokens}
    extra_body = {"ignore_eos": True} if opts.ignore_eos else None
    if extra_body:
        kw["extra_body"] = extra_body
    if opts.extra_headers:
        kw["extra_headers"] = opts.extra_headers
    chat = opts.api == "chat"
    api = client.chat.completions if chat else client.completions
    if chat:
        kw["messages"] = [{"role": "user", "content": prompt}]
    else:
        kw["prompt"] = prompt
    t0 = time.perf_counter()
    try:
        if opts.stream:
            if opts.include_usage:
                kw["stream_options"] = {"include_usage": True}
            chunks = 0
            usage_tokens: int | None = None
            async with api.with_streaming_response.create(stream=True, **kw) as resp:
                res.worker_id = resp.headers.get(WORKER_HEADER)
                if opts.typed_chunks:
                    stream = await resp.parse()
                    async for chunk in stream:
                        if getattr(chunk, "usage", None) is not None and chunk.usage.completion_tokens is not None:
                            usage_tokens = int(chunk.usage.completion_tokens)
                        for choice in chunk.choices:
                            text = choice.delta.content if chat else choice.text
                            if text:
                                if res.ttft_s is None:
                                    res.ttft_s = time.perf_counter() - t0
                                chunks += 1
                else:
                    async for obj in _sse_objects(resp):
                        usage = obj.get("usage")
                        if usage and usage.get("completion_tokens") is not None:
                            usage_tokens = int(usage["completion_tokens"])
                        for choice in obj.get("choices") or ():
                            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                            if text:
                                if res.ttft_s is None:
                                    res.ttft_s = time.perf_counter() - t0
                                chunks += 1
            res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        else:
            raw = await api.with_raw_response.create(**kw)
            res.worker_id = raw.headers.get(WORKER_HEADER)
            body = raw.parse()
            if body.usage is not None:
                res.output_tokens = int(body.usage.completion_tokens)
            else:
                text = body.choices[0].message.content if chat else body.choices[0].text
                res.output_tokens = len((text or "").split())
        res.e2e_s = time.perf_counter() - t0
        res.ok = True
    except (TimeoutError, openai.OpenAIError, OSError, StreamError) as e:
        res.e2e_s = time.perf_counter() - t0
        res.error = _error_text(e)
    return res


async def replay(requests: Sequence[TraceRequest], opts: ReplayOptions,
                 progress: Callable[[int, int, int], None] | None = None) -> tuple[list[RequestResult], float, str]:
    """Replay ``requests`` open-loop on their (scaled) timestamps.

    Returns ``(results in trace order, wall seconds from the first scheduled send to the last
    completion, model name used)``. ``progress(sent, done, errors)`` is called about once per
    second when given. Raises :class:`ReplayError` when the endpoint cannot be reached at all.
    """
    if opts.time_scale < 0:
        raise ValueError(f"time_scale must be >= 0 (got {opts.time_scale})")
    client = make_client(opts)
    try:
        model = await resolve_model(client, opts.model)
        sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
        results: list[RequestResult | None] = [None] * len(requests)
        done = Counter[str]()
        loop = asyncio.get_running_loop()
        start = loop.time() + 0.05
        t_first = requests[0].timestamp_ms if requests else 0.0

        async def run(pos: int, req: TraceRequest, prompt: str, sched: float) -> None:
            if sem is not None:
                await sem.acquire()
            try:
                lag = max(0.0, loop.time() - (start + sched))
                r = await send_one(client, model, req, prompt, opts)
                r.scheduled_s, r.send_lag_s = sched, lag
                results[pos] = r
                done["ok" if r.ok else "err"] += 1
            finally:
                if sem is not None:
                    sem.release()

        async def report() -> None:
            while True:
                await asyncio.sleep(1.0)
                if progress:
                    progress(sent, done["ok"] + done["err"], done["err"])

        tasks: list[asyncio.Task[None]] = []
        sent = 0
        reporter = asyncio.create_task(report())
        try:
            for pos, req in enumerate(requests):
                sched = (req.timestamp_ms - t_first) / 1000.0 * opts.time_scale
                prompt = prompt_for(req)  # built while waiting for the send time
                delay = start + sched - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run(pos, req, prompt, sched)))
                sent += 1
            await asyncio.gather(*tasks)
        finally:
            reporter.cancel()
            for t in tasks:
                t.cancel()
        wall = loop.time() - start
        if progress:
            progress(sent, done["ok"] + done["err"], done["err"])
        return [r for r in results if r is not None], wall, model
    finally:
        await client.close()


def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99/mean/max of ``values`` × ``scale`` (inclusive quantiles, as numpy's linear)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    v = sorted(x * scale for x in values)
    if len(v) == 1:
        q = [v[0]] * 99
    else:
        q = statistics.quantiles(v, n=100, method="inclusive")
    return {"p50": round(q[49], 3), "p90": round(q[89], 3), "p99": round(q[98], 3),
            "mean": round(statistics.fmean(v), 3), "max": round(v[-1], 3)}


def summarize(results: Sequence[RequestResult], wall_s: float, **meta: Any) -> dict[str, Any]:
    """The replay report as a JSON-ready dict (times in ms, throughputs per second).

    Keys: ``requests, completed, errors, error_types, wall_s, request_throughput_rps,
    input_tokens_total, output_tokens_total, output_tokens_per_s, ttft_ms, e2e_ms, tpot_ms,
    send_lag_ms`` (each ``{p50, p90, p99, mean, max}``), ``workers`` (id → ``{requests, share,
    errors}``), plus ``meta`` as given.
    """
    ok = [r for r in results if r.ok]
    errs = [r for r in results if not r.ok]
    tpot = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1]
    out_total = sum(r.output_tokens for r in ok)
    by_worker = Counter(r.worker_id or "?" for r in results)
    err_by_worker = Counter(r.worker_id or "?" for r in errs)
    n = len(results)
    workers = {w: {"requests": c, "share": round(c / n, 4) if n else 0.0, "errors": err_by_worker.get(w, 0)}
               for w, c in sorted(by_worker.items(), key=lambda kv: (len(kv[0]), kv[0]))}
    return {
        **meta,
        "requests": n,
        "completed": len(ok),
        "errors": len(errs),
        "error_types": dict(Counter((r.error or "").split(":")[0] for r in errs)),
        "first_errors": [f"#{r.index}: {r.error}" for r in errs[:5]],
        "wall_s": round(wall_s, 3),
        "request_throughput_rps": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "input_tokens_total": sum(r.input_tokens for r in ok),
        "output_tokens_total": out_total,
        "output_tokens_per_s": round(out_total / wall_s, 1) if wall_s > 0 else None,
        "ttft_ms": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "e2e_ms": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "tpot_ms": _pcts(tpot),
        "send_lag_ms": _pcts([r.send_lag_s for r in results]),
        "workers": workers,
    }


def format_table(s: dict[str, Any]) -> str:
    """A plain-text table of a :func:`summarize` report."""
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:,.1f}" if isinstance(v, float) else str(v))

    lines = [(f"requests {s['requests']}  completed {s['completed']}  errors {s['errors']}"
              f"  wall {s['wall_s']:.1f} s  {f(s['request_throughput_rps'])} req/s"
              f"  output {s['output_tokens_total']:,} tok  {f(s['output_tokens_per_s'])} tok/s"),
             f"{'metric':<14}{'p50':>12}{'p90':>12}{'p99':>12}{'mean':>12}{'max':>12}"]
    for key, label in (("ttft_ms", "TTFT ms"), ("e2e_ms", "e2e ms"), ("tpot_ms", "TPOT ms"),
                       ("send_lag_ms", "send lag ms")):
        d = s[key]
        lines.append(f"{label:<14}" + "".join(f"{f(d[k]):>12}" for k in ("p50", "p90", "p99", "mean", "max")))
    lines.append(f"{'worker':<14}{'requests':>12}{'share':>12}{'errors':>12}")
    for w, d in s["workers"].items():
        lines.append(f"{w:<14}{d['requests']:>12}{d['share'] * 100:>11.1f}%{d['errors']:>12}")
    if s["errors"]:
        lines.append("errors: " + ", ".join(f"{k} ×{v}" for k, v in s["error_types"].items()))
        lines.extend("  " + e for e in s["first_errors"])
    return "\n".join(lines)

def build_parser() -> argparse.ArgumentParser:
    """The ``dplb-replay`` command line."""
    p = argparse.ArgumentParser(allow_abbrev=False, prog="dplb-replay", description=__doc__.split("\n\n")[0],
                                formatter_class=DefaultsFormatter)
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE),
                   help="Mooncake-format JSONL trace (default: the conversation trace shipped in "
                        "dplb_trace/data/mooncake/, see its README)")
    p.add_argument("--url", default="http://127.0.0.1:30000/v1", help="OpenAI base URL of the endpoint")
    p.add_argument("--model", default=None, help="model name (default: the first one GET /v1/models lists)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="send each request at timestamp × this factor (0.1 = ten times faster, 0 = all at once)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="send non-streamed requests")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="cap every request's max_tokens")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most N requests in flight (makes the replay closed-loop when reached)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM/SGLang) so outputs are full length")
    p.add_argument("--no-usage", dest="include_usage", action="store_false",
                   help="do not ask for stream_options.include_usage (count text chunks instead)")
    p.add_argument("--typed-chunks", action="store_true",
                   help="decode stream chunks with the openai client's typed objects (more client CPU)")
    p.add_argument("--json-out", default=None, help="write the report as JSON to this file")
    p.add_argument("--per-request", action="store_true", help="include every request's result in the JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 all ok, 1 some request failed, 2 cannot run)."""
    args = build_parser().parse_args(argv)
    if args.limit is not None and args.limit < 0:
        print("dplb-replay: --limit must be >= 0", file=sys.stderr)
        return 2
    if args.time_scale < 0:
        print("dplb-replay: --time-scale must be >= 0", file=sys.stderr)
        return 2
    try:
        requests = load_trace(args.trace, limit=args.limit)
    except (OSError, TraceFormatError, BenchError) as e:
        print(f"dplb-replay: {e}", file=sys.stderr)
        return 2
    opts = ReplayOptions(base_url=args.url, model=args.model, api=args.api, stream=args.stream,
                         time_scale=args.time_scale, max_tokens_cap=args.max_tokens_cap, timeout_s=args.timeout,
                         include_usage=args.include_usage, ignore_eos=args.ignore_eos,
                         max_concurrency=args.max_concurrency, typed_chunks=args.typed_chunks)
    span = (requests[-1].timestamp_ms - requests[0].timestamp_ms) / 1000 * args.time_scale if requests else 0

    def progress(sent: int, done: int, errors: int) -> None:
        if not args.quiet:
            print(f"  sent {sent}/{len(requests)}  done {done}  errors {errors}", file=sys.stderr, flush=True)

    if not args.quiet:
        print(f"replaying {len(requests)} requests from {args.trace} over {span:.1f} s to {opts.base_url}",
              file=sys.stderr, flush=True)
    try:
        results, wall, model = asyncio.run(replay(requests, opts, progress))
    except BenchError as e:
        print(f"dplb-replay: {e}", file=sys.stderr)
        return 2
    summary = summarize(results, wall, endpoint=opts.base_url, model=model, api=opts.api, stream=opts.stream,
                        time_scale=opts.time_scale, trace=str(Path(args.trace)), limit=args.limit,
                        max_tokens_cap=opts.max_tokens_cap)
    if args.json_out:
        doc = dict(summary)
        if args.per_request:
            doc["results"] = [asdict(r) for r in results]
        Path(args.json_out).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    try:
        print(format_table(summary), flush=True)
    except BrokenPipeError:  # `dplb-replay ... | head`: the report was still written to --json-out
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep the interpreter's exit flush quiet
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
