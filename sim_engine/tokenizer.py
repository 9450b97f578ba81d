"""The simulated tokenizer: **one token per whitespace-separated word**.

* ``tokenize(text)`` is ``text.split()``: a 12k-word prompt is 12k tokens.
* Token ids (for ``/tokenize`` and the render endpoints) are ``crc32(word) mod vocab_size``: stable
  across processes and machines, so routers that compare token ids between workers (vllm-router's
  cache_aware policy) see identical prompts as identical.
* Token-id prompts (``prompt: [1, 2, 3]``) become the words ``<1> <2> <3>``.
* Chat messages are rendered by a fixed template: each message becomes ``<|role|>`` followed by its
  text and ``<|eot|>``, and the prompt ends with ``<|assistant|>`` (one token each), so a conversation
  that grows turn by turn keeps its earlier turns as a token prefix (what prefix caching needs).
* Generated text: one word per token, each token's text is ``" " + word``.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from sim_engine.errors import InvalidRequestError

# Words the engine "generates": common English words, so outputs look like text in logs.
OUTPUT_VOCAB: tuple[str, ...] = tuple(
    (  # noqa: SIM905 - a word list reads best as text
        "the of and to in is that it for as with was on be by this are from at or an have not "
        "which but all they can more one has their will there other also been when would new into "
        "these its time some only about model cache token batch block prefix decode prefill queue "
        "router worker engine request stream latency memory kernel layer weight value key"
    ).split()
)


def tokenize(text: str) -> list[str]:
    """Split ``text`` into tokens (whitespace-separated words). O(len(text))."""
    return text.split()


def token_ids(words: list[str], vocab_size: int) -> list[int]:
    """Stable token ids of ``words``: ``crc32(utf-8 word) % vocab_size``."""
    return [zlib.crc32(w.encode()) % vocab_size for w in words]


def ids_to_words(ids: Sequence[object], param: str = "prompt") -> list[str]:
    """Turn a token-id prompt into words ``<id>``; raises :class:`InvalidRequestError` on non-ints."""
    out = []
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InvalidRequestError(f"token ids must be non-negative integers, got {t!r}", param=param)
        out.append(f"<{t}>")
    return out


def _content_text(content: object, idx: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(
                        "a text content part needs a string 'text'", param=f"messages[{idx}].content"
                    )
                parts.append(part["text"])
            elif isinstance(part, dict):
                # images/audio: the simulator has no encoder; count the part as one placeholder token
                parts.append(f"<|{part.get('type', 'part')}|>")
            else:
                raise InvalidRequestError("content parts must be objects", param=f"messages[{idx}].content")
        return " ".join(parts)
    raise InvalidRequestError(
        "content must be a string, a list of parts or null", param=f"messages[{idx}].content"
    )


def render_chat(messages: object, add_generation_prompt: bool = True) -> list[str]:
    """Render chat ``messages`` (OpenAI shape) into prompt tokens with the template described above.

    Raises :class:`InvalidRequestError` (param ``messages``) when the list is empty or malformed.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("'messages' must be a non-empty list", param="messages")
    words: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequestError("each message must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequestError("each message needs a string 'role'", param=f"messages[{i}].role")
        words.append(f"<|{role}|>")
        words.extend(_content_text(m.get("content"), i).split())
        for call in m.get("tool_calls") or ():
            if isinstance(call, dict):
                fn = call.get("function") or {}
                words.extend(str(fn.get("name", "")).split() + str(fn.get("arguments", "")).split())
        words.append("<|eot|>")
    if add_generation_prompt:
        words.append("<|assistant|>")
    return words


class WordSource:
    """Deterministic generated words: a seeded table of 4096 words; each request starts at an offset
    drawn from the seeded RNG and walks the table, so equal seeds and arrivals give equal outputs."""

    TABLE = 4096

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self.table = [self._rng.choice(OUTPUT_VOCAB) for _ in range(self.TABLE)]

    def start(self) -> int:
        """A new request's starting offset into the table."""
        return self._rng.randrange(self.TABLE)

    def word(self, offset: int) -> str:
        """The word at ``offset`` (wraps around)."""
        return self.table[offset % self.TABLE]
