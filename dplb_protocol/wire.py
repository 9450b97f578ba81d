"""The wire, defined once: what a request says, how long its prompt is, and how errors look.

Everything that reads a request body or writes an OpenAI error imports it from here (the router's
hot path, its control endpoints, ``/dplb/route``, the worker agent's control API, the benchmarks),
so there is one definition of each:

- :func:`parse_request`: the body is decoded **once** (orjson) into a :class:`RequestInfo`
  (``model``, ``stream``, prompt text for prefix matching, prompt length, ``user``, ``max_tokens``);
  bodies no engine could accept raise :class:`BadRequest` naming the field. The body itself is
  forwarded byte for byte; nothing is re-serialised.
- :func:`prompt_tokens`: **the prompt length**, in tokens of the simulated engine's tokenizer
  (one per whitespace-separated word; ``sim_engine/tokenizer.py``), which is also the router's
  estimate for a real engine:

  ========================  ======================================================================
  ``prompt`` / ``input``    a string: its words; a list of strings (a batch): the sum of their
  (completions,             words; token ids: their number; a list of token-id lists: the sum of
  embeddings)               their lengths — a batch of prompts costs the engine every prompt
  ``messages`` (chat)       per message: its content's words (text parts by words, any other part
                            one placeholder token) + 2 (the template's role and end-of-turn
                            tokens); + 1 for the generation prompt
  ``text`` / ``input_ids``  (SGLang ``/generate``) as ``prompt``
  ========================  ======================================================================

  So ``{"prompt": ["a b c d", "e f g h i j"]}`` is 10 tokens everywhere (the router used to count 4
  and the agent 10).
- :func:`error_body`: OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``
  with ``code`` **always the HTTP status as an int**, the way vLLM's OpenAI server fills it
  (``ErrorInfo.code: int``); :func:`sse_error_event` wraps it as an SSE ``data:`` event for a stream
  that fails after its first byte. :class:`OpenAIError` is the base of every error rendered so.
- :data:`HOP_BY_HOP`: header names (lower-case bytes) never forwarded in either direction
  (RFC 9110 §7.6.1, plus ``host`` and ``content-length``, which the sender recomputes, and
  ``expect``: the router has the whole body before it forwards, so a ``100-continue`` was already
  answered to the client and would only make the engine send an interim answer).

This module imports nothing from the rest of DPLB (it is the bottom of the import graph); the
word count is :func:`dplb_prefix.count_words` (native ``len(s.split())`` without building the
words), a leaf below it.
"""
from __future__ import annotations

from dataclasses import dataclass

import orjson

from dplb_prefix import count_words

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
EMBEDDINGS = "/v1/embeddings"

#: the response header naming the worker that answered (its slot), ``none`` on the router's own answers
WORKER_HEADER = "x-dplb-worker-id"
WORKER_HEADER_B = WORKER_HEADER.encode()

#: header names never forwarded, request or response (lower-case bytes, as ASGI and the client use)
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
                        b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"host",
                        b"content-length", b"expect"})

#: template tokens the simulated chat template adds per message (role, end of turn) and at the end
CHAT_TOKENS_PER_MESSAGE = 2
CHAT_GENERATION_PROMPT_TOKENS = 1


# ------------------------------------------------------------------------------------ errors
def error_body(message: str, type_: str, status: int, param: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as bytes; ``code`` is the int status."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param, "code": int(status)}})


def sse_error_event(message: str, type_: str = "upstream_error", status: int = 502) -> bytes:
    """An SSE ``data:`` event carrying an OpenAI error (a stream that broke after its first byte)."""
    return b"data: " + error_body(message, type_, status) + b"\n\n"


class OpenAIError(Exception):
    """An error that reaches a client as an OpenAI error body: ``status`` (HTTP), ``type`` (OpenAI
    error type), ``param``, extra response ``headers``. Subclasses set ``status`` and ``type``."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None,
                 **fields: object) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.fields = fields

    def body(self) -> bytes:
        """The OpenAI-shaped JSON body for this error (bytes)."""
        return error_body(self.message, self.type, self.status, self.param)


class BadRequest(OpenAIError):
    """The request body or a field of it is malformed (400)."""

    status = 400
    type = "invalid_request_error"


# ------------------------------------------------------------------------------------ requests
@dataclass(slots=True)
class RequestInfo:
    """What routing needs from a request, parsed once from the raw body.

    ``text``: prompt text used for prefix matching (chat: ``role:content`` of each message joined
    by newlines; a batch of prompts: joined by newlines; ``""`` when the prompt is token ids).
    ``prompt_len``: the prompt length in tokens (:func:`prompt_tokens`). ``session``: a session
    key for session affinity (the ``X-Session-Id`` header, else the body's ``user``), or None.
    ``max_tokens``: the output limit the client asked for (``max_tokens``/``max_completion_tokens``,
    SGLang's ``sampling_params.max_new_tokens``), or None. Admission (:mod:`router.admission_gate`
    sets them from the headers): ``priority`` (the class; None: the config's default), ``tenant``
    (fairness key; the body's ``user`` until a header or the API key says otherwise),
    ``queue_budget_s`` (the client's own, shorter queue budget, or None) and ``queued_s`` (how
    long it waited in the admission queue).
    """

    path: str = CHAT
    model: str | None = None
    stream: bool = False
    text: str = ""
    prompt_len: int = 0
    session: str | None = None
    max_tokens: int | None = None
    priority: int | None = None
    tenant: str = ""
    queue_budget_s: float | None = None
    queued_s: float = 0.0


def _words(s: str) -> int:
    return count_words(s) if s else 0   # len(s.split()), without building the words (native)


def _prompt(p: object, param: str, texts: list[str] | None) -> int:
    """Tokens of a completions-style prompt (string, strings, ids, id lists); appends the text
    parts to ``texts`` when given. Raises BadRequest for any other shape."""
    if isinstance(p, str):
        if texts is not None:
            texts.append(p)
        return _words(p)
    if isinstance(p, list) and p:
        if all(isinstance(x, str) for x in p):
            if texts is not None:
                texts.extend(p)
            return sum(_words(x) for x in p)
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return len(p)
        if all(isinstance(x, list) for x in p):
            return sum(len(x) for x in p)
    raise BadRequest(f"'{param}' must be a string, a list of strings or token ids", param=param)


def _content(c: object, i: int, texts: list[str] | None, role: object) -> int:
    if c is None:
        return 0
    if isinstance(c, str):
        if texts is not None:
            texts.append(f"{role}:{c}")
        return _words(c)
    if isinstance(c, list):
        n = 0
        for part in c:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                if texts is not None:
                    texts.append(f"{role}:{part['text']}")
                n += _words(part["text"])
            else:
                n += 1  # an image, audio or other part: one placeholder token
        return n
    raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null", param="messages")


def _chat(messages: object, texts: list[str] | None) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    n = CHAT_GENERATION_PROMPT_TOKENS
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        n += CHAT_TOKENS_PER_MESSAGE + _content(m.get("content"), i, texts, m.get("role"))
    return n


def prompt_tokens(path: str, d: dict[str, object], texts: list[str] | None = None) -> int:
    """The prompt length of the decoded body ``d`` of a request to ``path``, in tokens (the table
    in the module docstring). With ``texts``, the prompt's text pieces are appended to it. Raises
    :class:`BadRequest` when the body has no prompt of a usable shape."""
    if path == CHAT or (path not in (COMPLETIONS, GENERATE, EMBEDDINGS) and "messages" in d):
        return _chat(d.get("messages"), texts)
    if path == GENERATE:
        t = d.get("text")
        if t is not None:
            return _prompt(t, "text", texts)
        ids = d.get("input_ids")
        if isinstance(ids, list):
            return _prompt(ids, "input_ids", texts) if ids else 0
        raise BadRequest("'/generate' needs 'text' (string) or 'input_ids' (list)", param="text")
    if path == EMBEDDINGS or ("input" in d and "prompt" not in d):
        return _prompt(d.get("input"), "input", texts)
    if path == COMPLETIONS:
        if "prompt" not in d:
            raise BadRequest("'prompt' is required: a string, a list of strings or token ids", param="prompt")
        return _prompt(d.get("prompt"), "prompt", texts)
    p = d.get("prompt")   # any other /v1/* path: count what is there, never refuse
    try:
        return _prompt(p, "prompt", texts) if p is not None else 0
    except BadRequest:
        return 0


def parse_request(path: str, body: bytes, needs_text: bool = True) -> RequestInfo:
    """Parse ``body`` of a request to ``path`` once; raises :class:`BadRequest`.
    ``needs_text=False`` skips building the prompt text (policies that ignore it) but still
    measures the prompt length."""
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        d = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise BadRequest("request body must be a JSON object")
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    stream = d.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    texts: list[str] | None = [] if needs_text else None
    n = prompt_tokens(path, d, texts)
    user = d.get("user")
    mt = d.get("max_completion_tokens", d.get("max_tokens"))
    if mt is None and path == GENERATE and isinstance(d.get("sampling_params"), dict):
        mt = d["sampling_params"].get("max_new_tokens")
    user = user if isinstance(user, str) and user else None
    return RequestInfo(path, model, stream, "\n".join(texts) if texts else "", n, user,
                       mt if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else None,
                       tenant=user[:128] if user else "")


__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "GENERATE", "HOP_BY_HOP", "BadRequest", "OpenAIError",
           "RequestInfo", "error_body", "parse_request", "prompt_tokens", "sse_error_event"]
