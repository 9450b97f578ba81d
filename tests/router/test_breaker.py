"""The per-worker circuit breaker (router/breaker.py): minimum requests, threshold, half-open probe, window."""
from __future__ import annotations

import pytest

from router.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_needs_minimum_requests_before_opening():
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=Clock())
    for _ in range(19):
        cb.record(False)
    assert cb.state == CLOSED          # 19 failures out of 19, but fewer than 20 requests
    cb.record(False)
    assert cb.state == OPEN


@pytest.mark.parametrize("failures,successes,opens", [
    (3, 17, False),    # 15.0 % is not above 15 %
    (4, 16, True),     # 20 %
    (15, 85, False),   # 15 % over 100
    (16, 84, True),
])
def test_breaker_threshold(failures, successes, opens):
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=Clock())
    for _ in range(successes):
        cb.record(True)
    for _ in range(failures):
        cb.record(False)
    assert (cb.state == OPEN) is opens


def test_breaker_half_open_admits_one_probe_and_closes_on_success():
    clock = Clock()
    changes = []
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=clock, on_change=changes.append)
    for _ in range(20):
        cb.record(False)
    assert not cb.allow() and not cb.available()
    clock.t += 5.0
    assert cb.available() and cb.state == HALF_OPEN
    assert cb.allow()            # the probe
    assert not cb.allow()        # only one at a time
    cb.record(True)
    assert cb.state == CLOSED and cb.allow() and cb.failure_rate == 0.0
    assert changes == [OPEN, HALF_OPEN, CLOSED]


def test_breaker_half_open_failure_reopens_and_abandon_frees_probe():
    clock = Clock()
    cb = CircuitBreaker(0.15, 20, 100, 5.0, clock=clock)
    for _ in range(20):
        cb.record(False)
    clock.t += 6
    assert cb.allow()
    cb.abandon()                 # client left: no verdict, the probe slot is free again
    assert cb.allow()
    cb.record(False)
    assert cb.state == OPEN and not cb.allow()


def test_breaker_sliding_window_forgets_old_failures():
    cb = CircuitBreaker(0.15, 20, 20, 5.0, clock=Clock())
    for _ in range(3):
        cb.record(False)
    for _ in range(40):
        cb.record(True)
    assert cb.failure_rate == 0.0
    for _ in range(3):
        cb.record(False)
    assert cb.state == CLOSED     # 3/20 = 15 %, not above
