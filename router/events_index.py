"""The engines' KV-cache events as a policy's prefix index, off the request path: for the router
(``kv_events.enabled``, ``dplb-router --kv-events``) and the picker (``dplb-epp --kv-events``,
:mod:`epp.events`).

Every router process and picker replica subscribes to every engine's KV-cache events (vLLM's
``--kv-events-config``: ZMQ PUB + a replay socket, :mod:`router.kv_events`), so each one knows which
prompt blocks each engine holds, whichever replica placed them: routers or pickers on different
nodes then send a session's turns to the engine that holds its history. The router takes each
engine's publisher from its ``backend_servers`` entry (``kv_events``, ``kv_events_replay``), the
picker from its endpoints file::

    - address: 10.0.0.5:8000
      kv_events: tcp://10.0.0.5:5557          # the engine's "endpoint"
      kv_events_replay: tcp://10.0.0.5:5558   # its "replay_endpoint" (catch-up and gaps)

:class:`EventsFeed` keeps one :class:`router.kv_events.KVEventSubscriber` (a thread: SUB + replay
DEALER) per engine slot, started and stopped as the endpoints come and go (:meth:`EventsFeed.sync`,
called on the health tick after the scrape); :meth:`EventsFeed.caught_up` is part of the picker's
readiness, so a replica that starts or returns first replays what the engines still hold.

:class:`EventsIndex` takes the place of the policy's prefix index (as the simulator's
``--events-prefix`` does): hashing, insertion and sizes go to the policy's own index, a match is
answered from the engines' block sets. A match needs the request's prompt tokenized the engine's
way (the events carry token ids). :class:`WordTokenizer` is the simulated engine's tokenizer
(``sim_engine/tokenizer.py``: one token per whitespace-separated word, id ``crc32(word) mod
vocab_size``, chat rendered as ``<|role|> words <|eot|>`` per message then ``<|assistant|>``),
rebuilt from the router's prompt text (``role:content`` per message, one per line,
:func:`dplb_protocol.wire.parse_request`), native (:mod:`dplb_prefix`); a real model needs its own
tokenizer and chat template (any callable ``(path, text) -> token ids``).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from dplb_prefix import reference as _ref
from dplb_prefix import word_block_keys, word_block_state, word_ids
from router.kv_events import KVEventSubscriber, PendingBlocks, token_keys

if TYPE_CHECKING:
    from dplb_prefix._tokens import TokState
    from router.admin_store import MirrorSpec
    from router.policies.prefix_index import PrefixIndex

log = logging.getLogger("dplb.events")

#: ``(request path, router prompt text) -> the engine's prompt token ids``
Tokenize = Callable[[str, str], list[int]]

#: chat roles that start a message in the router's prompt text (``role:content``)
ROLES = _ref.ROLES


class WordTokenizer:
    """The simulated engine's tokenizer (module docstring) over the router's prompt text.
    ``vocab_size``: the engine's (``--vocab-size``, 128,256 by default: Llama 3's; below 2**32).
    Native (:mod:`dplb_prefix`: one pass over the text's buffer, a CRC-32 per word);
    :meth:`block_keys` gives a prompt's block keys without its ids (what :meth:`EventsFeed.match`
    needs), and resumes after a long run of leading messages it tokenized before (``resume``,
    :meth:`block_keys`)."""

    #: a chat prompt's leading messages are kept tokenized when they are at least this many
    #: characters (a shared document or system prompt, a session's history)
    RESUME_MIN_CHARS = 4096
    #: at most this many such prefixes are kept (the least recently used goes first) ...
    RESUME_ENTRIES = 32
    #: ... and at most this many of their characters (each keeps a copy of its text)
    RESUME_CHARS = 16_000_000

    def __init__(self, vocab_size: int = 128_256, resume: bool = True) -> None:
        if not 1 <= vocab_size < 1 << 32:
            raise ValueError(f"vocab_size must be in [1, 2**32) (got {vocab_size})")
        self.vocab_size = vocab_size
        self.resume = resume
        #: (block size, prefix text) -> (state after it, its keys): prefixes ending before a message
        self._kept: OrderedDict[tuple[int, str], tuple[TokState, list[int]]] = OrderedDict()
        self._kept_chars = 0
        self.resumed = 0   # prompts whose keys resumed after a kept prefix

    @staticmethod
    def chat(path: str, text: str) -> bool:
        """Whether the text renders as chat: by the path, or without one (``""``) when its first
        line starts with a role (``user:``)."""
        if path:
            return path.endswith("/chat/completions")
        i = text.find(":", 0, 10)   # the longest role has 9 letters
        return i >= 0 and text[:i] in ROLES

    def words(self, path: str, text: str) -> list[str]:
        """The engine's prompt words: chat paths render the messages, others split the text
        (:meth:`chat`; the Python definition, :func:`dplb_prefix.reference.words`)."""
        return _ref.words(text, self.chat(path, text))

    def __call__(self, path: str, text: str) -> list[int]:
        return word_ids(text, self.chat(path, text), self.vocab_size).tolist()

    def block_keys(self, path: str, text: str, block_size: int) -> tuple[int, list[int]]:
        """``(prompt tokens, keys)``: the :func:`router.kv_events.token_keys` of the prompt's full
        blocks but the one holding its last token (vLLM always computes that token), in one native
        pass (:func:`dplb_prefix.word_block_keys`).

        With ``resume``, a chat prompt whose leading messages (everything before its last message's
        line) span at least :attr:`RESUME_MIN_CHARS` characters keeps the tokenizer's state after
        them (:func:`dplb_prefix.word_block_state`); a later prompt that starts with the same text
        (compared in place: one ``memcmp``) is tokenized from there on only. The keys are the
        same as one pass's (a message's line start is a word boundary;
        tests/router/test_events_index.py)."""
        chat = self.chat(path, text)
        if not (self.resume and chat) or len(text) < self.RESUME_MIN_CHARS:
            return word_block_keys(text, chat, self.vocab_size, block_size)
        vocab = self.vocab_size
        start, state, pre = self._kept_prefix(text, block_size)
        cut = _last_turn(text, start + self.RESUME_MIN_CHARS)
        if cut >= 0:   # keep the leading messages' state for the next prompt that starts with them
            state, mid = word_block_state(text, True, vocab, block_size, cut, start, state)
            pre = pre + mid
            self._keep(block_size, text[:cut], state, pre)
            start = cut + 1
        n, tail = word_block_keys(text, True, vocab, block_size, False, start, state)
        keys = pre + tail
        if n and n % block_size == 0:   # the block holding the last token is never a hit
            keys.pop()
        return n, keys

    def _kept_prefix(self, text: str, block_size: int) -> tuple[int, TokState | None, list[int]]:
        """``(start, state, keys)`` after the longest kept prefix of ``text`` (``(0, None, [])``:
        none): where to resume, the tokenizer's state there and the prefix's keys."""
        best: tuple[str, tuple[TokState, list[int]]] | None = None
        n = len(text)
        for (bs, pre), got in tuple(self._kept.items()):
            end = len(pre)
            if (bs == block_size and end < n and (best is None or end > len(best[0])) and text[end] == "\n"
                    and text.startswith(pre)):
                best = pre, got
        if best is None:
            return 0, None, []
        self._kept.move_to_end((block_size, best[0]))
        self.resumed += 1
        return len(best[0]) + 1, best[1][0], best[1][1]

    def _keep(self, block_size: int, pre: str, state: TokState, keys: list[int]) -> None:
        """Keep ``pre``'s state and keys, dropping the least recently used beyond the bounds."""
        kept = self._kept
        if kept.setdefault((block_size, pre), (state, keys))[0] is state:
            self._kept_chars += len(pre)
        while kept and (len(kept) > self.RESUME_ENTRIES or self._kept_chars > self.RESUME_CHARS):
            (_, old), _ = kept.popitem(last=False)
            self._kept_chars -= len(old)


def _last_turn(text: str, lo: int, tries: int = 64) -> int:
    """The newline before the last line of ``text`` that starts a message (``role:``), if it is at
    or after ``lo``; -1 otherwise (or when the last ``tries`` lines start none)."""
    i = len(text)
    for _ in range(tries):
        i = text.rfind("\n", lo, i)
        if i < 0:
            return -1
        c = text.find(":", i + 1, i + 11)
        if c > 0 and text[i + 1:c] in ROLES:
            return i
    return -1


class EventsFeed:
    """One KV-events subscriber per engine slot (module docstring). ``block_size``: the engines'
    (vLLM's ``--block-size``, 16 by default); ``tokenize``: the engine's tokenizer
    (:data:`Tokenize`; one that also has ``block_keys(path, text, block_size) -> (tokens, keys)``,
    as :class:`WordTokenizer`, gives the keys in one native pass); ``pending_s``: how long a prompt this picker sent counts on its engine while
    the engine's events do not show it (:meth:`place`, :class:`router.kv_events.PendingBlocks`; 0:
    the events alone), on ``clock`` (seconds). :meth:`sync` starts and stops subscribers;
    :meth:`match` answers ``{slot: cached prompt tokens}`` for a prompt; :meth:`close` stops them all."""

    def __init__(self, block_size: int = 16, tokenize: Tokenize | None = None, pending_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self.block_size = block_size
        self.tokenize: Tokenize = tokenize if tokenize is not None else WordTokenizer()
        self.subs: dict[int, KVEventSubscriber] = {}
        self._where: dict[int, tuple[str, str | None]] = {}
        #: per slot, this picker's placements its engine's events do not show yet (0: none kept)
        self.pending_s = pending_s
        self.pending: dict[int, PendingBlocks] = {}
        self.clock = clock
        self.last_keys: list[int] = []   # the block keys of the last prompt matched
        #: per slot, how many leading :attr:`last_keys` the engine's events showed stored
        self.last_held: dict[int, int] = {}
        #: called with ``(slot, keys)`` of each placement of this picker's (epp.share sends it on)
        self.on_place: Callable[[int, Sequence[int]], None] | None = None

    def sync(self, wanted: dict[int, tuple[str, str | None]]) -> None:
        """Subscribe to ``wanted`` (slot → (events endpoint, replay endpoint or None)): new slots
        (or slots whose endpoints changed) get a fresh subscriber, which catches up first; slots no
        longer wanted are closed."""
        for slot in [s for s in self.subs if self._where.get(s) != wanted.get(s)]:
            self.subs.pop(slot).close()
            self._where.pop(slot, None)
            self.pending.pop(slot, None)
        for slot, (ep, replay) in wanted.items():
            if slot in self.subs:
                continue
            sub = KVEventSubscriber(ep, replay, name=f"worker {slot} ({ep})")
            if self.pending_s > 0:
                self.pending[slot] = PendingBlocks(self.pending_s)
                sub.blocks.watchers.append(self.pending[slot])
            sub.start()
            self.subs[slot] = sub
            self._where[slot] = (ep, replay)
            log.info("KV events of worker %d: subscribed to %s (replay %s)", slot, ep, replay or "none")

    def caught_up(self) -> bool:
        """True when every subscriber has applied its catch-up (or a first live batch)."""
        return all(s.caught_up() for s in self.subs.values())

    def match(self, path: str, text: str) -> tuple[dict[int, int], int]:
        """``({slot: cached prompt tokens}, prompt tokens)`` of the prompt (only slots with a hit).
        Keeps the prompt's keys and, per slot, how many of them the engine's events alone show
        stored (:meth:`place` leaves those out)."""
        bs = self.block_size
        fused = getattr(self.tokenize, "block_keys", None)
        if fused is not None:
            n, keys = fused(path, text, bs)
        else:
            ids = self.tokenize(path, text)
            n = len(ids)
            # the last token is always computed (vLLM never serves a whole prompt from its cache)
            keys = token_keys(ids[:max(0, n - 1)], bs) if self.subs else []
        if not self.subs:
            return {}, n
        self.last_keys = keys
        held: dict[int, int] = {}
        self.last_held = held
        out = {}
        now = self.clock()
        nk = len(keys)
        for slot, sub in self.subs.items():
            blocks = sub.blocks
            pend = self.pending.get(slot)
            with blocks.lock:
                h = hit = blocks.held_run(keys)
                if pend is not None and h < nk and pend.until:
                    # the same run as pend.match(blocks, keys, ...), from the first block not stored
                    hit = h + pend.match(blocks, keys[h:] if h else keys, now, by_key=True)
            held[slot] = h
            if hit:
                out[slot] = hit * bs
        return out, n

    def place(self, slot: int, keys: Sequence[int], at: float | None = None) -> None:
        """A prompt whose block keys are ``keys`` was sent to ``slot``'s engine at ``at`` (this
        feed's clock; None: now, by this picker): they count as its blocks until its events store
        them or ``pending_s`` passes (:class:`router.kv_events.PendingBlocks`). For the prompt last
        matched (``keys`` is :attr:`last_keys`), the leading blocks the engine's events already
        showed stored then are left out: they are the engine's already, and its eviction of one
        is then seen at once instead of masked for ``pending_s``."""
        pend = self.pending.get(slot)
        sub = self.subs.get(slot)
        if keys is self.last_keys:
            skip = self.last_held.get(slot, 0)
            if skip:
                keys = keys[skip:]
        if pend is not None and sub is not None and keys:
            with sub.blocks.lock:
                pend.place(keys, self.clock() if at is None else at)
            if at is None and self.on_place is not None:
                self.on_place(slot, keys)

    def close(self) -> None:
        """Stop every subscriber (idempotent)."""
        for sub in self.subs.values():
            sub.close()
        self.subs.clear()
        self._where.clear()


class EventsIndex:
    """A policy's prefix index whose matches are the engines' block sets (module docstring):
    :meth:`hashes` keeps the text for the :meth:`match` that follows it in the same decision,
    which answers ``{slot: characters}``, the share of the text equal to the share of the prompt's
    tokens that engine holds (``chunk_chars`` 1, as :func:`router.policies.prefix_index.uncached_tokens`
    reads it). ``path``: the request path the tokenizer renders for ("": told from the text,
    :meth:`WordTokenizer.words`). ``own_index`` False: while some engine's events are subscribed
    the policy's own index is neither hashed nor filled (a policy that reads nothing of it but the
    match the events answer: hashing a long prompt's text and inserting its chunks cost as much as
    the events' match), so it answers again, from the placements made before and after, only when
    no engine publishes events; True (the default) keeps it filled (``cache_aware`` reads its
    sizes; the picker shares its hashes)."""

    #: what :meth:`hashes` answers when the own index is skipped (non-empty: the policy matches)
    EVENTS_ONLY: tuple[int, ...] = (0,)

    def __init__(self, inner: PrefixIndex, feed: EventsFeed, path: str = "", own_index: bool = True) -> None:
        self.inner = inner
        self.feed = feed
        self.path = path
        self.own_index = own_index
        self._text = ""
        self._matched = ""   # the text whose block keys the feed holds (EventsFeed.last_keys)

    def __len__(self) -> int:
        return len(self.inner)

    @property
    def chunk_chars(self) -> int:
        """1 (matches in characters) while some engine's events are subscribed, else the policy
        index's (its own matches answer then)."""
        return 1 if self.feed.subs else int(self.inner.chunk_chars)

    def hashes(self, text: str, model: str | None = None) -> Sequence[int]:
        """The policy index's hashes of ``text`` (the text kept for :meth:`match`); without
        ``own_index`` while events are subscribed, :attr:`EVENTS_ONLY` (nothing hashed)."""
        self._text = text
        if not self.own_index and self.feed.subs:
            return self.EVENTS_ONLY if text else ()
        return self.inner.hashes(text, model)

    def match(self, hashes: Sequence[int]) -> dict[int, int]:
        """``{slot: characters}`` of the last hashed text cached on each engine (module docstring);
        the policy index's own match while no engine's events are subscribed."""
        if not self.feed.subs:   # no engine publishes its events: the policy's own placements
            return dict(self.inner.match(hashes))
        text = self._text
        if not text:
            return {}
        hits, n = self.feed.match(self.path, text)
        self._matched = text
        if not n:
            return {}
        return {slot: max(1, round(len(text) * hit / n)) for slot, hit in hits.items()}

    def insert(self, hashes: Iterable[int], worker_id: int) -> None:
        """Into the policy's own index (its sizes break cache_aware's ties); the last matched
        prompt's blocks become ``worker_id``'s pending placements (:meth:`EventsFeed.place`)."""
        if hashes is not self.EVENTS_ONLY:
            self.inner.insert(hashes, worker_id)
        if self._text and self._matched is self._text:
            self.feed.place(worker_id, self.feed.last_keys)

    def size(self, worker_id: int) -> int:
        """The policy's own index's size for ``worker_id``."""
        return int(self.inner.size(worker_id))

    def remove_worker(self, worker_id: int) -> None:
        """Forget ``worker_id`` in the policy's own index."""
        self.inner.remove_worker(worker_id)


def wanted(specs: dict[str, MirrorSpec], slot_of: Callable[[str], int | None]) -> dict[int, tuple[str, str | None]]:
    """What :meth:`EventsFeed.sync` wants from the endpoints' specs (address → spec with
    ``kv_events`` and optionally ``kv_events_replay``) and their slots (``slot_of``: the scrape's
    :meth:`router.mirror.MirrorManager.slot_of`; an endpoint without a slot yet is skipped)."""
    out: dict[int, tuple[str, str | None]] = {}
    for addr, spec in specs.items():
        ep = spec.get("kv_events")
        slot = slot_of(addr) if ep else None
        if ep and slot is not None:
            out[slot] = (ep, spec.get("kv_events_replay"))
    return out


def install(policy: object, feed: EventsFeed, own_index: bool | None = True) -> bool:
    """Put an :class:`EventsIndex` over ``policy``'s prefix index (a policy without one, e.g.
    ``least_load``, is left alone: returns False). ``own_index``: as :class:`EventsIndex`'s; None:
    only for a policy that reads the index's sizes (``uses_index_sizes``, ``cache_aware``)."""
    inner = getattr(policy, "index", None)
    if inner is None or isinstance(inner, EventsIndex):
        return isinstance(inner, EventsIndex)
    if own_index is None:
        own_index = bool(getattr(policy, "uses_index_sizes", False))
    policy.index = EventsIndex(inner, feed, own_index=own_index)   # type: ignore[attr-defined]
    return True


__all__ = ["ROLES", "EventsFeed", "EventsIndex", "Tokenize", "WordTokenizer", "install", "wanted"]
