"""What admission reads from a request's headers (:meth:`router.admission_gate.AdmissionGate.tag`):
the class, the tenant and the queue budget, with every other header passed over."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import cast

from router.admission_gate import AdmissionGate
from router.config import load_config
from router.policies.base import RequestInfo
from router.scheduling import Scheduler


def _gate(**admission: object) -> AdmissionGate:
    cfg = load_config(None, {f"admission.{k}": v for k, v in admission.items()})
    sched = cast(Scheduler, SimpleNamespace(policy=SimpleNamespace(report_ttft=False)))
    return AdmissionGate(cfg.admission, sched)


def _tag(gate: AdmissionGate, headers: list[tuple[bytes, bytes]], auth: bytes | None = None,
         tenant: str = "") -> RequestInfo:
    info = RequestInfo(tenant=tenant)
    gate.tag(info, headers, auth)
    return info


NOISE = [(b"host", b"127.0.0.1:30000"), (b"content-type", b"application/json"), (b"x-request-id", b"r1"),
         (b"x-session-id", b"s"), (b"user-agent", b"x-dplb-priority")]


def test_other_headers_set_nothing() -> None:
    info = _tag(_gate(), NOISE)
    assert (info.priority, info.tenant, info.queue_budget_s) == (None, "", None)


def test_priority_first_present_wins_and_is_clamped() -> None:
    g = _gate()
    assert _tag(g, [*NOISE, (b"x-smg-priority", b" 7 "), (b"x-dplb-priority", b"3")]).priority == 7
    assert _tag(g, [(b"x-dplb-priority", b"99999")]).priority == 1000
    assert _tag(g, [(b"x-dplb-priority", b"high"), (b"x-smg-priority", b"-2")]).priority == -2


def test_tenant_from_the_configured_header_then_the_key() -> None:
    g = _gate(tenant_header="X-Team")
    assert _tag(g, [*NOISE, (b"x-team", b" blue ")], auth=b"Bearer k").tenant == "blue"
    assert _tag(g, [(b"x-dplb-tenant", b"red")]).tenant == ""     # not the configured header
    assert _tag(g, NOISE, auth=b"Bearer k").tenant == "key:" + hashlib.sha256(b"Bearer k").hexdigest()[:12]
    assert _tag(g, NOISE, auth=b"Bearer k", tenant="body-user").tenant == "body-user"   # the body's user first


def test_budget_is_the_shorter_of_both_headers() -> None:
    g = _gate()
    assert _tag(g, [(b"x-dplb-queue-budget-ms", b"600"), (b"x-llm-d-inference-ttl", b"300ms")]).queue_budget_s == 0.3
    assert _tag(g, [(b"x-llm-d-inference-ttl", b"2s"), (b"x-dplb-queue-budget-ms", b"1500")]).queue_budget_s == 1.5
    assert _tag(g, [(b"x-dplb-queue-budget-ms", b"soon")]).queue_budget_s is None


def test_admission_off_reads_nothing() -> None:
    info = _tag(_gate(enabled=False), [(b"x-dplb-priority", b"3"), (b"x-dplb-queue-budget-ms", b"10")], auth=b"k")
    assert (info.priority, info.tenant, info.queue_budget_s) == (None, "", None)
