"""Read what routing needs from a raw request body, once, without copying or re-serialising it.

The body is forwarded byte for byte; this module only extracts ``model``, ``stream`` and the
prompt text/length (see :class:`router.policies.base.RequestInfo`) and rejects bodies that no
engine could accept (not JSON, not an object, wrong types for the fields routing reads, missing
``messages``/``prompt``/``text``) with :class:`router.errors.BadRequest` naming the field.
"""
from __future__ import annotations

from typing import Any

import orjson

from router.errors import BadRequest
from router.policies.base import RequestInfo

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


def _approx_tokens(text: str) -> int:
    """Approximate token count: whitespace-separated words (what the sim engine counts)."""
    if not text:
        return 0
    return len(text.split())


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of message objects", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object", param="messages")
        role = m.get("role")
        c = m.get("content")
        if isinstance(c, str):
            parts.append(f"{role}:{c}")
        elif isinstance(c, list):
            for p in c:
                if isinstance(p, dict) and isinstance(p.get("text"), str):
                    parts.append(f"{role}:{p['text']}")
        elif c is not None:
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null", param="messages")
    return "\n".join(parts)


def parse_request(path: str, body: bytes, needs_text: bool = True) -> RequestInfo:
    """Parse ``body`` of a request to ``path``; raises BadRequest. ``needs_text=False`` skips
    building the prompt text (policies that ignore it) but still measures the prompt length."""
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
    text = ""
    n_tokens = -1
    if path == CHAT:
        text = _chat_text(d.get("messages"))
    elif path == COMPLETIONS:
        p = d.get("prompt")
        if isinstance(p, str):
            text = p
        elif isinstance(p, list) and p:
            if all(isinstance(x, str) for x in p):
                text = p[0]
            elif all(isinstance(x, int) for x in p):
                n_tokens = len(p)
            elif all(isinstance(x, list) for x in p):
                n_tokens = len(p[0])
            else:
                raise BadRequest("'prompt' must be a string, a list of strings or token ids", param="prompt")
        else:
            raise BadRequest("'prompt' is required: a string, a list of strings or token ids", param="prompt")
    elif path == GENERATE:
        t = d.get("text")
        ids = d.get("input_ids")
        if isinstance(t, str):
            text = t
        elif isinstance(t, list) and t and isinstance(t[0], str):
            text = t[0]
        elif isinstance(ids, list):
            n_tokens = len(ids)
        else:
            raise BadRequest("'/generate' needs 'text' (string) or 'input_ids' (list)", param="text")
    user = d.get("user")
    mt = d.get("max_completion_tokens", d.get("max_tokens"))
    if mt is None and path == GENERATE and isinstance(d.get("sampling_params"), dict):
        mt = d["sampling_params"].get("max_new_tokens")
    return RequestInfo(path, model, stream, text if needs_text else "",
                       n_tokens if n_tokens >= 0 else _approx_tokens(text),
                       user if isinstance(user, str) and user else None,
                       mt if isinstance(mt, int) and not isinstance(mt, bool) and mt > 0 else None)
