"""The pure engine core, driven step by step in simulated time (no server, no clock)."""

from __future__ import annotations

import pytest

from sim_engine.config import EngineConfig
from sim_engine.engine import EngineCore
from sim_engine.errors import (
    ContextLengthError,
    EngineCapacityError,
    InvalidRequestError,
)
from sim_engine.request import SimRequest, Status


def words(prefix: str, n: int) -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def make(cfg: EngineConfig | None = None, **kw) -> EngineCore:
    return EngineCore(cfg or EngineConfig(**kw))


def add(core: EngineCore, rid: str, prompt: list[str], max_tokens: int, now: float = 0.0, **kw) -> SimRequest:
    r = SimRequest(rid, prompt, max_tokens, core.config.block_size, **kw)
    core.add_request(r, now)
    return r


def run_until_idle(core: EngineCore, now: float = 0.0, max_steps: int = 100_000) -> float:
    for _ in range(max_steps):
        if not core.has_work():
            return now
        _, d = core.step(now)
        now += d
    raise AssertionError("engine did not drain")


def test_single_request_generates_max_tokens_and_frees_blocks_as_cached():
    core = make()
    r = add(core, "a", words("w", 40), 5)
    now = run_until_idle(core)
    assert r.status == Status.FINISHED and r.finish_reason == "length"
    assert len(r.output) == 5
    assert core.kv.num_used == 0
    # 45 tokens: 2 full blocks of prompt+output hashed and still cached after the finish
    assert core.kv.num_cached == 2
    assert core.stats.generation_tokens == 5 and core.stats.prompt_tokens == 40
    assert core.stats.ttft.count == 1 and core.stats.itl.count == 4 and core.stats.e2e.count == 1
    assert now > 0


def test_prefix_hit_lowers_ttft_and_counts_hits_then_eviction_removes_it():
    cfg = EngineConfig(num_gpu_blocks=400)  # 6400 tokens
    core = make(cfg)
    shared = words("s", 3000)
    a = add(core, "a", shared + words("a", 100), 2)
    now = run_until_idle(core)
    hits_before = core.stats.prefix_cache_hits
    b = add(core, "b", shared + words("b", 100), 2, now=now)
    now = run_until_idle(core, now)
    ttft_a = a.first_token_time - a.arrival
    ttft_b = b.first_token_time - b.arrival
    assert core.stats.prefix_cache_hits - hits_before == b.num_cached_tokens >= 2992  # 187 full blocks
    assert ttft_b < ttft_a / 5
    # evict: unrelated prompts that need every block
    for i in range(3):
        add(core, f"fill{i}", words(f"f{i}x", 6000), 1, now=now)
        now = run_until_idle(core, now)
    hits_before = core.stats.prefix_cache_hits
    c = add(core, "c", shared + words("b", 100), 2, now=now)
    run_until_idle(core, now)
    assert core.stats.prefix_cache_hits == hits_before and c.num_cached_tokens == 0
    assert c.first_token_time - c.arrival > 5 * ttft_b
    assert core.kv.evictions > 0


def test_full_prompt_hit_still_computes_one_token():
    core = make()
    p = words("p", 64)  # exactly 4 blocks
    add(core, "a", p, 1)
    now = run_until_idle(core)
    b = add(core, "b", p, 1, now=now)
    run_until_idle(core, now)
    assert b.num_cached_tokens == 48  # the last block is recomputed so that one token is computed


def test_chunked_prefill_respects_token_budget():
    core = make(max_num_batched_tokens=512)
    r = add(core, "a", words("p", 2000), 1)
    chunks = []
    while r.status != Status.FINISHED:
        plan = core.schedule(0.0)
        assert sum(n for _, n in plan.scheduled) <= 512
        chunks.append(plan.scheduled[0][1])
        core.complete(plan, 0.0)
    assert chunks == [512, 512, 512, 464]


def test_max_num_seqs_and_fcfs_admission():
    core = make(max_num_seqs=2)
    reqs = [add(core, f"r{i}", words(f"q{i}", 10), 3) for i in range(4)]
    core.step(0.0)
    assert [r.request_id for r in core.running] == ["r0", "r1"]
    assert [r.request_id for r in core.waiting] == ["r2", "r3"]
    run_until_idle(core)
    assert reqs[0].first_token_time <= reqs[2].first_token_time
    assert all(r.finish_reason == "length" for r in reqs)


def test_kv_exhaustion_makes_requests_wait_then_preempts_by_recompute():
    core = make(num_gpu_blocks=40, block_size=16)  # 640 tokens
    reqs = [add(core, f"r{i}", words(f"x{i}", 100), 150) for i in range(5)]  # 7 blocks each at admission
    core.step(0.0)
    assert len(core.running) == 5
    more = [add(core, f"m{i}", words(f"y{i}", 100), 150) for i in range(3)]
    now, saw_waiting = 0.0, False
    while core.has_work():
        _, d = core.step(now)
        now += d
        saw_waiting |= len(core.waiting) > 0
        assert 0 <= core.kv.num_used <= 40
    assert saw_waiting
    assert core.stats.num_preemptions > 0
    assert sum(r.num_preemptions for r in reqs + more) == core.stats.num_preemptions
    # recompute keeps outputs: every request still produced exactly max_tokens tokens
    assert all(len(r.output) == 150 and r.finish_reason == "length" for r in reqs + more)
    assert core.kv.num_used == 0


def test_abort_frees_blocks_immediately_and_is_skipped_by_inflight_step():
    core = make()
    r = add(core, "a", words("p", 100), 50)
    core.step(0.0)
    assert core.kv.num_used == 7
    plan = core.schedule(1.0)
    assert core.abort("a", 1.0) is r
    assert core.kv.num_used == 0 and r.finish_reason == "abort"
    assert core.complete(plan, 1.1) == []
    assert core.stats.request_success["abort"] == 1
    assert core.abort("a", 2.0) is None


def test_stop_string_finishes_with_stop():
    core = make(seed=3)
    probe = add(core, "probe", ["x"], 20)
    run_until_idle(core)
    target = probe.output[5]
    core2 = make(seed=3)
    r = add(core2, "probe", ["x"], 20, stop=[target])
    run_until_idle(core2)
    assert r.finish_reason == "stop" and r.stop_matched == target
    assert len(r.output) <= 6


def test_seed_makes_outputs_repeatable():
    outs = []
    for _ in range(2):
        core = make(seed=7)
        rs = [add(core, f"r{i}", words("a", 30), 10) for i in range(3)]
        run_until_idle(core)
        outs.append([r.output for r in rs])
    assert outs[0] == outs[1]
    core = make(seed=8)
    r = add(core, "r0", words("a", 30), 10)
    run_until_idle(core)
    assert r.output != outs[0][0]


def test_step_time_grows_with_batch_context_and_prefill():
    cfg = EngineConfig()
    core = make(cfg)
    add(core, "a", words("a", 10), 3)
    core.step(0.0)
    _, d1 = core.step(0.0)  # one decode
    core2 = make(cfg)
    for i in range(64):
        add(core2, f"r{i}", words(f"b{i}", 2000), 100)
    for _ in range(20):  # 16 prefill steps of 8192 tokens, then decodes
        core2.step(0.0)
    plan = core2.schedule(0.0)
    assert plan.num_decode_seqs == 64 and plan.num_prefill_tokens == 0
    ctx = sum(r.num_computed_tokens + 1 for r, _ in plan.scheduled)
    assert ctx > 64 * 2000
    expected = cfg.base_step_ms / 1e3 + 64 * cfg.per_seq_ms / 1e3 + ctx * cfg.per_context_token_ns / 1e9
    assert plan.duration == pytest.approx(expected, rel=1e-6)
    assert plan.duration > d1
    slow = make(EngineConfig(slowdown=3.0))
    add(slow, "a", words("a", 10), 3)
    slow.step(0.0)
    _, d3 = slow.step(0.0)
    assert d3 == pytest.approx(3 * d1)


def test_validation_errors():
    core = make(max_model_len=100, num_gpu_blocks=4)
    with pytest.raises(ContextLengthError):
        core.validate(90, 20)
    with pytest.raises(EngineCapacityError):
        core.validate(60, 10)  # 70 tokens = 5 blocks > 4
    with pytest.raises(InvalidRequestError):
        core.validate(0, 1)
    add(core, "a", ["x"], 1)
    with pytest.raises(InvalidRequestError):
        add(core, "a", ["y"], 1)


def test_requests_admitted_in_the_same_step_share_one_prefill():
    core = make()
    shared = words("sys", 320)  # 20 full blocks
    a = add(core, "a", shared + words("a", 5), 2)
    b = add(core, "b", shared + words("b", 5), 2)
    plan = core.schedule(0.0)
    assert [(r.request_id, n) for r, n in plan.scheduled] == [("a", 325), ("b", 5)]
    assert b.num_cached_tokens == 320 and core.stats.prefix_cache_hits == 320
    assert a.blocks[:20] == b.blocks[:20]  # the same physical blocks, referenced twice
    assert plan.num_prefill_tokens == 330
    core.complete(plan, plan.duration)
    run_until_idle(core, plan.duration)
    assert core.kv.num_used == 0


def test_abort_during_the_step_withdraws_blocks_it_published():
    core = make()
    p = words("p", 100)  # 6 full blocks published when scheduled, computed only at complete()
    add(core, "a", p, 3)
    plan = core.schedule(0.0)
    assert core.kv.num_cached == 6
    core.abort("a", 0.0)
    assert core.kv.num_cached == 0 and core.kv.num_used == 0
    core.complete(plan, plan.duration)
    b = add(core, "b", p, 1, now=1.0)
    run_until_idle(core, 1.0)
    assert b.num_cached_tokens == 0  # nothing was computed for "a", so nothing to reuse


@pytest.mark.parametrize("reserve,admitted_second", [(True, False), (False, True)])
def test_admission_reserves_the_whole_prompt_like_vllm(reserve, admitted_second):
    """vLLM 0.32's scheduler_reserve_full_isl: a waiting request is admitted only when its whole
    prompt's blocks are free, not only its first chunk (otherwise it is preempted later)."""
    core = make(block_size=16, num_gpu_blocks=40, max_num_batched_tokens=64, max_num_seqs=8,
                reserve_full_prompt=reserve)
    add(core, "a", words("a", 320), 40)         # 20 blocks (+ 3 while decoding), running
    for _ in range(6):                          # its prompt is done: it decodes, 1 token a step
        core.step(0.0)
    add(core, "b", words("b", 400), 4)          # 25 blocks: fewer are free, its first chunk (4) fits
    plan = core.schedule(1.0)
    assert ("b" in [r.request_id for r, _ in plan.scheduled]) is admitted_second


def test_output_channel_is_done_only_when_its_last_events_are_drained():
    # a stream's consumer can be suspended in a write while the runner pushes a burst's remaining
    # tokens, the last one included: the channel must not call itself done before they are sent
    import asyncio

    from sim_engine.runner import OutputChannel

    req = SimRequest("r", words("p", 4), 3, 16)
    ch = OutputChannel(1)
    req.append_output("a")
    ch.push(0, req, 1)
    got = [k for _, _, k in asyncio.run(ch.drain())]
    for w in ("b", "c"):
        req.append_output(w)
    req.finish_reason = "length"
    ch.push(0, req, 2)
    ch.push(0, req, 3)
    assert not ch.done, "the choice finished but two of its tokens are still buffered"
    got += [k for _, _, k in asyncio.run(ch.drain())]
    assert got == [1, 2, 3] and ch.done
