"""``admission.decode_room``: a worker whose decode step, once the requests dispatched there and
the new one decode, would exceed the TPOT bound has no room (router.admission_rule.decode_over),
counting the requests dispatched but not yet decoding (a pump that binds a dozen long-context
requests to one worker at once)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.accounting import LearnSettings
from router.admission import GO, HOLD, AdmissionQueue
from router.admission_rule import decode_over, judge_route
from router.config import AdmissionSection
from router.policies.base import Decision, RequestInfo

#: the kernel's defaults: 5 ms a step, 0.05 ms per decoding request, 39 ns per context token
LEARN = LearnSettings()
DOC = 55_000   # a docqa prompt: a cached 55k-token document and a question


def _line(decoding: int, dispatched: int, ctx_each: int = DOC) -> dict[str, float]:
    return {"decode_reqs": decoding, "decode_ctx_tokens": decoding * ctx_each, "router_inflight": dispatched}


def test_the_step_model_against_the_bound():
    # 30 decodes of 55k tokens and one more: 5 + 0.05 x 31 + 39e-6 x 31 x 55k = 73.0 ms < 100 ms
    assert not decode_over(_line(30, 30), LEARN, DOC, 0.1)
    # 45 and one more: 5 + 2.3 + 98.7 = 106 ms > 100 ms
    assert decode_over(_line(45, 45), LEARN, DOC, 0.1)
    # the same batch of short contexts has room (the context, not the count, fills the step)
    assert not decode_over(_line(45, 45, 2_000), LEARN, 2_000, 0.1)
    assert not decode_over(_line(45, 45), LEARN, DOC, 0.0)          # no TPOT bound: never over
    assert not decode_over(_line(0, 0), LEARN, DOC, 0.1)


def test_requests_dispatched_but_not_decoding_yet_count_with_the_decodes_mean_context():
    # 27 decoding and 14 more bound by the same pump (router_inflight 41): the 42nd would make a
    # 5 + 2.1 + 39e-6 x 42 x 55k = 97.2 ms step, with 44 in flight 103.8 ms
    assert not decode_over(_line(27, 27), LEARN, DOC, 0.1)
    assert not decode_over(_line(27, 41), LEARN, DOC, 0.1)
    assert decode_over(_line(27, 44), LEARN, DOC, 0.1)
    # nothing decoding yet: the pending ones count with the new request's own prompt
    assert decode_over(_line(0, 44), LEARN, DOC, 0.1)
    assert not decode_over(_line(0, 44), LEARN, 2_000, 0.1)


class _Seg:
    def __init__(self, line: dict[str, float]) -> None:
        self.line = line

    def router_line(self, slot: int) -> dict[str, float]:
        return self.line


class _Sched:
    """Two workers; the policy always chooses worker 0 with 0.1 s of own TTFT; no decodes seen
    by this process (the pace rule has nothing to say); ``line``: worker 0's router line."""

    def __init__(self, line: dict[str, float]) -> None:
        self.decodes = SimpleNamespace(requests=lambda worker_id: [])
        self.seg = _Seg(line)
        self.learn = LEARN
        self.handle = SimpleNamespace(worker_id=0, breaker=SimpleNamespace(allow=lambda: True), snap=None)

    def decide(self, info, exclude=frozenset()):
        return self.handle, Decision(worker_id=0, reason="test", ttft_s=0.1)

    def candidates(self, model, exclude, fresh):
        return [self.handle]


@pytest.mark.parametrize("flag", [False, True])
def test_a_worker_without_decode_room_holds_its_request_only_with_the_flag(flag: bool):
    q: AdmissionQueue[str] = AdmissionQueue(AdmissionSection(enabled=True, decode_room=flag, hold_after_s=0.0))
    info = RequestInfo("/v1/chat/completions", "m", True, "", DOC)
    t = q.ticket("a", 0.0, prompt_tokens=DOC)
    assert judge_route(q, _Sched(_line(27, 27)), info, t, 0.0)[0] == GO       # room
    v = judge_route(q, _Sched(_line(27, 44)), info, t, 0.0)[0]
    assert v == (HOLD if flag else GO)     # the TTFT estimate (0.1 s) alone would send it
