"""A request of a class with a lower class active that one routing decision judges late keeps its
place until its deadline passes (router/admission.py ``pump``).

The decision that says "late" chose one worker (a cold one while the worker holding the request's
cached prefix is busy, say); the next try may choose another where the deadline still holds.
Moving the request to the late list at the first such verdict put it behind every on-time request
of every class, where it stayed until it was shed (agentic, 4 engines, seed 0, 2x capacity: the
high class's 6 sheds; bench/results/admission.md, round 6). The lowest class active goes late at
the first such verdict, as before (the room it fills is the reserve)."""
from __future__ import annotations

from router.admission import DEADLINE, GO, LATE, WAIT, AdmissionQueue, Ticket
from router.config import AdmissionSection


def _queue(**kw: object) -> AdmissionQueue[str]:
    kw.setdefault("hold_after_s", 0.0)
    kw.setdefault("ttft_slo_base_s", 1.0)
    kw.setdefault("ttft_slo_per_1k_s", 0.0)
    return AdmissionQueue(AdmissionSection.model_validate(kw))


def test_a_request_judged_late_once_is_tried_first_again_and_goes_when_a_decision_meets_its_deadline():
    """``a`` (deadline 1.0) is judged late at 0.2 (the decision's worker: 0.9 s); ``b`` (deadline
    1.1) has no room. At 0.3 a decision for ``a`` meets its deadline: ``a`` is tried first and
    goes. Before, ``a`` sat on the late list behind ``b``, whose WAIT ended the pump."""
    q = _queue()
    q.ticket("low", 0.0, 10, priority=0)          # a lower class is active
    a = q.ticket("a", 0.0, 10, priority=1)
    b = q.ticket("b", 0.1, 10, priority=1)
    q.offer(a)
    q.offer(b)
    verdicts = {("a", 0.2): LATE, ("b", 0.2): WAIT, ("a", 0.3): GO, ("b", 0.3): WAIT}
    tried: list[tuple[str, float]] = []

    def at(now: float):
        def try_dispatch(t: Ticket[str]) -> str:
            tried.append((t.payload, now))
            return verdicts[(t.payload, now)]
        return try_dispatch

    assert q.pump(0.2, at(0.2)).dispatched == []
    assert not a.late and q.depth == 2
    assert tried == [("a", 0.2), ("b", 0.2)]          # passed over, the one behind it tried
    out = q.pump(0.3, at(0.3))
    assert [t.payload for t in out.dispatched] == ["a"]
    assert tried[2] == ("a", 0.3)


def test_in_a_sustained_backlog_it_is_shed_when_its_deadline_passes_not_at_the_first_late_verdict():
    """``shed_late`` in a backlog older than ``late_backlog_s``: a request judged late is answered
    429 (reason ``deadline``) once its deadline has passed, not while another decision could
    still meet it."""
    q = _queue(shed_late=True, late_backlog_s=0.0)
    q.ticket("low", 0.0, 10, priority=0)
    x = q.ticket("x", 0.0, 10, priority=1)
    q.offer(x)
    out = q.pump(0.5, lambda t: LATE)
    assert out.shed == [] and q.depth == 1 and not x.late
    out = q.pump(1.2, lambda t: WAIT)      # past its deadline (1.0)
    assert [(t.payload, r) for t, r in out.shed] == [("x", DEADLINE)]
    assert q.depth == 0


def test_the_lowest_class_goes_late_at_the_first_late_verdict():
    """One class only (nobody below it): a late verdict moves the request to the late list (and,
    in a sustained backlog, answers it 429) at once, as it always did."""
    q = _queue(shed_late=True, late_backlog_s=0.0)
    x = q.ticket("x", 0.0, 10)
    q.offer(x)
    out = q.pump(0.5, lambda t: LATE)
    assert [(t.payload, r) for t, r in out.shed] == [("x", DEADLINE)]
