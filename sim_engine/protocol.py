"""Parsing and validating request bodies (OpenAI completions/chat, SGLang ``/generate``).

Every check raises :class:`sim_engine.errors.InvalidRequestError` naming the offending ``param``;
the server turns it into an OpenAI-shaped 400. Sampling knobs the simulator cannot honour
(``temperature``, ``top_p``, ``seed``, ``logprobs``, ...) are type-checked and otherwise accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import orjson

from sim_engine.errors import InvalidRequestError, ModelNotFoundError
from sim_engine.tokenizer import ids_to_words, render_chat, tokenize

MAX_N = 128
MAX_STOP = 16


@dataclass
class GenParams:
    """A parsed generation request.

    ``prompts``: token lists, one per prompt (completions may carry several); ``n`` choices each;
    ``max_tokens`` None = engine default; ``stop`` strings; ``stream``/``include_usage`` flags."""

    prompts: list[list[str]]
    n: int = 1
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    request_id: str | None = None


def load_json(raw: bytes) -> dict:
    """Decode a JSON object body; raises :class:`InvalidRequestError` on invalid JSON or non-object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object")
    return body


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise InvalidRequestError(f"'{name}' must be an integer, got {v!r}", param=name)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise InvalidRequestError(f"'{name}' must be {rng}, got {v}", param=name)
    return v


def _number(body: dict, name: str, lo: float, hi: float) -> None:
    v = body.get(name)
    if v is None:
        return
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise InvalidRequestError(f"'{name}' must be a number between {lo} and {hi}, got {v!r}", param=name)


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean, got {v!r}", param=name)
    return v


def _stop(v: object, param: str = "stop") -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v) or len(v) > MAX_STOP:
        raise InvalidRequestError(
            f"'{param}' must be a string or a list of at most {MAX_STOP} strings", param=param
        )
    return [s for s in v if s]


def check_model(body: dict, served: str | None) -> None:
    """Raise :class:`ModelNotFoundError` when ``model`` is given and is not ``served``
    (``served=None``: accept any name, as the tokenize/render helpers do for routers)."""
    m = body.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise InvalidRequestError("'model' must be a string", param="model")
    if served is not None and m != served:
        raise ModelNotFoundError(f"The model `{m}` does not exist.", param="model", code=404)


def _common(body: dict, served: str | None) -> tuple[int, list[str], bool, bool]:
    check_model(body, served)
    n = _int(body, "n", 1, MAX_N) or 1
    for name, lo, hi in (
        ("temperature", 0.0, 2.0),
        ("top_p", 0.0, 1.0),
        ("presence_penalty", -2.0, 2.0),
        ("frequency_penalty", -2.0, 2.0),
    ):
        _number(body, name, lo, hi)
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequestError("'stream_options' must be an object", param="stream_options")
        if not stream:
            raise InvalidRequestError(
                "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        include_usage = bool(so.get("include_usage", False))
    return n, _stop(body.get("stop")), stream, include_usage


def parse_completion(body: dict, served: str | None) -> GenParams:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a token-id list or a list
    of token-id lists."""
    n, stop, stream, usage = _common(body, served)
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [tokenize(p)]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = [tokenize(x) for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        prompts = [ids_to_words(p)]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts = [ids_to_words(x) for x in p]
    else:
        raise InvalidRequestError(
            "'prompt' must be a string, a list of strings or a list of token ids", param="prompt"
        )
    if _bool(body, "echo"):
        raise InvalidRequestError("'echo' is not supported by the simulated engine", param="echo")
    return GenParams(prompts, n, _int(body, "max_tokens", 1), stop, stream, usage)


def parse_chat(body: dict, served: str | None) -> GenParams:
    """``POST /v1/chat/completions``: ``max_completion_tokens`` wins over ``max_tokens``."""
    n, stop, stream, usage = _common(body, served)
    words = render_chat(body.get("messages"), bool(body.get("add_generation_prompt", True)))
    mt = _int(body, "max_completion_tokens", 1)
    if mt is None:
        mt = _int(body, "max_tokens", 1)
    else:
        _int(body, "max_tokens", 1)
    return GenParams([words], n, mt, stop, stream, usage)


def parse_generate(body: dict) -> GenParams:
    """SGLang ``POST /generate``: ``text`` (string or list) or ``input_ids``; ``sampling_params``
    with ``max_new_tokens`` (SGLang's default 128), ``stop``; ``stream``; optional ``rid``."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str):
        prompts = [tokenize(text)]
    elif isinstance(text, list) and text and all(isinstance(x, str) for x in text):
        prompts = [tokenize(x) for x in text]
    elif text is None and isinstance(ids, list) and ids:
        prompts = (
            [ids_to_words(x, "input_ids") for x in ids]
            if isinstance(ids[0], list)
            else [ids_to_words(ids, "input_ids")]
        )
    else:
        raise InvalidRequestError("give 'text' (string or list of strings) or 'input_ids'", param="text")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise InvalidRequestError("'sampling_params' must be an object", param="sampling_params")
    mt = _int(sp, "max_new_tokens", 1)
    _number(sp, "temperature", 0.0, 100.0)
    n = _int(sp, "n", 1, MAX_N) or 1
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequestError("'rid' must be a string", param="rid")
    return GenParams(
        prompts,
        n,
        128 if mt is None else mt,
        _stop(sp.get("stop"), "sampling_params.stop"),
        _bool(body, "stream"),
        False,
        rid,
    )


def parse_tokenize(body: dict) -> list[str]:
    """vLLM ``POST /tokenize``: ``prompt`` (string or list of strings, joined) or ``messages``
    (chat, rendered). Any ``model`` name is accepted: routers call this on every worker."""
    check_model(body, None)
    if "messages" in body:
        return render_chat(body["messages"], bool(body.get("add_generation_prompt", True)))
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        p = " ".join(p)
    if not isinstance(p, str):
        raise InvalidRequestError("'prompt' must be a string (or give 'messages')", param="prompt")
    return tokenize(p)
