"""Property test: KV accounting never goes negative or over budget under random arrivals, aborts and
preemptions, reference counts always match the running requests' block lists, and a drained engine
holds no blocks."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore
from sim_engine.request import SimRequest, Status

# operations: ("add", prefix id, prompt length, max tokens) | ("abort", index) | ("step", count)
#             | ("abort_mid_step", index): abort a request between schedule() and complete()
op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 120), st.integers(1, 120)),
    st.tuples(st.just("abort"), st.integers(0, 1000)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 1000)),
    st.tuples(st.just("step"), st.integers(1, 30)),
)


def check(core: EngineCore) -> None:
    kv = core.kv
    kv.check(held=[r.blocks for r in core.running])
    assert 0 <= kv.num_used <= kv.num_blocks
    assert kv.num_free + kv.num_used == kv.num_blocks
    assert all(not r.blocks and r.status == Status.WAITING for r in core.waiting)
    assert all(r.status == Status.RUNNING for r in core.running)
    assert len(core.running) <= core.config.max_num_seqs
    for r in core.running:
        assert len(r.blocks) == kv.blocks_for(r.num_computed_tokens) or len(r.blocks) >= kv.blocks_for(
            r.num_computed_tokens
        )
        assert len(r.blocks) * kv.block_size >= r.num_computed_tokens


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=60),
    blocks=st.integers(10, 40),
    block_size=st.sampled_from([4, 16]),
    budget=st.sampled_from([32, 256, 8192]),
    max_seqs=st.integers(1, 16),
)
def test_kv_accounting_invariants(ops, blocks, block_size, budget, max_seqs):
    core = EngineCore(
        EngineConfig(
            num_gpu_blocks=blocks, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs
        )
    )
    prefixes = [[f"p{k}w{i}" for i in range(200)] for k in range(4)]
    all_reqs: list[SimRequest] = []
    now = 0.0
    for n, o in enumerate(ops):
        if o[0] == "add":
            _, k, plen, mt = o
            prompt = prefixes[k][:plen] + [f"u{n}"]
            if core.kv.blocks_for(len(prompt) + mt) > blocks:
                continue
            r = SimRequest(f"r{n}", prompt, mt, block_size)
            core.add_request(r, now)
            all_reqs.append(r)
        elif o[0] == "abort":
            if all_reqs:
                core.abort(all_reqs[o[1] % len(all_reqs)].request_id, now)
        elif o[0] == "abort_mid_step":  # the request is in the batch being computed
            plan = core.schedule(now)
            victim = plan.scheduled[o[1] % len(plan.scheduled)][0] if plan.scheduled else None
            if victim is not None:
                core.abort(victim.request_id, now)
                check(core)
                assert not victim.blocks
            now += plan.duration
            assert victim not in core.complete(plan, now)
        else:
            for _ in range(o[1]):
                plan = core.schedule(now)
                check(core)
                now += plan.duration
                core.complete(plan, now)
        check(core)
    steps = 0
    while core.has_work():
        _, d = core.step(now)
        now += d
        steps += 1
        check(core)
        assert steps < 20_000, "engine did not drain"
    assert core.kv.num_used == 0
    target(float(core.stats.num_preemptions), label="preemptions")
    assert all(r.status == Status.FINISHED for r in all_reqs)
    for r in all_reqs:
        assert r.finish_reason == "abort" or len(r.output) == r.max_tokens
    s = core.stats
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    assert sum(s.request_success.values()) == len(all_reqs)
