"""The simulated engine streams like vLLM: the chat role comes with the first token (after the
prefill, never before it), and every token is its own SSE write, sent when the step that computed
it ends, so a client measures the model's inter-token latency (issue 16)."""
from __future__ import annotations

import itertools
import statistics
import time

import orjson


def _timed_events(c, path: str, body: dict) -> list[tuple[float, dict | str]]:
    """(seconds since the request was sent, decoded event) for every SSE event, in order; events
    that arrived in one read share its time."""
    out: list[tuple[float, dict | str]] = []
    buf = b""
    t0 = time.perf_counter()
    with c.stream("POST", path, json=body) as s:
        for chunk in s.iter_raw():
            t = time.perf_counter() - t0
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                payload = ev.decode()[len("data: "):]
                out.append((t, payload if payload == "[DONE]" else orjson.loads(payload)))
    return out


def test_chat_role_comes_with_the_first_token_after_the_prefill(engine_factory):
    # time-scale 0.02: a 600-word prefill is ~0.02 s of model time = ~1 s of wall time, and a decode
    # step at batch 1 (~5 ms of model time) is ~250 ms of wall time
    c = engine_factory("--time-scale", "0.02")
    body = {"messages": [{"role": "user", "content": "w " * 600}], "max_tokens": 3, "stream": True}
    evs = _timed_events(c, "/v1/chat/completions", body)
    (t_role, role), (t_tok, tok) = evs[0], evs[1]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert tok["choices"][0]["delta"]["content"].strip()
    # the role-only event waited for the prefill (half of it is a bound no busy machine can fake)
    # and the first token followed it at once, not a decode step (250 ms) later; the 150 ms bound
    # leaves the client's own reads room to be late on a busy machine
    assert t_role >= 0.5, t_role
    assert t_tok - t_role < 0.15, (t_role, t_tok)


def test_one_event_per_token_at_the_pace_of_the_steps(engine_factory):
    # time-scale 0.1: a decode step at batch 1 is ~5 ms of model time = ~50 ms of wall time
    c = engine_factory("--time-scale", "0.1")
    n = 20
    evs = _timed_events(c, "/v1/completions", {"prompt": "a b c", "max_tokens": n, "stream": True})
    toks = [(t, e) for t, e in evs if isinstance(e, dict)]
    assert len(toks) == n and all(len(e["choices"][0]["text"].split()) == 1 for _, e in toks)
    times = [t for t, _ in toks]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # each token left in its own write when its step ended: most reads carry exactly one token,
    # and the typical gap is the modelled step (before: several tokens per write, a 0 ms gap)
    assert len(set(times)) >= 0.75 * n
    assert 0.025 <= statistics.median(gaps) <= 0.2


def test_fast_engine_still_writes_one_token_per_step(engine_factory):
    # time-scale 10: a step is ~0.5 ms of wall time, below the event loop's 1 ms timer, so the
    # engine computes two steps per wake-up; their tokens must still leave in two writes (before,
    # they left together: every other token reached the client 0 ms after the previous one)
    c = engine_factory("--time-scale", "10")
    n = 40
    best = 0
    for _ in range(3):  # a busy machine may merge some reads; the best of three runs is judged
        evs = _timed_events(c, "/v1/completions", {"prompt": "a b c", "max_tokens": n, "stream": True})
        best = max(best, len({t for t, e in evs if isinstance(e, dict)}))
        if best >= 0.7 * n:
            break
    assert best >= 0.7 * n
