"""The TPOT-SLO term of ``dplb`` (router/policies/tpot_slo.py): which decodes a prefill pushes over
their bound, the scheduler's book of streamed requests in flight, and the choice it changes, on a
real segment and kernel."""
from __future__ import annotations

import random

import pytest

from dplb_shm import TtftParams
from router.config import load_config
from router.metrics import Metrics
from router.policies import DplbPolicy, PrefixIndex, RequestInfo
from router.policies.base import Decision
from router.policies.tpot_slo import count_pushed, victim_rows
from router.scheduling import Scheduler
from router.stream_meter import StreamMeter
from router.workers import Registry
from tests.helpers import ready_segment

T, S, R = 0.1, 8192.0, 30000.0
NOW_NS = 10 ** 15
NOW_S = 100.0


def test_a_victim_close_to_its_bound_is_pushed_over_by_a_long_prefill_only():
    # o 4, 2 tokens streamed, 0.02 s since the first: left 2 steps at 0.02 s -> 0.06 s of a 0.3 s
    # budget: slack 0.24 s; its 2 remaining steps can carry at most 2 x 8,192 prompt tokens
    rows = victim_rows([(4, 2, 0.02)], T, S, 256)
    assert rows == [(pytest.approx(0.24), 2 * S)]
    assert count_pushed(rows, 30000, R) == 1     # min(30,000, 16,384) / 30,000 = 0.55 s > 0.24 s
    assert count_pushed(rows, 3000, R) == 0      # 0.1 s < 0.24 s
    assert count_pushed(rows, 0, R) == 0         # a full prefix hit delays nobody
    assert count_pushed(rows, 30000, 0.0) == 0   # no rate known: nothing priced


def test_long_outputs_have_slack_and_lost_or_finished_victims_count_nothing():
    # 246 steps left at 0.01 s: 2.55 s of a 25.5 s budget
    assert count_pushed(victim_rows([(256, 10, 0.09)], T, S, 256), 30000, R) == 0
    assert victim_rows([(4, 2, 0.2)], T, S, 256) == []       # 0.6 s > 0.3 s: lost without us
    assert victim_rows([(1, 0, None), (8, 8, 0.5)], T, S, 256) == []   # no TPOT; done
    # queued (no first token): no step spent, its whole budget is slack
    rows = victim_rows([(3, 0, None)], T, S, 256)
    assert rows == [(pytest.approx(0.2), 2 * S)] and count_pushed(rows, 30000, R) == 1
    # no max_tokens: the default bound (256 -> 25.5 s of slack)
    assert count_pushed(victim_rows([(None, 0, None)], T, S, 256), 30000, R) == 0
    assert count_pushed(victim_rows([(None, 0, None)], T, S, 3), 30000, R) == 1
    with pytest.raises(ValueError):
        victim_rows([], 0.0, S, 256)


def test_the_chunk_cap_limits_what_one_remaining_step_can_carry():
    # one step left (o 3, k 2) with 0.05 s slack: at most one 8,192-token chunk shares it
    rows = victim_rows([(3, 2, 0.05)], T, S, 256)     # base 0.05 + 1 x 0.05 = 0.1, budget 0.2
    assert rows == [(pytest.approx(0.1), S)]
    assert count_pushed(rows, 100_000, 100_000.0) == 0   # 8,192 / 100k = 0.08 s < 0.1 s
    assert count_pushed(rows, 100_000, 50_000.0) == 1    # 0.16 s > 0.1 s


@pytest.fixture
def seg():
    with ready_segment(2, NOW_NS, endpoint="/tmp/dplb-slo/{}.sock") as s:
        yield s


def _scheduler(seg, slo_tpot_s: float) -> tuple[Scheduler, DplbPolicy]:
    pol = DplbPolicy(seg, TtftParams(), PrefixIndex(64), rng=random.Random(0), clock=lambda: NOW_NS,
                     slo_tpot_s=slo_tpot_s, w_slo_miss=1.0)
    reg = Registry(seg, load_config(None, {}))
    reg.sync(seg.snapshot())
    return Scheduler(reg, pol, seg, Metrics(), clock_s=lambda: NOW_S), pol


def _decoding(sch: Scheduler, wid: int, max_tokens: int, streamed: int, since_first_s: float, stream: bool = True):
    """A request of 100 prompt tokens in flight on ``wid``, past its first token."""
    h = sch.registry.handles[wid]
    lease = sch.lease(h, Decision(wid, "test", uncached_tokens=100),
                      RequestInfo(text="", prompt_len=100, stream=stream, max_tokens=max_tokens),
                      now=NOW_S - since_first_s - 0.01)
    lease.first_token(now=NOW_S - since_first_s)
    lease.tokens = streamed
    return lease


def long_prompt() -> RequestInfo:
    return RequestInfo(text="", prompt_len=30000, stream=True, max_tokens=64)


def test_the_book_holds_streamed_requests_in_flight_only(seg):
    sch, _ = _scheduler(seg, T)
    a = _decoding(sch, 0, 4, 2, 0.02)
    _decoding(sch, 0, 4, 2, 0.02, stream=False)      # non-streamed: no TPOT, no victim
    assert list(sch.decodes.requests(0)) == [(4, 2, pytest.approx(0.02))]
    a.progress = lambda: 3                           # the proxy's stream meter, when it set one
    assert list(sch.decodes.requests(0)) == [(4, 3, pytest.approx(0.02))]
    a.release(now=NOW_S)
    assert list(sch.decodes.requests(0)) == [] and not sch.decodes.has_requests(0)
    assert not sch.decodes.has_requests(7)           # no such worker


def test_a_long_prefill_avoids_the_worker_whose_decode_it_would_push_over_the_bound(seg):
    sch, pol = _scheduler(seg, T)
    # the same load on both workers (one decoding request each, 100 prompt tokens): the kernel's
    # estimate ties them; the one on worker 0 has 2 of 4 tokens left and 0.24 s of slack
    _decoding(sch, 0, 4, 2, 0.02)
    _decoding(sch, 1, 256, 10, 0.09)
    picks = {pol.choose([seg.read_slot(0), seg.read_slot(1)], long_prompt()).worker_id for _ in range(20)}
    assert picks == {1}
    d = pol.choose([seg.read_slot(0), seg.read_slot(1)], long_prompt(), explain=True)
    rows = {r["worker_id"]: r for r in d.scores}
    assert rows[0]["slo_victims"] == 1 and rows[0]["slo_miss_s"] == pytest.approx(1.0)
    assert rows[1]["slo_victims"] == 0 and rows[1]["slo_miss_s"] == 0
    assert rows[0]["score"] == pytest.approx(-(rows[0]["est_s"] + 1.0))   # the term is in the score
    assert d.est_s == pytest.approx(rows[1]["est_s"])
    # a short prompt pushes nobody over: the tie stands, broken at random
    short = RequestInfo(text="", prompt_len=500, stream=True, max_tokens=64)
    assert {pol.choose([seg.read_slot(0), seg.read_slot(1)], short).worker_id for _ in range(40)} == {0, 1}


def test_with_the_term_off_the_same_load_ties(seg):
    sch, pol = _scheduler(seg, 0.0)
    _decoding(sch, 0, 4, 2, 0.02)
    _decoding(sch, 1, 256, 10, 0.09)
    picks = {pol.choose([seg.read_slot(0), seg.read_slot(1)], long_prompt()).worker_id for _ in range(40)}
    assert picks == {0, 1}
    d = pol.choose([seg.read_slot(0), seg.read_slot(1)], long_prompt(), explain=True)
    assert all(r["slo_victims"] == 0 for r in d.scores)


def test_the_stream_meter_counts_content_events_as_they_pass():
    m = StreamMeter(sse=True)
    assert m.content_events() == 0
    m.feed(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')    # no content yet
    assert m.content_events() == 0
    m.feed(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n')
    assert m.content_events() == 2
    m.feed(b'data: {"choices":[{"delta":{"content":"c"}}]}\n')
    m.feed(b'\n')                                    # a separator split across chunks
    assert m.content_events() == 3


def test_the_books_one_pass_rows_are_the_references_rows(seg):
    # DecodeBook.victim_rows (what the policy reads) against victim_rows(book.requests(...)) (the
    # reference): random bounds (none, <= 1, short, long), progress from a counter or a meter's
    # callable, before or after the first token, lost, done and slack victims, same order
    sch, _ = _scheduler(seg, T)
    rng = random.Random(7)
    book = sch.decodes
    for _ in range(60):
        wid = rng.randrange(2)
        o = rng.choice([None, 0, 1, 2, 3, 4, 16, 256])
        lease = sch.lease(sch.registry.handles[wid], Decision(wid, "test", uncached_tokens=100),
                          RequestInfo(text="", prompt_len=100, stream=True, max_tokens=o),
                          now=NOW_S - rng.uniform(0.0, 3.0))
        if rng.random() < 0.8:
            lease.first_token(now=NOW_S - rng.choice([0.0, rng.uniform(0.0, 2.0), -0.5]))
        k = rng.randrange(0, 300)
        if rng.random() < 0.5:
            lease.tokens = k
        else:
            lease.progress = lambda k=k: k
    for default in (3, 256):
        for wid in (0, 1, 5):
            ref = victim_rows(book.requests(wid), T, S, default)
            assert book.victim_rows(wid, T, S, default) == ref
        assert any(victim_rows(book.requests(w), T, S, default) for w in (0, 1))   # not all empty
    with pytest.raises(ValueError):
        book.victim_rows(0, 0.0, S, 256)
