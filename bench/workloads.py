"""The workloads of issue 7, as lists of prepared requests (same bytes for every system).

Each workload is deterministic (seeded), so every system sees exactly the same requests at the
same offsets. Tokens are whitespace-separated words (the simulated engine's tokenizer), so a
prompt of ``n`` words is ``n`` prompt tokens plus the chat template's few.

(a) ``a_mooncake``: replay of ``mooncake_requests`` (500) consecutive lines of the Mooncake
    conversation trace (``dplb_trace/data/mooncake/``, via :mod:`dplb_trace.mooncake`) from line
    ``mooncake_start`` (2,000: past the first ten minutes, where conversations continue and
    prefixes are reused; repeat k takes the window ``mooncake_stride`` lines later), at
    ``mooncake_load`` × the trace's own rate *in simulated time* on the ``trace`` engine set:
    wall offset = timestamp / (``mooncake_load`` × ``trace_time_scale``). At load 1.0, four
    simulated H100s get the production trace's request rate; by the engines' cost model that
    keeps them about 70-80 % busy. ``max_tokens`` = ``output_length``.
(s) ``s_sessions``: the first ``session_requests`` (200) of that window as closed-loop conversations (:func:`sessions`): a turn leaves
    a think time after the previous turn's answer, never by the clock alone.
(b) ``b_shared_prefix``: SGLang's generated-shared-prefix shape (``bench_serving.py
    --dataset-name generated-shared-prefix``: ``gsp_num_groups`` groups, ``gsp_prompts_per_group``
    questions each, ``gsp_system_prompt_len`` system prompt, ``gsp_question_len`` question,
    ``gsp_output_len`` output; SGLang's defaults are 64/16/2048/128/256), scaled down; requests
    shuffled across groups, Poisson arrivals. Streamed.
(c) ``c_mixed_lengths``: unique prompts of 128 and 4,096 words interleaved (short, long, short,
    ...), Poisson arrivals. Streamed.
(d) ``d_heterogeneous``: unique prompts of 256..2,048 words, Poisson arrivals, on an engine set in
    which one engine runs ``--slowdown 3``. Streamed.
(e) ``e_burst``: ``burst_requests`` (200) unique 512-word prompts all sent at t=0 on idle engines.
    Streamed. Judged on per-worker share.
(f) ``f_overhead``: tiny non-streaming requests (8 words, ``max_tokens`` 1) at fixed concurrency,
    closed loop, in batches of ``overhead_batch`` interleaved across systems (``bench.run``); the
    same requests straight to one engine give the baseline for added latency.
``scaling``: closed loop with ``scaling_concurrency_per_engine`` × N clients, unique 256-word
    prompts, 64 output tokens, N = 1, 2, 4, 8 engines; efficiency(N) = tok/s(N) / (N × tok/s(1)).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from bench.errors import WorkloadError
from bench.loadgen import RequestSpec, chat_body

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Profile:
    """Sizes and rates of every workload (``FULL`` for ``make bench``, ``QUICK`` for ``--quick``).

    Rates are wall-clock requests per second; the engines' ``--time-scale`` sets how much
    simulated work one wall second holds, so both are chosen together (see ``bench.run``).
    """

    mooncake_requests: int
    mooncake_load: float
    gsp_num_groups: int
    gsp_prompts_per_group: int
    gsp_system_prompt_len: int
    gsp_question_len: int
    gsp_output_len: int
    gsp_rate: float
    mixed_requests: int
    mixed_output_len: int
    mixed_rate: float
    hetero_requests: int
    hetero_output_len: int
    hetero_rate: float
    burst_requests: int
    burst_prompt_len: int
    burst_output_len: int
    overhead_requests: int
    overhead_concurrency: int
    overhead_batch: int
    scaling_requests_per_engine: int
    scaling_concurrency_per_engine: int
    scaling_prompt_len: int
    scaling_output_len: int
    #: first trace line of (a)'s window for repeat 0; repeat k starts ``k × mooncake_stride`` later
    #: (past the trace's first minutes, where conversations continue and prefixes are reused)
    mooncake_start: int = 2000
    mooncake_stride: int = 500
    #: (s) closed-loop sessions: mean think time between an answer's end and the next turn, in
    #: simulated seconds (exponential, seeded per repeat)
    session_think_s: float = 10.0
    #: requests of (s), from the same window as (a)
    session_requests: int = 200
    #: requests per step of the goodput search on (a) (a window of the same trace)
    goodput_requests: int = 200
    #: the engines' ``--time-scale`` (filled in by ``bench.run``), used to express the trace's rate
    time_scale: float = 0.5
    #: ``--time-scale`` of the ``trace`` engine set on which (a) and (s) run (filled in by ``bench.run``)
    trace_time_scale: float = 4.0


FULL = Profile(
    mooncake_requests=500, mooncake_load=1.0,
    gsp_num_groups=12, gsp_prompts_per_group=16, gsp_system_prompt_len=2048, gsp_question_len=128,
    gsp_output_len=128, gsp_rate=8.0,
    mixed_requests=160, mixed_output_len=64, mixed_rate=12.0,
    hetero_requests=120, hetero_output_len=128, hetero_rate=8.0,
    burst_requests=200, burst_prompt_len=512, burst_output_len=64,
    overhead_requests=1000, overhead_concurrency=1, overhead_batch=100,
    scaling_requests_per_engine=16, scaling_concurrency_per_engine=4, scaling_prompt_len=256,
    scaling_output_len=64,
)

QUICK = replace(
    FULL, mooncake_requests=60, session_requests=60, goodput_requests=60, gsp_num_groups=4, gsp_prompts_per_group=10,
    mixed_requests=48, hetero_requests=24, overhead_requests=200, scaling_requests_per_engine=8,
)

_VOCAB: tuple[str, ...] | None = None


def _vocab() -> tuple[str, ...]:
    global _VOCAB
    if _VOCAB is None:
        from dplb_trace.mooncake import VOCAB
        _VOCAB = VOCAB
    return _VOCAB


def words(rng: random.Random, n: int, tag: str) -> str:
    """``n`` whitespace-separated words; the first is ``tag`` so texts of different workloads or
    requests never share a first block by accident."""
    if n < 1:
        raise WorkloadError(f"a prompt needs at least one word, got {n}")
    return " ".join([tag] + rng.choices(_vocab(), k=n - 1))


def _poisson_offsets(rng: random.Random, n: int, rate: float) -> list[float]:
    if rate <= 0:
        raise WorkloadError(f"arrival rate must be > 0, got {rate}")
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _trace_window(p: Profile, rep: int, n: int):  # type: ignore[no-untyped-def]
    from dplb_trace.mooncake import load_trace

    reqs = load_trace(limit=n, start=p.mooncake_start + rep * p.mooncake_stride)
    if not reqs:
        raise WorkloadError(f"the Mooncake trace has no requests from line {p.mooncake_start + rep * p.mooncake_stride}")
    if p.mooncake_load <= 0 or p.trace_time_scale <= 0:
        raise WorkloadError(f"mooncake_load and trace_time_scale must be > 0, got {p.mooncake_load}, "
                            f"{p.trace_time_scale}")
    return reqs


def mooncake(p: Profile, model: str, rep: int = 0, n: int | None = None) -> list[RequestSpec]:
    """(a) Mooncake replay: ``n`` (default ``p.mooncake_requests``) consecutive trace lines from
    line ``p.mooncake_start + rep × p.mooncake_stride``, at ``p.mooncake_load`` × the trace's rate in
    simulated time (wall offset = (timestamp − window's first timestamp) / (load × trace_time_scale))."""
    from dplb_trace.mooncake import prompt_for
    from dplb_trace.mooncake import sessions as conversation_ids

    reqs = _trace_window(p, rep, p.mooncake_requests if n is None else n)
    speedup = p.mooncake_load * p.trace_time_scale
    t0 = reqs[0].timestamp_ms
    return [RequestSpec((r.timestamp_ms - t0) / 1000.0 / speedup, CHAT,
                        chat_body(model, _user(prompt_for(r)), r.output_length, True, user=f"conv-{rep}-{sid}"),
                        True, "trace")
            for r, sid in zip(reqs, conversation_ids(reqs), strict=True)]


def sessions(p: Profile, model: str, rep: int = 0, seed: int = 8) -> list[RequestSpec]:
    """(s) the window of (a) replayed as closed-loop conversations.

    Conversations come from shared block prefixes (:func:`dplb_trace.mooncake.sessions`). A conversation's
    first turn leaves at its trace offset (as in (a)); each later turn leaves a think time after the
    previous turn's answer ended, drawn from an exponential with mean ``p.session_think_s``
    simulated seconds (seeded by ``seed`` and ``rep``). So a user never sends a turn before seeing
    the answer, and the bursts that timestamp replay makes when answers are slow go away. Each
    spec carries ``session`` (conversation id) and ``think`` (wall seconds after the previous
    turn's end; 0 for a first turn).
    """
    from dplb_trace.mooncake import prompt_for
    from dplb_trace.mooncake import sessions as conversation_ids

    reqs = _trace_window(p, rep, p.session_requests)
    sids = conversation_ids(reqs)
    rng = random.Random(seed * 1000 + rep)
    speedup = p.mooncake_load * p.trace_time_scale
    t0 = reqs[0].timestamp_ms
    seen: set[int] = set()
    out = []
    for r, sid in zip(reqs, sids, strict=True):
        think = rng.expovariate(1.0 / p.session_think_s) / p.trace_time_scale if sid in seen else 0.0
        seen.add(sid)
        out.append(RequestSpec((r.timestamp_ms - t0) / 1000.0 / speedup, CHAT,
                               chat_body(model, _user(prompt_for(r)), r.output_length, True,
                                         user=f"conv-{rep}-{sid}"), True, "session",
                               session=sid, think=think))
    return out


def shared_prefix(p: Profile, model: str, rep: int = 0, seed: int = 2) -> list[RequestSpec]:
    """(b) generated-shared-prefix: groups × questions over a few long system prompts."""
    rng = random.Random(seed * 1000 + rep)
    systems = [words(rng, p.gsp_system_prompt_len, f"sys{g}") for g in range(p.gsp_num_groups)]
    pairs = [(g, words(rng, p.gsp_question_len, f"q{g}x{i}"))
             for g in range(p.gsp_num_groups) for i in range(p.gsp_prompts_per_group)]
    rng.shuffle(pairs)
    at = _poisson_offsets(rng, len(pairs), p.gsp_rate)
    return [RequestSpec(t, CHAT, chat_body(model, [{"role": "system", "content": systems[g]},
                                                   {"role": "user", "content": q}], p.gsp_output_len, True),
                        True, f"group{g}")
            for t, (g, q) in zip(at, pairs)]


def mixed_lengths(p: Profile, model: str, rep: int = 0, seed: int = 3) -> list[RequestSpec]:
    """(c) 128- and 4,096-word unique prompts interleaved, Poisson arrivals."""
    rng = random.Random(seed * 1000 + rep)
    at = _poisson_offsets(rng, p.mixed_requests, p.mixed_rate)
    out = []
    for i, t in enumerate(at):
        n, tag = (128, "short") if i % 2 == 0 else (4096, "long")
        out.append(RequestSpec(t, CHAT, chat_body(model, _user(words(rng, n, f"mx{i}")), p.mixed_output_len, True),
                               True, tag))
    return out


def heterogeneous(p: Profile, model: str, rep: int = 0, seed: int = 4) -> list[RequestSpec]:
    """(d) unique 256..2,048-word prompts, Poisson arrivals (run on the heterogeneous engine set)."""
    rng = random.Random(seed * 1000 + rep)
    at = _poisson_offsets(rng, p.hetero_requests, p.hetero_rate)
    return [RequestSpec(t, CHAT, chat_body(model, _user(words(rng, rng.randint(256, 2048), f"ht{i}")),
                                           p.hetero_output_len, True), True, "hetero")
            for i, t in enumerate(at)]


def burst(p: Profile, model: str, rep: int = 0, seed: int = 5) -> list[RequestSpec]:
    """(e) ``p.burst_requests`` unique prompts, all at t=0."""
    rng = random.Random(seed * 1000 + rep)
    return [RequestSpec(0.0, CHAT, chat_body(model, _user(words(rng, p.burst_prompt_len, f"bu{i}")),
                                             p.burst_output_len, True), True, "burst")
            for i in range(p.burst_requests)]


def overhead(p: Profile, model: str, rep: int = 0, seed: int = 6) -> list[RequestSpec]:
    """(f) tiny non-streaming requests (8 words, 1 output token), for a closed loop."""
    rng = random.Random(seed * 1000 + rep)
    return [RequestSpec(0.0, CHAT, chat_body(model, _user(words(rng, 8, f"oh{i}")), 1, False), False, "tiny")
            for i in range(p.overhead_requests)]


def scaling(p: Profile, model: str, engines: int, rep: int = 0, seed: int = 7) -> list[RequestSpec]:
    """Scaling run on ``engines`` engines: ``p.scaling_requests_per_engine × engines`` requests."""
    rng = random.Random(seed * 1000 + rep)
    return [RequestSpec(0.0, CHAT, chat_body(model, _user(words(rng, p.scaling_prompt_len, f"sc{i}")),
                                             p.scaling_output_len, True), True, "scale")
            for i in range(p.scaling_requests_per_engine * engines)]


@dataclass(frozen=True)
class Workload:
    """A named workload: how to build its requests and how to send them.

    ``build(profile, model, rep)``: the request list of repeat ``rep`` (each repeat has its own
    seed, or for the trace its own window); ``mode``: ``open`` (each spec at its offset),
    ``closed`` (``profile.overhead_concurrency`` clients back to back) or ``sessions``
    (conversations with think times, :func:`bench.loadgen.run_sessions`);
    ``engines``: which engine set it runs on (see :func:`bench.harness.engine_sets`): ``main`` (4 equal
    engines), ``trace`` and ``sessions`` (4 equal engines at the trace's time scale, a fresh set
    each), ``hetero`` (one of them 3× slower) or ``fast`` (engines whose steps take almost no
    wall time, so that the router's own latency is what (f) measures).
    """

    name: str
    build: Callable[..., list[RequestSpec]]
    engines: str = "main"
    mode: str = "open"

    @property
    def closed(self) -> bool:
        """True for the closed-loop workload (f)."""
        return self.mode == "closed"


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("a_mooncake", mooncake, engines="trace"),
    Workload("s_sessions", sessions, engines="sessions", mode="sessions"),
    Workload("b_shared_prefix", shared_prefix),
    Workload("c_mixed_lengths", mixed_lengths),
    Workload("d_heterogeneous", heterogeneous, engines="hetero"),
    Workload("e_burst", burst),
    Workload("f_overhead", overhead, engines="fast", mode="closed"),
)}
