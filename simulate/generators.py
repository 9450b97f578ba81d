"""Seeded synthetic workloads in the Mooncake trace format (issue 29 item 3).

Each generator returns :class:`dplb_trace.mooncake.TraceRequest` lines in arrival order, the same schema
as the bundled conversation trace (``timestamp`` ms as an integer, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks; equal leading ids are equal leading tokens):
:func:`write_jsonl` writes them as JSONL that :func:`dplb_trace.mooncake.load_trace`, ``dplb-replay`` and
``dplb-simulate --trace`` read. The same name, seed and size give the same lines, byte for byte.

Prefix sharing is expressed only through ``hash_ids``, so shared text comes in whole 512-token
blocks (a shared system prompt of 16 blocks is 8,192 tokens). When a prompt grows (a session's next
turn), the new prompt repeats *all* of the previous prompt's ids, the partial last block included,
and appends new ids: :func:`dplb_trace.mooncake.prompt_for` turns an id into a fixed run of 512 words and
cuts the last block to ``input_length``, so the previous prompt is then exactly a prefix of the new
one (what a real conversation resend is).

Workloads (sizes in tokens, rates at ``dplb-simulate --rate-scale 1``; see each function):

* ``agentic``: tool-using agent sessions; 2 agent types, each with one shared system prompt + tool
  schema (16 and 12 blocks: 8,192 and 6,144 tokens); a session opens every 5 s on average (Poisson),
  runs 4-20 turns; each turn's prompt is the previous one plus its output (lognormal, median 150,
  20-1,000) plus a tool result (lognormal, median 600, 50-4,000); 2 s + Exp(4 s) between a turn's
  arrival and the next (model time, tool run, think time); contexts end below 48k tokens.
  About 2.5 requests/s once sessions overlap (2,000 requests, seed 0), prompts mostly 8k-30k.
* ``docqa``: document QA; 8 documents of 20k-60k tokens (whole blocks), popularity Zipf (weights
  1/k); one 512-token instruction block shared by all; questions of 20-300 tokens arrive as a
  Poisson process at 0.8 requests/s; answers lognormal, median 120, 16-600. The documents together
  (about 320k tokens) nearly fill one default engine's KV cache (27,000 blocks of 16 = 432k tokens).
* ``mixed``: short chat (one shared 512-token system block + a 30-1,500-token user message;
  answers lognormal, median 200, 10-1,000) as a Poisson process whose rate switches between 2
  requests/s and 6 requests/s (on/off bursts: calm periods Exp(50 s), bursts Exp(10 s)), plus
  long-context summarization (8k-48k unique tokens, answers 150-600) in batches of 2-6 requests
  within 3 s, a batch every 40 s on average. About 3 requests/s (2,000 requests, seed 0: 3.06),
  5 % of them long.

The sizes are chosen so that 4 default engines serve ``--rate-scale 1`` comfortably; the capacity
search scales the arrival rate from there.
"""
from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Protocol

import orjson

from dplb_trace.mooncake import BLOCK_TOKENS, TraceRequest

#: requests generated when no size is given
DEFAULT_REQUESTS = 2000


class _Ids:
    """Fresh block ids, 0, 1, 2, ... (one counter per generated workload)."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal draw with the given median, clipped to ``[lo, hi]``, rounded."""
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def _grow(ids: tuple[int, ...], length: int, new_length: int, fresh: _Ids) -> tuple[int, ...]:
    """The ids of a prompt that extends one of ``length`` tokens (``ids``) to ``new_length``: all of
    ``ids`` (its partial last block included, see the module docstring), then fresh blocks."""
    assert new_length >= length and len(ids) == _blocks(length)
    return ids + fresh.take(_blocks(new_length) - len(ids))


def _finish(reqs: list[tuple[float, int, int, tuple[int, ...]]], n: int) -> list[TraceRequest]:
    """The first ``n`` requests by arrival (ties: generation order), timestamps in whole ms from 0."""
    order = sorted(range(len(reqs)), key=lambda k: (reqs[k][0], k))[:n]
    t0 = round(reqs[order[0]][0] * 1000.0) if order else 0
    return [TraceRequest(index=i, timestamp_ms=float(round(reqs[k][0] * 1000.0) - t0), input_length=reqs[k][1],
                         output_length=reqs[k][2], hash_ids=reqs[k][3]) for i, k in enumerate(order)]


def agentic(seed: int = 0, requests: int = DEFAULT_REQUESTS, session_rate: float = 0.2,
            system_blocks: tuple[int, ...] = (16, 12), max_context: int = 48_000) -> list[TraceRequest]:
    """Agent sessions (see the module docstring): ``session_rate`` new sessions per second
    (Poisson), each of one of the agent types of ``system_blocks`` (the shared system prompt + tool
    schema of each, in 512-token blocks). Turn 1 is the system prompt + a task of 200-2,000 tokens;
    turn k+1's prompt is turn k's plus turn k's output plus a tool result, so its ``hash_ids`` start
    with all of turn k's. A session ends after its drawn number of turns (4-20) or before its
    context would pass ``max_context`` tokens. Returns the first ``requests`` requests by arrival.
    Raises ValueError for a size < 1 or a non-positive rate."""
    if requests < 1 or session_rate <= 0 or not system_blocks:
        raise ValueError("requests must be >= 1, session_rate > 0 and at least one agent type")
    rng = random.Random(f"agentic:{seed}")
    fresh = _Ids()
    systems = [fresh.take(b) for b in system_blocks]
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    t_session = 0.0
    while True:
        t_session += rng.expovariate(session_rate)
        # every request before this session's start is generated (later sessions start later)
        if len(out) >= requests and sum(1 for r in out if r[0] < t_session) >= requests:
            break
        sys_ids = systems[rng.randrange(len(systems))]
        length = len(sys_ids) * BLOCK_TOKENS + rng.randint(200, 2000)
        ids = _grow(sys_ids, len(sys_ids) * BLOCK_TOKENS, length, fresh)
        t = t_session
        for _ in range(rng.randint(4, 20)):
            n_out = _lognormal(rng, 150, 0.8, 20, 1000)
            out.append((t, length, n_out, ids))
            new_length = length + n_out + _lognormal(rng, 600, 1.0, 50, 4000)
            if new_length > max_context:
                break
            ids = _grow(ids, length, new_length, fresh)
            length = new_length
            t += 2.0 + rng.expovariate(1 / 4.0)
    return _finish(out, requests)


def docqa(seed: int = 0, requests: int = DEFAULT_REQUESTS, rate: float = 0.8, documents: int = 8,
          doc_tokens: tuple[int, int] = (20_000, 60_000)) -> list[TraceRequest]:
    """Document QA (see the module docstring): ``documents`` documents of ``doc_tokens`` tokens
    (rounded to whole blocks), questions at ``rate`` per second (Poisson), each on document k with
    probability ∝ 1/k; prompt = the shared instruction block + the document + the question (a fresh
    block, 20-300 tokens). Raises ValueError for a size < 1, no document or a non-positive rate."""
    if requests < 1 or rate <= 0 or documents < 1:
        raise ValueError("requests must be >= 1, rate > 0 and documents >= 1")
    rng = random.Random(f"docqa:{seed}")
    fresh = _Ids()
    instruction = fresh.take(1)
    docs = [instruction + fresh.take(rng.randint(doc_tokens[0], doc_tokens[1]) // BLOCK_TOKENS)
            for _ in range(documents)]
    weights = [1.0 / (k + 1) for k in range(documents)]
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    t = 0.0
    for _ in range(requests):
        d = rng.choices(docs, weights)[0]
        q = rng.randint(20, 300)
        out.append((t, len(d) * BLOCK_TOKENS + q, _lognormal(rng, 120, 0.7, 16, 600), d + fresh.take(1)))
        t += rng.expovariate(rate)
    return _finish(out, requests)


def mixed(seed: int = 0, requests: int = DEFAULT_REQUESTS, chat_rate: tuple[float, float] = (2.0, 6.0),
          calm_s: float = 50.0, burst_s: float = 10.0, batch_every_s: float = 40.0,
          long_tokens: tuple[int, int] = (8_000, 48_000)) -> list[TraceRequest]:
    """Short chat plus bursty long-context summarization (see the module docstring). Chat arrives
    at ``chat_rate[0]`` per second in calm periods (mean ``calm_s``) and ``chat_rate[1]`` in
    bursts (mean ``burst_s``); summarization batches (2-6 requests within 3 s, prompts of
    ``long_tokens`` tokens with no shared prefix) start every ``batch_every_s`` on average. Raises
    ValueError for a size < 1 or a non-positive rate or period."""
    if requests < 1 or min(*chat_rate, calm_s, burst_s, batch_every_s) <= 0:
        raise ValueError("requests must be >= 1 and every rate and period > 0")
    rng = random.Random(f"mixed:{seed}")
    fresh = _Ids()
    system = fresh.take(1)
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    # chat: a two-state (calm / burst) modulated Poisson process
    t, bursting = 0.0, False
    switch = rng.expovariate(1 / calm_s)
    n_chat = 0
    # a long request is about 1 in 25 at these rates: enough chat for any window of `requests`
    while n_chat < requests:
        t += rng.expovariate(chat_rate[1] if bursting else chat_rate[0])
        while t >= switch:
            bursting = not bursting
            switch += rng.expovariate(1 / (burst_s if bursting else calm_s))
        msg = rng.randint(30, 1500)
        length = BLOCK_TOKENS + msg
        out.append((t, length, _lognormal(rng, 200, 0.8, 10, 1000), system + fresh.take(_blocks(msg))))
        n_chat += 1
    horizon = t
    # summarization: batches until the chat's horizon
    tb = rng.expovariate(1 / batch_every_s)
    while tb < horizon:
        for _ in range(rng.randint(2, 6)):
            n_in = rng.randint(long_tokens[0], long_tokens[1])
            out.append((tb + rng.uniform(0.0, 3.0), n_in, rng.randint(150, 600), fresh.take(_blocks(n_in))))
        tb += rng.expovariate(1 / batch_every_s)
    return _finish(out, requests)


class Workload(Protocol):
    """A generator of :data:`WORKLOADS`: its first ``requests`` requests with ``seed``."""

    def __call__(self, seed: int = ..., requests: int = ...) -> list[TraceRequest]: ...


WORKLOADS: dict[str, Workload] = {"agentic": agentic, "docqa": docqa, "mixed": mixed}


def generate(name: str, seed: int = 0, requests: int = DEFAULT_REQUESTS) -> list[TraceRequest]:
    """The workload ``name`` (one of :data:`WORKLOADS`) with ``seed``, its first ``requests``
    requests. Raises ValueError for an unknown name."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}") from None
    return fn(seed=seed, requests=requests)


def to_json_line(r: TraceRequest) -> bytes:
    """One Mooncake JSONL line (keys in the bundled trace's order, integer timestamp in ms)."""
    return orjson.dumps({"timestamp": int(r.timestamp_ms), "input_length": r.input_length,
                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + b"\n"


def write_jsonl(reqs: list[TraceRequest], path: str | Path) -> None:
    """Write ``reqs`` as Mooncake JSONL at ``path``."""
    Path(path).write_bytes(b"".join(to_json_line(r) for r in reqs))


def describe(reqs: list[TraceRequest]) -> dict[str, float | int]:
    """Sizes and rate of a workload: requests, span (s), requests/s, prompt p50/p99/max and mean
    output (tokens), and the share of prompt tokens an infinite prefix cache would hit (each
    distinct block id computed once; every later occurrence a hit)."""
    from dplb_trace.stats import percentile

    ins = [float(r.input_length) for r in reqs]
    span = (reqs[-1].timestamp_ms - reqs[0].timestamp_ms) / 1000.0 if reqs else 0.0
    seen: set[int] = set()
    hit = 0
    for r in reqs:
        full = r.input_length // BLOCK_TOKENS
        for b in r.hash_ids[:full]:
            if b in seen:
                hit += BLOCK_TOKENS
            else:
                seen.add(b)
    total = sum(r.input_length for r in reqs)
    return {"requests": len(reqs), "span_s": round(span, 1),
            "requests_per_s": round(len(reqs) / span, 3) if span > 0 else 0.0,
            "prompt_p50": round(percentile(ins, 50) or 0), "prompt_p99": round(percentile(ins, 99) or 0),
            "prompt_max": max(r.input_length for r in reqs) if reqs else 0,
            "output_mean": round(sum(r.output_length for r in reqs) / max(1, len(reqs)), 1),
            "infinite_cache_hit": round(hit / total, 3) if total else 0.0}


def main(argv: list[str] | None = None) -> int:
    """``dplb-workload NAME --seed S --out FILE [--requests N]``: write a generated workload as
    Mooncake JSONL and print its sizes (exit 0; 2 for a bad command line)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="dplb-workload", allow_abbrev=False,
                                description="Write a seeded synthetic workload as Mooncake JSONL.")
    p.add_argument("name", choices=sorted(WORKLOADS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help=f"requests (default {DEFAULT_REQUESTS})")
    p.add_argument("--out", required=True, help="output JSONL path")
    ns = p.parse_args(argv)
    if ns.requests < 1:
        print(f"dplb-workload: --requests {ns.requests}: must be >= 1", file=sys.stderr)
        return 2
    reqs = generate(ns.name, ns.seed, ns.requests)
    write_jsonl(reqs, ns.out)
    print(f"{ns.name} seed {ns.seed}: " + ", ".join(f"{k} {v}" for k, v in describe(reqs).items()) + f" -> {ns.out}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
