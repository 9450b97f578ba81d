"""What the router reads from a relayed answer: the first chunk that carries content, and tokens.

The proxy relays bodies byte for byte; this module only watches them (issue 16):

- **First content.** A stream's time to first token is the time to the first SSE event that
  carries generated content (``choices[].delta.content`` / ``reasoning_content`` / ``tool_calls``,
  ``choices[].text``, ``token_ids``, or SGLang's ``text`` / ``output_ids``), not to the first
  byte: a chat stream starts with a role-only event (``delta: {"role": "assistant"}``), which vLLM
  sends just before the first token and other servers may send before the prefill. The endpoint
  picker (:mod:`epp`) reads answers with this module too, and vLLM's and SGLang's benchmark
  clients use the same definition. A chunked body that is not an event stream counts its first byte.
- **Tokens.** Output tokens are ``usage.completion_tokens`` (OpenAI, when the client asked for
  ``stream_options.include_usage``, and every non-streamed answer) or ``meta_info.completion_tokens``
  (SGLang) when the answer carries them, else one per content event (vLLM streams one event per
  engine step: one token, unless speculative decoding or ``stream_interval`` > 1). Prompt tokens
  are ``usage.prompt_tokens`` / ``meta_info.prompt_tokens`` when present, else None (the caller
  falls back on the router's estimate).

What the router does with them (the TTFT, the lease, the token counts) is request control's
(:class:`router.director.Director`).

Cost: the events up to the first content one and the last few are JSON-parsed; the events in
between are counted with ``bytes.count`` on the separators (a few hundred ns per chunk).
"""
from __future__ import annotations

import re

import orjson

_SEP = b"\n\n"
_TAIL = 4096  # bytes of the stream's end kept to read its last events
_HEAD_MAX = 1 << 20  # stop looking for content after this much of a stream without any
_USAGE = re.compile(rb'"(prompt|completion)_tokens"\s*:\s*(\d+)')
#: a finish reason of ``abort`` (OpenAI-style ``"finish_reason": "abort"``, vLLM's; SGLang's
#: ``meta_info.finish_reason`` ``{"type": "abort"}``), the cheap test before a JSON parse
_ABORT = re.compile(rb'"(?:finish_reason|type)"\s*:\s*"abort"')


def _abort_key(data: bytes) -> bool:
    """Whether ``data`` holds an abort finish reason's key and value (:data:`_ABORT`). Every match
    of that pattern ends with ``"abort"``, so a substring test (CPython's fast search) first
    answers the common case, no abort anywhere, without the regular expression: on a 4 KiB tail
    of chat chunks the search is about 5x cheaper than the pattern's scan for its ``"``."""
    return b'"abort"' in data and _ABORT.search(data) is not None


def event_json(event: bytes) -> dict | None:
    """The JSON object of one SSE event's ``data:`` line; None for ``[DONE]``, comments, non-JSON."""
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


def has_content(obj: dict) -> bool:
    """Whether an OpenAI or SGLang stream event carries generated content."""
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
    return bool(obj.get("text") or obj.get("output_ids"))


def is_abort(obj: dict | None) -> bool:
    """Whether an answer or stream event reports an engine-side abort: a choice whose
    ``finish_reason`` is ``abort`` (vLLM's, when the engine dropped the request: its own drain or
    stop, a preemption it gave up on) or SGLang's ``meta_info.finish_reason.type`` ``abort``."""
    if not obj:
        return False
    choices = obj.get("choices")
    if isinstance(choices, list):
        return any(isinstance(c, dict) and c.get("finish_reason") == "abort" for c in choices)
    meta = obj.get("meta_info")
    fr = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(fr, dict) and fr.get("type") == "abort"


def body_aborted(body: bytes) -> bool:
    """Whether a whole (non-streamed) answer reports an engine-side abort (:func:`is_abort`; an
    SGLang batch: any of its items)."""
    if not _abort_key(body):
        return False
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    items = obj if isinstance(obj, list) else [obj]
    return any(isinstance(o, dict) and is_abort(o) for o in items)


def events_aborted(data: bytes) -> bool:
    """Whether any complete SSE event in ``data`` reports an engine-side abort (:func:`is_abort`)."""
    if not _abort_key(data):
        return False
    return any(is_abort(event_json(e)) for e in data.split(_SEP) if e.strip())


def usage_of(obj: dict | None) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of an event's ``usage`` or ``meta_info``."""
    if not obj:
        return None, None
    u = obj.get("usage")
    if not isinstance(u, dict):
        u = obj.get("meta_info")
    if not isinstance(u, dict):
        return None, None
    p, c = u.get("prompt_tokens"), u.get("completion_tokens")
    return (p if isinstance(p, int) else None), (c if isinstance(c, int) else None)


def usage_from_body(body: bytes) -> tuple[int | None, int | None]:
    """``(prompt_tokens, completion_tokens)`` of a whole (non-streamed) answer: the sums of every
    ``"prompt_tokens": N`` / ``"completion_tokens": N`` key in it (one ``usage`` object for OpenAI,
    one ``meta_info`` per item of an SGLang batch); None where there is none. A key inside a
    generated string is escaped (``\\"``) and never matches."""
    p = c = None
    for kind, n in _USAGE.findall(body):
        if kind == b"prompt":
            p = (p or 0) + int(n)
        else:
            c = (c or 0) + int(n)
    return p, c


class StreamMeter:
    """Watches one relayed stream. ``sse``: the body is ``text/event-stream`` (else its first
    byte is its first content). Call :meth:`feed` with every chunk in order."""

    __slots__ = ("_carry", "_events_after", "_head", "_last", "_tail", "_usage", "first_seen", "sse")

    def __init__(self, sse: bool = True) -> None:
        self.sse = sse
        self.first_seen = False
        self._head = b""          # bytes not yet split into events, before the first content
        self._events_after = 0    # complete events after the first content event
        self._tail = b""
        self._carry = b""         # last byte of the previous chunk (a separator can straddle)
        self._last: list[dict | None] | None = None   # the tail's last events, parsed (see _last_events)
        self._usage: tuple[int | None, int | None] | None = None   # usage() of those events, once

    def feed(self, chunk: bytes) -> bool:
        """Account one chunk; True exactly once: when this chunk completed the first content."""
        if not chunk:
            return False
        self._last = None
        if self.first_seen:
            n = chunk.count(_SEP)
            if self._carry == b"\n" and chunk[:1] == b"\n" and chunk[:2] != _SEP:
                n += 1  # a separator straddling the previous chunk and this one
            self._events_after += n
            self._carry = chunk[-1:]
            tail = self._tail + chunk
            self._tail = tail if len(tail) <= _TAIL else tail[-_TAIL:]
            return False
        if not self.sse:
            self.first_seen = True
            self._tail = chunk[-_TAIL:]
            return True
        head = self._head + chunk
        start = 0
        while True:
            i = head.find(_SEP, start)
            if i < 0:
                # no content yet; a stream that never carries any is not buffered without bound
                self._head = head[start:] if len(head) - start <= _HEAD_MAX else b""
                self._tail = (self._tail + chunk)[-_TAIL:]
                return False
            obj = event_json(head[start:i])
            start = i + 2
            if obj is not None and has_content(obj):
                self.first_seen = True
                rest = head[start:]
                self._head = b""
                self._events_after = rest.count(_SEP)
                self._carry = rest[-1:]
                self._tail = (self._tail + chunk)[-_TAIL:]
                return True

    def content_events(self) -> int:
        """Events fed since the first content, that one included (0 before it): about the output
        tokens streamed so far, one per event (a trailing ``[DONE]`` or usage event counts too;
        :meth:`output_tokens` is the exact count at the end). O(1): read while the stream runs."""
        return 1 + self._events_after if self.first_seen else 0

    @property
    def carry(self) -> bytes:
        """The last byte fed after the first content (b"" before): a separator may straddle it."""
        return self._carry

    @property
    def tail(self) -> bytes:
        """The kept tail (the last 4 KiB fed; b"" before any): what the native relay needs to see
        an ``"abort"`` before its hand-over or split across it by a chunk boundary
        (``router._relay.ChunkRelay``'s ``before``)."""
        return self._tail

    def absorb(self, events: int, tail: bytes, last: bytes) -> None:
        """Account what the native relay (router._relay.ChunkRelay) metered after it took the
        stream over from :meth:`feed`: ``events`` separators, the last ``tail`` bytes of payload
        and its ``last`` byte (b"" when it relayed nothing; nothing changes then)."""
        if not last:
            return
        self._last = None
        self._events_after += events
        self._carry = last
        t = self._tail + tail
        self._tail = t if len(t) <= _TAIL else t[-_TAIL:]

    def ended_with_done(self) -> bool:
        """Whether the last event fed is an event stream's ``data: [DONE]`` (OpenAI's end of a
        stream; what follows it, if anything, is the body's terminating chunk)."""
        t = self._tail.rstrip()
        return self.sse and (t.endswith((b"\ndata: [DONE]", b"\ndata:[DONE]"))
                             or t in (b"data: [DONE]", b"data:[DONE]"))

    def mentions_abort(self, chunk: bytes = b"") -> bool:
        """The cheap test before :meth:`aborted`: does ``"abort"`` appear in the kept tail, or in
        ``chunk`` (the next one, not fed yet) or across the two? A false alarm is possible (the
        word in a string); an abort event split across chunks is not missed."""
        return b'"abort"' in self._tail[-8:] + chunk or _abort_key(self._tail)

    def aborted(self) -> bool:
        """Whether the stream's last events (its kept tail) report an engine-side abort
        (:func:`is_abort`): the engine dropped the request the client was still reading."""
        if not _abort_key(self._tail):
            return False
        return events_aborted(self._tail) if self.sse else body_aborted(self._tail)

    def usage(self) -> tuple[int | None, int | None]:
        """``(prompt_tokens, completion_tokens)`` reported by the stream's last events, if any
        (read once until more is fed: the stream's end asks for it twice)."""
        last = self._last_events()
        u = self._usage
        if u is not None:
            return u
        u = None, None
        for obj in reversed(last):
            p, c = usage_of(obj)
            if c is not None or p is not None:
                u = p, c
                break
        else:
            if not self.sse:
                u = usage_from_body(self._tail)
        self._usage = u
        return u

    def _last_events(self) -> list[dict | None]:
        """The last three events of the tail, parsed once until more is fed (the stream's end
        asks for its usage and its token count)."""
        last = self._last
        if last is None:
            # the tail's last four separators hold its last three events, unless blank pieces
            # (a separator run) are among them: then the whole tail is split, as before
            parts = self._tail.rsplit(_SEP, 4)
            events = [e for e in parts[1:] if e.strip()] if len(parts) == 5 else []
            if len(events) < 3:
                events = [e for e in self._tail.split(_SEP) if e.strip()]
            last = self._last = [event_json(e) for e in events[-3:]]
            self._usage = None
        return last

    def output_tokens(self) -> int:
        """Output tokens of the stream so far: the reported ``completion_tokens`` when the stream
        carries it, else one per content event (0 before the first content)."""
        if not self.first_seen:
            return 0
        _, c = self.usage()
        if c is not None:
            return c
        if not self.sse:
            return 0
        # the first content event + complete events after it, minus trailing events without
        # content ([DONE], a finish_reason-only or usage event)
        n = 1 + self._events_after
        for obj in reversed(self._last_events()):
            if obj is None or not has_content(obj):
                n -= 1
            else:
                break
        return max(1, n)




#: an event stream's end as OpenAI servers write it (with and without the space)
DONE_EVENTS = (b"data: [DONE]\n\n", b"data:[DONE]\n\n")


def split_done(chunk: bytes) -> tuple[bytes, bytes]:
    """``(chunk without a trailing data: [DONE] event, that event)``; ``(chunk, b"")`` when
    ``chunk`` does not end with one (the event must start the chunk or follow a line break)."""
    for d in DONE_EVENTS:
        if chunk.endswith(d):
            body = chunk[:-len(d)]
            if not body or body.endswith(b"\n"):
                return body, d
    return chunk, b""


def done_start(chunk: bytes) -> int:
    """The length of the start of a ``data: [DONE]`` event (not the whole event) that ends
    ``chunk``, at its start or after a line break (:func:`split_done`); 0 when there is none."""
    t = chunk[chunk.rfind(b"\n", 0, len(chunk) - 1) + 1:]
    return len(t) if t and any(len(t) < len(d) and d.startswith(t) for d in DONE_EVENTS) else 0


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether response ``headers`` (lower-case names) say ``text/event-stream``."""
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


__all__ = ["DONE_EVENTS", "StreamMeter", "body_aborted", "event_json", "events_aborted", "has_content", "is_abort", "is_event_stream",
           "split_done", "usage_from_body", "usage_of"]
