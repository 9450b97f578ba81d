"""One sequence inside the engine: its tokens, KV blocks, progress and timestamps."""

from __future__ import annotations

import enum

from sim_engine.kv_cache import ROOT_HASH, chain_hashes


class Status(enum.IntEnum):
    """Lifecycle: WAITING → RUNNING → FINISHED; RUNNING → WAITING again on preemption."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class SimRequest:
    """A sequence to prefill and decode.

    ``prompt``: prompt tokens (words); ``max_tokens``: output tokens to generate (>= 1);
    ``stop``: stop strings (generation ends when the output text contains one, which is cut off);
    ``arrival``: simulated seconds. ``sink`` is an opaque slot for its consumer's
    output channel (:class:`sim_engine.runner.EngineRunner`: its channel and the request's index in
    it; :mod:`simulate.cluster`: the request's index), None until set.
    ``prompt`` may be any sequence of words supporting ``len`` and slicing (a lazy view of a long
    prompt). ``hashes``: the chained hashes of the prompt's full blocks when the caller already
    has them (a simulator caching them per shared prefix); they must be equal exactly when the
    prefixes are equal, as :func:`sim_engine.kv_cache.chain_hashes` would give (default: computed).
    """

    __slots__ = (
        "_block_size",
        "arrival",
        "blocks",
        "counted_prompt",
        "finish_reason",
        "finish_time",
        "first_scheduled",
        "first_token_time",
        "hashes",
        "last_token_time",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_registered",
        "num_tokens",
        "output",
        "prompt",
        "request_id",
        "sink",
        "status",
        "stop",
        "stop_matched",
        "text",
        "word_offset",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[str],
        max_tokens: int,
        block_size: int,
        stop: list[str] | None = None,
        arrival: float = 0.0,
        sink: object = None,
        hashes: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.num_prompt_tokens = len(prompt)
        self.num_tokens = self.num_prompt_tokens  # prompt plus generated tokens (kept by append_output)
        self.max_tokens = max_tokens
        self.stop = stop or []
        self.arrival = arrival
        self.output: list[str] = []
        self.text: list[str] = []  # only kept when stop strings must be checked
        self.num_computed_tokens = 0
        self.blocks: list[int] = []
        self._block_size = block_size
        self.hashes: list[int] = chain_hashes(prompt, block_size) if hashes is None else hashes
        self.num_registered = 0  # leading blocks already registered in the prefix cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.stop_matched: str | None = None
        self.first_scheduled: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_cached_tokens = 0  # prefix-cache hit at first admission
        self.num_preemptions = 0
        self.word_offset = 0
        self.sink = sink
        self.counted_prompt = False

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output)

    def append_output(self, word: str) -> None:
        """Add a generated token and hash the block it completes, if any (O(block_size))."""
        self.output.append(word)
        self.num_tokens += 1
        bs = self._block_size
        n = self.num_tokens
        if n % bs == 0:
            i = n // bs - 1
            start = i * bs
            p = self.num_prompt_tokens
            if start >= p:
                toks = self.output[start - p :]
            else:
                toks = list(self.prompt[start:]) + self.output
            parent = self.hashes[-1] if self.hashes else ROOT_HASH
            self.hashes.append(hash((parent, *toks)))

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (
            f"SimRequest({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output)}/{self.max_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.blocks)})"
        )
