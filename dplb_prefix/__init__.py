"""dplb_prefix: the per-byte work of a prompt and the approximate prefix index, native.

- :func:`count_words`: ``len(s.split())`` without building the words (the prompt length in
  tokens of the simulated engine's tokenizer, :mod:`dplb_protocol.wire`).
- :func:`chain_hashes`: the 64-bit chained hashes (``array('Q')``) of a text's full chunks of
  ``chunk_chars`` code points, read from the str's own buffer (no slice, no copy, no Python loop
  over chunks); at most ``max_chunks`` of them.
- :class:`PrefixIndex`: the bounded LRU map hash → workers that the prefix-aware policies keep
  (:mod:`router.policies.prefix_index` describes its use): match, insert, eviction and removal
  in C arrays.
- :func:`word_ids`, :func:`word_block_keys`, :func:`token_keys`: a prompt's token ids for the
  simulated engine's word tokenizer and the chained keys of its token blocks, as the engines'
  KV-cache events are matched (:mod:`router.kv_events`), in one pass over the str's buffer;
  :func:`leading_run`: how many of them an engine's block set holds, one dict lookup each;
  :func:`word_block_state`: the tokenizer's state after a prompt's leading lines, from which
  :func:`word_block_keys` resumes (a long shared message tokenized once); :func:`store_blocks`,
  :func:`remove_blocks`: an engine's stored and evicted blocks applied to its block set's maps.

Built from csrc/dplb_prefix.pyx and csrc/dplb_prefix.h, csrc/dplb_tokens.pyx and
csrc/dplb_tokens.h (``make build``); a missing build raises
ImportError naming the fix. The pure-Python reference, bit-identical and slow, is
:mod:`dplb_prefix.reference`. Imports nothing from the rest of DPLB.
"""
from __future__ import annotations

try:
    from dplb_prefix._native import (
        MAX_WORKER_ID,
        PrefixIndex,
        chain_hashes,
        count_words,
        model_seed,
    )
    from dplb_prefix._tokens import (
        leading_run,
        remove_blocks,
        store_blocks,
        token_keys,
        word_block_keys,
        word_block_state,
        word_ids,
    )
except ImportError as e:   # pragma: no cover - only without a build
    raise ImportError(f"dplb_prefix's native extension is not built ({e}): run `make build`") from e

__all__ = ["MAX_WORKER_ID", "PrefixIndex", "chain_hashes", "count_words", "leading_run", "model_seed", "remove_blocks",
           "store_blocks", "token_keys",
           "word_block_keys", "word_block_state", "word_ids"]
