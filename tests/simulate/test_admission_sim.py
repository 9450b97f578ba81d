"""The router's admission queue in the simulated cluster (simulate/admission.py over router/admission.py):
a flood above capacity keeps the high class served, a flooding tenant does not starve a light one,
nothing waits past its budget unanswered, and turning admission off restores binding on arrival."""
from __future__ import annotations

import itertools
import os
import random

import pytest

from dplb_trace.mooncake import TraceRequest
from router.config import Config
from sim_engine.config import EngineConfig
from simulate.admission import SHED_STATUS, admission_figures
from simulate.cluster import Simulation
from simulate.settings import AttainmentSLO, SimSettings
from simulate.stats import slo_attainment

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def no_segment_left():
    yield
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"dplb-sim-{os.getpid()}-")] == []


def _flood(n: int, seconds: float, seed: int = 0) -> list[TraceRequest]:
    """``n`` requests of 1,000-3,000 prompt tokens and 20-120 output tokens, uniform over
    ``seconds``: far above what two engines serve in that time."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        n_in = rng.randint(1000, 3000)
        ids = tuple(1_000_000 * (i + 1) + k for k in range(-(-n_in // 512)))
        out.append(TraceRequest(index=i, timestamp_ms=1000.0 * seconds * i / n, input_length=n_in,
                                output_length=rng.randint(20, 120), hash_ids=ids))
    return out


def _run(reqs, enabled=True, **kw):
    cfg = Config()
    cfg.admission.enabled = enabled
    st = SimSettings(engines=[EngineConfig() for _ in range(2)], policy="dplb", router=cfg, **kw)
    res = Simulation(reqs, st).run()
    att = slo_attainment(res, AttainmentSLO())
    return res, att, admission_figures(res, att)


def test_flood_above_capacity_keeps_the_high_class_served():
    reqs = _flood(400, 10.0)
    prios = [1 if i % 10 < 3 else 0 for i in range(len(reqs))]     # 30 % high
    res, att, adm = _run(reqs, priorities=prios)
    high, low = adm["by_class"]["1"], adm["by_class"]["0"]
    assert adm["shed"] > 0                              # over capacity: some are answered 429
    assert high["shed"] == 0 and low["shed"] == adm["shed"]
    assert high["attainment"] >= 0.95
    assert high["attainment"] > low["attainment"] + 0.2
    # every request was answered: served or 429, none left waiting
    assert all(s in (200, SHED_STATUS) for s in res.status)
    # without admission the same flood leaves both classes far below
    _, att_off, adm_off = _run(reqs, enabled=False, priorities=prios)
    assert adm_off["shed"] == 0
    assert att["met"] > att_off["met"]
    assert high["attainment"] > adm_off["by_class"]["1"]["attainment"] + 0.2


def test_a_flooding_tenant_does_not_starve_a_light_one():
    reqs = _flood(330, 8.0, seed=1)
    tenants = ["light" if i % 11 == 0 else "heavy" for i in range(len(reqs))]
    _, _, adm = _run(reqs, tenants=tenants)
    light, heavy = adm["by_tenant"]["light"], adm["by_tenant"]["heavy"]
    assert heavy["shed"] > 0
    assert light["attainment"] >= 0.9
    assert light["attainment"] > heavy["attainment"]


def test_nothing_waits_past_its_budget():
    reqs = _flood(300, 6.0, seed=2)
    cfg_budget = 2.0
    cfg = Config()
    cfg.admission.enabled = True
    cfg.admission.shed_late = False            # late requests wait: only the budget answers them
    cfg.admission.queue_budget_s = cfg_budget
    st = SimSettings(engines=[EngineConfig() for _ in range(2)], policy="dplb", router=cfg)
    res = Simulation(reqs, st).run()
    shed = [i for i, s in enumerate(res.status) if s == SHED_STATUS]
    assert shed
    poll = cfg.admission.poll_ms / 1000.0
    assert all(res.waited[i] is not None and cfg_budget - 1e-9 <= res.waited[i] <= cfg_budget + poll + 1e-9 for i in shed)
    served_waits = [w for i, w in enumerate(res.waited) if res.status[i] == 200 and w is not None]
    assert max(served_waits) < cfg_budget


def test_the_queue_is_judged_again_every_poll_while_requests_wait(monkeypatch):
    """As the live router's poller (router/admission_gate.py ``_poll``): while requests wait, the
    queue is pumped at least every ``admission.poll_ms``, not only when a request gets its first
    token or ends or an agent publishes. What the TPOT rules read (a decode's pace and slack)
    changes with every decode step and with time alone."""
    from simulate.admission import SimAdmission

    pumps: list[tuple[float, int]] = []   # (time, requests still waiting after the pump)
    real = SimAdmission.pump

    def pump(self, t):
        real(self, t)
        pumps.append((t, self.waiting))

    monkeypatch.setattr(SimAdmission, "pump", pump)
    reqs = _flood(400, 10.0)
    _, _, adm = _run(reqs)
    assert adm["queued"] > 50
    poll = Config().admission.poll_ms / 1000.0
    gaps = [(t1 - t0, t0) for (t0, w0), (t1, _) in itertools.pairwise(pumps) if w0 > 0]
    assert len(gaps) > 100
    worst = max(gaps)
    assert worst[0] <= poll + 1e-9, f"nothing judged the queue for {worst[0]:.3f} s after t={worst[1]:.3f} s"
