"""The simulator's behaviour: determinism, rejections, routing as the live router routes, staleness of
engine fields, capacity search, every policy available, and no segment ever left behind."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from dplb_trace.mooncake import TraceRequest
from router.config import Config
from router.policies import policy_names
from sim_engine.config import EngineConfig
from simulate import cluster as cl
from simulate import virtual
from simulate.capacity import find_capacity, min_engines
from simulate.cluster import Simulation
from simulate.settings import SLO, SimSettings
from simulate.stats import summarize
from simulate.workload import load_workload
from tests.helpers import ROOT, TRACE

pytestmark = pytest.mark.timeout(300)


def _leftover_segments() -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"dplb-sim-{os.getpid()}-")]


@pytest.fixture(autouse=True)
def no_segment_left():
    yield
    assert _leftover_segments() == []


def _req(i: int, t_ms: float, n_in: int, n_out: int, ids: tuple[int, ...] | None = None) -> TraceRequest:
    ids = ids if ids is not None else tuple(10_000 * (i + 1) + k for k in range(-(-n_in // 512)))
    return TraceRequest(index=i, timestamp_ms=t_ms, input_length=n_in, output_length=n_out, hash_ids=ids)


def _engines(n: int, **kw) -> list[EngineConfig]:
    return [EngineConfig(**kw) for _ in range(n)]


def _run(reqs, policy="dplb", n=4, **kw):
    eng = kw.pop("engines", None) or _engines(n)
    res = Simulation(reqs, SimSettings(engines=eng, policy=policy, **kw)).run()
    return res, summarize(res, len(eng))


def test_same_inputs_and_seed_give_the_same_figures_other_seed_differs():
    reqs = load_workload(TRACE, requests=150)
    a = _run(reqs, "power_of_two", seed=3, rate_scale=3)[1]
    b = _run(reqs, "power_of_two", seed=3, rate_scale=3)[1]
    c = _run(reqs, "power_of_two", seed=4, rate_scale=3)[1]
    assert a == b
    assert a["per_engine"]["requests"] != c["per_engine"]["requests"]


def test_cli_json_is_byte_identical_across_processes(tmp_path):
    """Same inputs and seed → the same JSON bytes, even with different str hash seeds."""
    outs = []
    for k, hs in enumerate(("1", "2")):
        out = tmp_path / f"o{k}.json"
        cp = subprocess.run([sys.executable, "-m", "simulate", "--requests", "60", "--engines", "3",
                             "--policy", "dplb,cache_aware", "--rate-scale", "2", "--seed", "7",
                             "--json-out", str(out), "--progress", "off"],
                            capture_output=True, text=True, cwd=ROOT, timeout=240, check=False,
                            env={**os.environ, "PYTHONHASHSEED": hs})
        assert cp.returncode == 0, cp.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    rows = json.loads(outs[0])
    assert [r["policy"] for r in rows] == ["dplb", "cache_aware"]
    for r in rows:
        assert r["settings"]["engines"] == 3 and r["settings"]["seed"] == 7 and r["settings"]["rate_scale"] == 2
        # the trace's first 60 arrive ten at a time (its 3 s grid): the router's admission queue
        # answers 429 to those that can no longer meet their deadline (docs/admission.md)
        assert r["served"] + r["rejected_by_status"].get("429", 0) == 60 and r["served"] >= 30
        assert r["ttft_s"]["p50"] > 0 and 0 <= r["prefix_hit_rate"] <= 1
        assert len(r["load_over_time"]["queue"]) == 3


@pytest.mark.parametrize("case", [
    # prompt + output over the context: 400 from the engine, passed through by agent and router
    {"engine": {"max_model_len": 4000}, "reqs": [(3000, 10), (3990, 20), (500, 5)], "rejected": {"400": 1}},
    # longer than the whole KV cache (64 blocks of 16 = 1024 tokens)
    {"engine": {"num_gpu_blocks": 64}, "reqs": [(900, 10), (1100, 1), (100, 5)], "rejected": {"400": 1}},
    # max_tokens 0 (an Azure row that generated nothing): 400
    {"engine": {}, "reqs": [(100, 0), (100, 3)], "rejected": {"400": 1}},
    {"engine": {}, "reqs": [(100, 3), (200, 3)], "rejected": {}},
])
def test_rejections_are_counted_with_the_live_status_and_the_run_goes_on(case):
    reqs = [_req(i, 100.0 * i, n_in, n_out) for i, (n_in, n_out) in enumerate(case["reqs"])]
    res, fig = _run(reqs, "round_robin", 2, engines=_engines(2, **case["engine"]))
    assert fig["rejected_by_status"] == case["rejected"]
    assert fig["served"] + fig["rejected"] == len(reqs)
    # the rejected request passed through the router and the agent and left nothing behind
    assert all(s in (200, 400) for s in res.status)


@pytest.mark.parametrize("policy,want", [
    # round robin rotates over the 4 workers from a seeded offset: 2 each
    ("round_robin", [2, 2, 2, 2]),
    # a burst of 8 at t=0 on idle workers: the router's in-flight counts (router_inflight, the
    # agent's in-flight, both immediate) spread it although no engine state was published yet
    ("shortest_queue", [2, 2, 2, 2]),
    ("dplb", [2, 2, 2, 2]),
])
def test_burst_spreads_as_the_live_router_spreads_it(policy, want):
    reqs = [_req(i, 0.0, 2000, 50) for i in range(8)]
    _res, fig = _run(reqs, policy, 4)
    assert sorted(fig["per_engine"]["requests"]) == want


def test_dplb_prefix_affinity_follows_the_shared_prefix():
    """A conversation's later turns extend its first prompt: the router's prefix index sends them
    to the worker that has the prefix, and that engine's cache hits it."""
    conv = tuple(range(500, 520))
    reqs = [_req(0, 0.0, 4000, 20, conv[:8])]
    reqs += [_req(i, 5000.0 * i, 4000 + 512 * i, 20, conv[:8 + i]) for i in range(1, 6)]
    res, fig = _run(reqs, "dplb", 4)
    assert len(set(res.worker)) == 1
    assert all(c >= 3900 for c in res.cached_tokens[1:])
    assert fig["prefix_hit_rate"] > 0.7


def test_policy_objects_come_from_build_policy_and_every_config_policy_runs(monkeypatch):
    built = []
    real = cl.build_policy

    def spy(name, *a, **kw):
        p = real(name, *a, **kw)
        built.append((name, type(p).__module__, kw.get("clock") is not None))
        return p

    monkeypatch.setattr(cl, "build_policy", spy)
    reqs = load_workload(TRACE, requests=12)
    for name in policy_names():
        _, fig = _run(reqs, name, 2)
        assert fig["served"] == 12
    assert [b[0] for b in built] == list(policy_names())
    assert all(mod.startswith("router.policies.") and clocked for _, mod, clocked in built)


def test_engine_fields_change_only_at_publication_ticks(monkeypatch):
    """What the router reads of running / waiting / KV usage is what the agent published at its
    last tick (stale in between), while the agent's in-flight count is current at every decision."""
    published: dict[int, list[tuple[int, tuple]]] = {}
    real_publish = virtual.Agent.publish_engine

    def publish(self, m):
        published.setdefault(self.worker_id, []).append(
            (self.writer.now_override_ns, (m.num_running, m.num_waiting, round(m.kv_cache_usage, 9))))
        return real_publish(self, m)

    seen = []
    real_select = cl.Scheduler.select

    def select(self, req, exclude=frozenset(), now=None):
        now_s = now
        now = virtual.OFFSET_NS + round(now_s * 1e9)
        i = sum(1 for x in seen if x[1] == 0)   # decisions so far = index of this request
        for s in self.seg.snapshot():
            seen.append((now, s.worker_id, (s.num_running, s.num_waiting, round(s.kv_cache_usage, 9)),
                         s.router_inflight, i))
        return real_select(self, req, exclude, now=now_s)

    monkeypatch.setattr(virtual.Agent, "publish_engine", publish)
    monkeypatch.setattr(cl.Scheduler, "select", select)
    reqs = load_workload(TRACE, requests=120)
    # binding on arrival (the admission queue off): every request is one select() at its arrival
    cfg = Config()
    cfg.admission.enabled = False
    res, _ = _run(reqs, "dplb", 3, rate_scale=4, state_interval_ms=500, router=cfg)
    stale = 0
    for now, wid, fields, inflight, i in seen:
        last = [f for t, f in published[wid] if t <= now][-1]
        assert fields == last
        # the router's own count (router line) moves with every dispatch and finish, between ticks
        # too: requests routed before this one (index < i) to this worker and not finished yet
        t_now = (now - virtual.OFFSET_NS) / 1e9
        true_inflight = sum(1 for j in range(i) if res.worker[j] == wid and
                            res.arrival[j] + res.e2e[j] > t_now + 1e-9)
        assert inflight == true_inflight
        stale += fields[0] + fields[1] != inflight
    assert stale > 0       # the published queue does lag behind


@pytest.mark.parametrize("admission", [False, True], ids=["admission_off", "admission_on"])
def test_segment_is_unlinked_when_the_run_fails(monkeypatch, admission):
    def boom(*a, **kw):
        raise RuntimeError("policy exploded")

    # decide() is the routing step of both paths: select() (binding on arrival) and the admission
    # queue's route_ticket()
    monkeypatch.setattr(cl.Scheduler, "decide", boom)
    cfg = Config.model_validate({"admission": {"enabled": admission}})
    with pytest.raises(RuntimeError, match="policy exploded"):
        _run(load_workload(TRACE, requests=5), "dplb", 2, router=cfg)
    assert _leftover_segments() == []


@pytest.mark.parametrize("threshold,start,want", [(3.7, 1.0, 3.7), (0.3, 1.0, 0.3), (1.0, 1.0, 1.0), (40.0, 2.0, 40.0)])
def test_capacity_bisection_brackets_the_threshold(threshold, start, want):
    """Against a run whose TTFT p99 crosses the SLO at a known rate multiple."""
    calls = []

    def run(st: SimSettings):
        calls.append(st.rate_scale)
        p99 = 10.0 * st.rate_scale / threshold
        return {"served": 10, "aborted_early": False, "ttft_s": {"p99": p99}, "tpot_s": {"p99": None}}

    base = SimSettings(engines=_engines(1))
    out = find_capacity(run, base, SLO(ttft_p99_s=10.0), rate=2.0, start=start, tolerance=0.01)
    assert out["bound"] == "found"
    assert want / 1.011 <= out["capacity_rate_scale"] <= want
    assert out["capacity_requests_per_s"] == pytest.approx(2 * out["capacity_rate_scale"], rel=1e-3)
    assert len(calls) == len(set(calls)) < 20


@pytest.mark.parametrize("admission", [False, True], ids=["admission_off", "admission_on"])
def test_capacity_and_min_engines_on_a_small_trace(admission):
    """With admission on, overload is shed (429) instead of queued: shed requests count as misses,
    so overloaded probes still fail and stop early."""
    reqs = load_workload(TRACE, requests=80, max_tokens_cap=64)
    cfg = Config.model_validate({"admission": {"enabled": admission}})
    base = SimSettings(engines=_engines(2), policy="shortest_queue", router=cfg)
    slo = SLO(ttft_p99_s=12.0)

    def run(st):
        return summarize(Simulation(reqs, st).run(), len(st.engines))

    cap = find_capacity(run, base, slo, rate=None, tolerance=0.1)
    x = cap["capacity_rate_scale"]
    assert cap["bound"] == "found" and x is not None
    assert cap["figures"]["ttft_s"]["p99"] <= 12.0
    above = [p for p in cap["probes"] if p["x"] > x * 1.001]
    assert above and not any(p["ok"] for p in above)
    assert any(p["aborted_early"] for p in cap["probes"])     # overloaded probes stop early
    me = min_engines(run, replace(base, rate_scale=x * 1.5), slo, max_engines=8)
    assert me["min_engines"] is not None and me["min_engines"] >= 2
    probes = {p["engines"]: p["ok"] for p in me["probes"]}
    assert probes[me["min_engines"]] and not probes.get(me["min_engines"] - 1, False)


def test_heterogeneous_engines_the_slow_one_gets_less_from_a_load_aware_policy():
    reqs = load_workload(TRACE, requests=200)
    eng = _engines(4)
    eng[3] = replace(eng[3], slowdown=4.0)
    _, fig = _run(reqs, "shortest_queue", engines=eng, rate_scale=3)
    counts = fig["per_engine"]["requests"]
    assert counts[3] < min(counts[:3])


def test_router_config_reaches_the_policy(tmp_path):
    """--config's routing_policy (here: cache_aware's threshold) changes the decisions."""
    reqs = load_workload(TRACE, requests=100)
    a = _run(reqs, "cache_aware", 4, rate_scale=2)[1]
    cfg = Config.model_validate({"routing_policy": {"cache_threshold": 1.0}})
    b = _run(reqs, "cache_aware", 4, rate_scale=2, router=cfg)[1]
    assert a["per_engine"]["requests"] != b["per_engine"]["requests"]


def test_stack_overhead_delays_each_request_to_its_engine_and_the_router_learns_from_it():
    """``stack_overhead_s``: the engine gets each request that long after the router dispatched it
    (its lease taken), so every TTFT carries it and the router's learned prefill rate, which sees
    dispatch to first token, comes out lower (the live router's, simulate.fidelity)."""
    # spaced requests (1 s apart, 2 engines, 4-8k new tokens each): no queueing, every one learnt from
    reqs = [_req(i, 1000.0 * i, 4096 + 512 * (i % 8), 4) for i in range(24)]
    base, _ = _run(reqs, n=2, seed=1)
    slow, fig = _run(reqs, n=2, seed=1, stack_overhead_s=0.05)
    assert fig["served"] == len(reqs)
    for i in range(len(reqs)):
        # the engine schedules it 0.05 s later (its queue time counts from the client's arrival)
        assert slow.queue[i] >= 0.05 - 1e-9
        assert slow.ttft[i] == pytest.approx(base.ttft[i] + 0.05, abs=0.01)
    learned = [r for r in base.prefill_rate if r > 0]
    assert learned and all(0 < s < b for s, b in zip(slow.prefill_rate, base.prefill_rate) if b > 0)


def test_stack_overhead_flag_reaches_the_settings(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "simulate", "--trace", str(TRACE), "--requests", "20", "--engines", "2",
                    "--progress", "off", "--stack-overhead-ms", "40", "--json-out", str(out)],
                   check=True, capture_output=True, cwd=ROOT, timeout=240)
    row = json.loads(out.read_text())[0]
    assert row["settings"]["stack_overhead_ms"] == 40.0
    assert row["queue_s"]["p50"] >= 0.04
