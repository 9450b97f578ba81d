"""Per-request measurement on the relay's hot path: prompt length, TTFT, TPOT, end-to-end latency.

Definitions (as vLLM's benchmark_serving and SGLang's bench_serving use them):

- TTFT: from the agent receiving the request to the first response chunk that carries generated
  content (an SSE event whose ``delta.content`` / ``text`` / ``token_ids`` is non-empty). The
  first chat chunk of vLLM (``delta: {"role": "assistant"}``) carries no content and does not count.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, only when ``output_tokens >= 2``.
- e2e: from receiving the request to the last body byte sent back.

Output tokens of a stream: ``usage.completion_tokens`` (OpenAI, when the client asked for
``stream_options.include_usage``) or ``meta_info.completion_tokens`` (SGLang ``/generate``) from the
last event when present; otherwise one token per content-bearing SSE event (vLLM streams one event
per scheduler step, which is one token unless speculative decoding or ``stream_interval`` > 1).
Only the events up to the first content one and the last two events are JSON-parsed; the events in
between are counted with ``bytes.count`` on the separators.

Non-streaming responses give e2e, and TTFT/TPOT are not measured (the body arrives at once).

The prompt length is an estimate in whitespace-separated words (the simulated engine's token
definition), or the number of token ids when the prompt is given as ids; it feeds the queued
prompt tokens and the prompt-length histogram of the slot.
"""
from __future__ import annotations

import time
from typing import Any

import orjson

_SEP = b"\n\n"


def _words(x: Any) -> int:
    """Word count of a prompt-like value: str, list of str, list of ints (token ids), or parts."""
    if isinstance(x, str):
        return len(x.split())
    if isinstance(x, list):
        if not x:
            return 0
        if isinstance(x[0], int):
            return len(x)
        return sum(_words(v) for v in x)
    if isinstance(x, dict):
        # chat content part {"type": "text", "text": ...}; other parts (images) are not counted
        t = x.get("text")
        return _words(t) if t is not None else 0
    return 0


def estimate_prompt_tokens(body: bytes) -> int:
    """Estimate the prompt length of an OpenAI or SGLang request body.

    Args:
        body: the raw JSON request body.

    Returns:
        Words (or token ids) in ``prompt`` (completions), ``messages[].content`` (chat), ``text`` /
        ``input_ids`` (SGLang ``/generate``) or ``input`` (embeddings); 0 when the body is empty,
        not JSON, or has none of those fields (``GET`` requests, ``/tokenize`` of nothing).
    """
    if not body:
        return 0
    try:
        req = orjson.loads(body)
    except orjson.JSONDecodeError:
        return 0
    if not isinstance(req, dict):
        return 0
    if "messages" in req and isinstance(req["messages"], list):
        return sum(_words(m.get("content")) for m in req["messages"] if isinstance(m, dict))
    for key in ("prompt", "input_ids", "text", "input"):
        if key in req:
            return _words(req[key])
    return 0


def _event_json(event: bytes) -> dict | None:
    """Decode one SSE event's ``data:`` payload; None for ``[DONE]``, comments or non-JSON."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                return None
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return None
            return obj if isinstance(obj, dict) else None
    return None


def _has_content(obj: dict) -> bool:
    """Whether an OpenAI/SGLang stream event carries generated content."""
    choices = obj.get("choices")
    if isinstance(choices, list):
        for c in choices:
            if not isinstance(c, dict):
                continue
            delta = c.get("delta")
            if isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning_content")
                                            or delta.get("tool_calls")):
                return True
            if c.get("text") or c.get("token_ids"):
                return True
        return False
    # SGLang /generate stream: {"text": "...", "meta_info": {...}}
    return bool(obj.get("text") or obj.get("output_ids"))


def _usage_tokens(obj: dict | None) -> int | None:
    if not obj:
        return None
    usage = obj.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("completion_tokens"), int):
        return int(meta["completion_tokens"])
    return None


class RequestMeter:
    """Measures one relayed request. Feed every response chunk; call :meth:`finish` once.

    Args:
        start_ns: ``time.monotonic_ns()`` when the agent received the request.
        streaming: whether the response is an event stream (``text/event-stream``).
    """

    __slots__ = (
        "_carry",
        "_events_after_first",
        "_head",
        "_tail",
        "end_ns",
        "first_token_ns",
        "start_ns",
        "streaming",
    )

    def __init__(self, start_ns: int, streaming: bool) -> None:
        self.start_ns = start_ns
        self.streaming = streaming
        self.first_token_ns: int | None = None
        self.end_ns: int | None = None
        self._head = b""                # bytes not yet split into events, before the first token
        self._events_after_first = 0    # complete events after the first content event
        self._tail = b""                # the last bytes of the stream (for the final events)
        self._carry = b""               # last byte of the previous chunk (a separator can straddle)

    def feed(self, chunk: bytes, now_ns: int | None = None) -> None:
        """Account one response chunk received at ``now_ns`` (default: now)."""
        if not self.streaming or not chunk:
            return
        if self.first_token_ns is None:
            self._head += chunk
            while self.first_token_ns is None:
                i = self._head.find(_SEP)
                if i < 0:
                    return
                event, self._head = self._head[:i], self._head[i + 2:]
                obj = _event_json(event)
                if obj is not None and _has_content(obj):
                    self.first_token_ns = now_ns if now_ns is not None else time.monotonic_ns()
            chunk, self._head = self._head, b""
            self._carry = b""
            if not chunk:
                return
        joined = self._carry + chunk
        self._events_after_first += joined.count(_SEP)
        self._carry = joined[-1:]
        self._tail = (self._tail + chunk)[-8192:]

    def finish(self, now_ns: int | None = None) -> tuple[float | None, float | None, float]:
        """End the measurement; return ``(ttft_ms, tpot_ms, e2e_ms)`` (None where not measured)."""
        self.end_ns = now_ns if now_ns is not None else time.monotonic_ns()
        e2e_ms = (self.end_ns - self.start_ns) / 1e6
        if self.first_token_ns is None:
            return None, None, e2e_ms
        ttft_ms = (self.first_token_ns - self.start_ns) / 1e6
        tokens = self.output_tokens()
        tpot_ms = (e2e_ms - ttft_ms) / (tokens - 1) if tokens >= 2 else None
        return ttft_ms, tpot_ms, e2e_ms

    def output_tokens(self) -> int:
        """Output tokens of the stream (see module docstring for how they are counted)."""
        if self.first_token_ns is None:
            return 0
        events = [e for e in self._tail.split(_SEP) if e.strip()]
        last = [_event_json(e) for e in events[-3:]]
        for obj in reversed(last):
            n = _usage_tokens(obj)
            if n is not None:
                return n
        # 1 (first content event) + complete events after it, minus [DONE] and trailing
        # events without content (finish_reason-only chunk, usage chunk)
        n = 1 + self._events_after_first
        for raw, obj in zip(reversed(events[-3:]), reversed(last)):
            if obj is None or not _has_content(obj):
                n -= 1
            else:
                break
        return max(1, n)
