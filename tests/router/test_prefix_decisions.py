"""Routing decisions do not change with the native prefix index: a generated workload (long shared
prefixes, two models, follow-up turns, workers leaving, a small LRU bound) replayed through the
prefix-aware policies with the native index (dplb_prefix.PrefixIndex), its pure-Python reference,
and, for the default policy, the index as it was before it went native (Python's ``hash`` over
string slices, kept verbatim below), each over its own segment in the same state and the same
random seed, makes the same choices."""
from __future__ import annotations

import random
from collections import OrderedDict

import orjson
import pytest

from dplb_prefix import PrefixIndex
from dplb_prefix.reference import ReferencePrefixIndex
from dplb_protocol.wire import CHAT, COMPLETIONS, parse_request
from dplb_shm import TtftParams
from router.policies import CacheAwarePolicy, DplbPolicy
from tests.helpers import ready_segment

NOW_NS = 10 ** 15


class BeforeNativeIndex:
    """The prefix index before it went native (router/policies/prefix_index.py, verbatim but for
    this docstring): Python's ``hash`` chained over ``chunk_chars`` slices, an OrderedDict of sets."""

    def __init__(self, chunk_chars: int = 64, max_chunks: int = 8192, max_entries: int = 200_000) -> None:
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_entries = max_entries
        self._entries: OrderedDict[int, set[int]] = OrderedDict()
        self._sizes: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def hashes(self, text: str, model: str | None = None) -> list[int]:
        c = self.chunk_chars
        n = min(len(text) // c, self.max_chunks)
        out = []
        h = 0 if model is None else hash(model)
        for i in range(n):
            h = hash((h, text[i * c:(i + 1) * c]))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> dict[int, int]:
        result: dict[int, int] = {}
        cands: set[int] | None = None
        depth = 0
        entries = self._entries
        for depth, h in enumerate(hashes):
            ws = entries.get(h)
            if not ws:
                break
            entries.move_to_end(h)
            if cands is None:
                cands = set(ws)
            else:
                kept = cands & ws
                for w in cands - kept:
                    result[w] = depth
                cands = kept
            if not cands:
                break
        else:
            depth = len(hashes)
        for w in cands or ():
            result[w] = depth
        return result

    def insert(self, hashes: list[int], worker_id: int) -> None:
        entries = self._entries
        sizes = self._sizes
        for h in hashes:
            ws = entries.get(h)
            if ws is None:
                entries[h] = {worker_id}
                sizes[worker_id] = sizes.get(worker_id, 0) + 1
            else:
                entries.move_to_end(h)
                if worker_id not in ws:
                    ws.add(worker_id)
                    sizes[worker_id] = sizes.get(worker_id, 0) + 1
        while len(entries) > self.max_entries:
            _, ws = entries.popitem(last=False)
            for w in ws:
                sizes[w] -= 1

    def size(self, worker_id: int) -> int:
        return self._sizes.get(worker_id, 0)

    def remove_worker(self, worker_id: int) -> None:
        if not self._sizes.pop(worker_id, 0):
            return
        dead = []
        for h, ws in self._entries.items():
            ws.discard(worker_id)
            if not ws:
                dead.append(h)
        for h in dead:
            del self._entries[h]


def workload(seed: int, n: int = 160) -> list[tuple[str, bytes]]:
    """``n`` request bodies: chat and completions over 10 shared documents (1-20 KB, some
    non-ASCII), each with a fresh question, for two models; a third are follow-up turns of an
    earlier conversation."""
    rnd = random.Random(seed)
    vocab = [f"w{i}" for i in range(400)] + ["é", "中文", "\U0001f600"]
    docs = [" ".join(rnd.choice(vocab) for _ in range(rnd.randrange(150, 3000))) for _ in range(10)]
    convs: list[tuple[str, str, str]] = []
    out = []
    for _ in range(n):
        model = rnd.choice(["a", "b"])
        if convs and rnd.random() < 0.33:
            model, doc, q = rnd.choice(convs)
            q = q + " then " + " ".join(rnd.choice(vocab) for _ in range(20))
        else:
            doc, q = rnd.choice(docs), " ".join(rnd.choice(vocab) for _ in range(rnd.randrange(3, 60)))
        convs.append((model, doc, q))
        if rnd.random() < 0.7:
            body = {"model": model, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}]}
            out.append((CHAT, orjson.dumps(body)))
        else:
            out.append((COMPLETIONS, orjson.dumps({"model": model, "prompt": doc + "\n" + q})))
    return out


def replay(make_policy, index, reqs, seed: int) -> list[tuple[int, str, int | None]]:
    """Each request parsed as the router does and routed among an offered subset of 4 workers;
    the choice's uncached tokens queue there, a quarter drains from all; a worker sometimes leaves."""
    rnd = random.Random(seed)
    out = []
    with ready_segment(4, NOW_NS) as seg:
        seg.seed(seed)   # the kernel breaks ties with its own generator
        pol = make_policy(seg, index, random.Random(seed))
        for k, (path, body) in enumerate(reqs):
            info = parse_request(path, body)
            ids = sorted(rnd.sample(range(4), rnd.choice([2, 3, 4, 4])))
            d = pol.choose([seg.read_slot(i) for i in ids], info)
            pol.on_dispatch(d.worker_id, info)
            out.append((d.worker_id, d.reason, d.uncached_tokens))
            seg.prefill_add(d.worker_id, int(d.uncached_tokens or info.prompt_len))
            if k % 4 == 3:
                for i in range(4):
                    seg.prefill_add(i, -seg.read_slot(i).prefill_tokens // 4)
            if rnd.random() < 0.03:
                pol.forget(rnd.randrange(4))
    return out


def dplb(seg, index, rng):
    return DplbPolicy(seg, TtftParams(), index, rng=rng, clock=lambda: NOW_NS)


def cache_aware(seg, index, rng):
    return CacheAwarePolicy(index=index, rng=rng)


@pytest.mark.parametrize("max_entries", [200_000, 300])
@pytest.mark.parametrize("seed", [1, 2])
def test_dplb_decisions_are_those_before_the_index_went_native(seed, max_entries):
    reqs = workload(seed)
    before = replay(dplb, BeforeNativeIndex(64, 8192, max_entries), reqs, seed)
    native = replay(dplb, PrefixIndex(64, 8192, max_entries), reqs, seed)
    reference = replay(dplb, ReferencePrefixIndex(64, 8192, max_entries), reqs, seed)
    assert native == before == reference
    assert sum(r == "prefix" for _, r, _ in native) >= 5   # the prefix term decided some of them


@pytest.mark.parametrize("seed", [3, 4])
def test_cache_aware_decisions_equal_the_reference(seed):
    reqs = workload(seed)
    native = replay(cache_aware, PrefixIndex(64, 8192, 500), reqs, seed)
    assert native == replay(cache_aware, ReferencePrefixIndex(64, 8192, 500), reqs, seed)
    assert sum(r == "cache_hit" for _, r, _ in native) >= 10
