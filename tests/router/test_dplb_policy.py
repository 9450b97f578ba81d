"""The default ``dplb`` policy (estimated TTFT) on a real segment and kernel, and the router-owned
accounting it reads (router/accounting.py, router/scheduling.py)."""
from __future__ import annotations

import random

import pytest

from dplb_shm import TtftParams
from router.accounting import LearnSettings, RequestAccount, prefill_work
from router.policies import DplbPolicy, PrefixIndex, RequestInfo
from tests.helpers import ready_segment

NOW_NS = 10 ** 15
WORDS = " ".join(f"w{i}" for i in range(3000))  # 3,000 "tokens" of shared history


@pytest.fixture
def seg():
    with ready_segment(4, NOW_NS, endpoint="/tmp/dplb-dp/{}.sock") as s:
        yield s


def policy(seg) -> DplbPolicy:
    return DplbPolicy(seg, TtftParams(), PrefixIndex(64), rng=random.Random(0), clock=lambda: NOW_NS)


def info(text: str) -> RequestInfo:
    return RequestInfo(text=text, prompt_len=len(text.split()), stream=True)


def snaps(seg, ids=range(4)):
    return [seg.read_slot(i) for i in ids]


def test_follow_up_turn_goes_to_the_worker_that_holds_its_history(seg):
    pol = policy(seg)
    pol.on_dispatch(2, info(WORDS))
    d = pol.choose(snaps(seg), info(WORDS + " and one more question"))
    assert d.worker_id == 2 and d.reason == "prefix"
    assert d.uncached_tokens < 100 and d.est_s is not None and d.est_s > 0


def test_hot_prefix_escapes_when_queueing_there_costs_more_than_recomputing(seg):
    pol = policy(seg)
    pol.on_dispatch(2, info(WORDS))
    seg.prefill_add(2, 200_000)  # 6.5 s of queued prefill on the holder; recomputing 3k tokens ~0.1 s
    d = pol.choose(snaps(seg), info(WORDS + " another"))
    assert d.worker_id != 2 and d.uncached_tokens == len((WORDS + " another").split())


def test_a_prefix_every_worker_has_pulls_nothing(seg):
    pol = policy(seg)
    system = " ".join(f"s{i}" for i in range(600))
    for i in range(4):
        pol.on_dispatch(i, info(system))
    seg.prefill_add(0, 5000)
    seg.prefill_add(1, 5000)
    seg.prefill_add(3, 5000)
    d = pol.choose(snaps(seg), info(system + " " + " ".join(f"q{i}" for i in range(200))))
    assert d.worker_id == 2  # the only one without queued prefill


def test_workers_not_offered_are_excluded_in_the_kernel(seg):
    pol = policy(seg)
    for _ in range(20):
        d = pol.choose(snaps(seg, [1, 3]), info("hello there"))
        assert d.worker_id in (1, 3)


def test_explain_rows_show_each_term_in_seconds(seg):
    pol = policy(seg)
    seg.prefill_add(1, 30_769)
    d = pol.choose(snaps(seg), info("a b c"), explain=True)
    rows = {r["worker_id"]: r for r in d.scores}
    assert set(rows) == {0, 1, 2, 3}
    assert rows[1]["prefill_s"] == pytest.approx((30_769 + 3) / 30_769)
    for r in rows.values():
        assert {"est_s", "prefill_s", "decode_s", "kv_s", "batch_s", "interf_s", "miss_s", "queue_tokens",
                "uncached_tokens", "rate"} <= set(r)
        assert r["est_s"] == pytest.approx(r["prefill_s"] + r["decode_s"] + r["kv_s"] + r["batch_s"]
                                           + r["interf_s"] + r["miss_s"])


def test_kv_above_threshold_everywhere_still_routes_by_estimate(seg):
    # overload: every KV cache above the threshold; the estimate (not request counts) decides
    for i in range(4):
        seg.writer(i).publish(kv_cache_usage=0.95, heartbeat_ns=NOW_NS)
    seg.writer(2).publish(kv_cache_usage=0.85, heartbeat_ns=NOW_NS)
    seg.router_inflight_add(2, 5)   # more requests there, but far less KV pressure
    d = policy(seg).choose(snaps(seg), info("x y"))
    assert (d.worker_id, d.reason) == (2, "kv_full")
    seg.router_inflight_add(2, -5)


def test_no_live_worker_in_the_kernel_falls_back_to_least_loaded(seg):
    for i in range(4):  # stale heartbeats: the kernel sees nobody, the router still has candidates
        seg.writer(i).publish(heartbeat_ns=NOW_NS - 10 ** 10)
    ws = snaps(seg)
    d = policy(seg).choose(ws, info("x y"))
    assert d.reason == "fallback"


# ---- accounting ------------------------------------------------------------------------------

def line(seg, i):
    return seg.router_line(i)


def test_account_moves_tokens_from_prefill_to_decode_and_back_to_zero(seg):
    a = RequestAccount(seg, 1, prompt_tokens=5000, uncached_tokens=4000, now=10.0)
    assert (line(seg, 1)["router_inflight"], line(seg, 1)["prefill_tokens"]) == (1, 4000)
    b = RequestAccount(seg, 1, prompt_tokens=100, uncached_tokens=100, now=10.1)
    assert b.queue_ahead == 4000
    assert a.first_token(10.5) == pytest.approx(0.5)
    assert a.first_token(10.6) is None                                   # exactly once
    ln = line(seg, 1)
    assert (ln["prefill_tokens"], ln["decode_reqs"], ln["decode_ctx_tokens"]) == (100, 1, 5000)
    assert a.finish(11.0) and not a.finish(11.1)                         # exactly once
    assert b.finish(11.2)                                                # finished without a first token
    ln = line(seg, 1)
    assert (ln["router_inflight"], ln["prefill_tokens"], ln["decode_reqs"], ln["decode_ctx_tokens"]) == (0, 0, 0, 0)


def test_rate_is_learned_from_observed_ttft_only(seg):
    ls = LearnSettings(min_tokens=1000, step_base_s=0.0, decode_seq_s=0.0, decode_ctx_s=0.0)
    a = RequestAccount(seg, 0, 8000, 8000, now=0.0, learn=ls)
    a.first_token(0.8)                                   # 8,000 tokens in 0.8 s: 10,000 tokens/s
    assert line(seg, 0)["prefill_rate"] == pytest.approx(10_000.0)
    assert line(seg, 0)["router_ttft_s"] == pytest.approx(0.8)
    b = RequestAccount(seg, 0, 8000, 8000, now=1.0, learn=ls)
    b.first_token(1.001, observed=False)                 # inferred (non-streamed): teaches nothing
    c = RequestAccount(seg, 0, 500, 500, now=2.0, learn=ls)
    c.first_token(2.5)                                   # too few tokens to be a prefill sample
    assert line(seg, 0)["prefill_rate_n"] == 1
    for x in (a, b, c):
        x.finish(3.0)


def test_prefill_work_prices_attention_over_the_context():
    assert prefill_work(1000, 1000, 0.0) == 1000                       # A = 0: plain tokens
    assert prefill_work(1000, 1000, 1000.0) == pytest.approx(1500.0)   # u·(1 + (0 + u/2)/A)
    assert prefill_work(100, 1000, 1000.0) == pytest.approx(195.0)     # after 900 cached: 100·(1 + 950/1000)
    assert prefill_work(-1.0, 1000, 1000.0) == -1.0                    # a ruled-out slot stays ruled out
    # Llama-3.1-8B's A: an 85k-token prompt is 2.4 times its tokens of work, a 1k one 1.02 times
    assert prefill_work(85_000, 85_000, 30_500.0) / 85_000 == pytest.approx(2.393, abs=1e-3)
    assert prefill_work(1_000, 1_000, 30_500.0) / 1_000 == pytest.approx(1.016, abs=1e-3)


def test_the_line_is_charged_prefill_work_and_long_and_short_prompts_teach_the_same_rate(seg):
    a_tok = 30_500.0
    rate = 30_000.0                  # an engine whose prefill takes work / rate seconds
    long, short = 60_000, 2_000
    for slot, a in ((0, a_tok), (2, 0.0)):
        ls = LearnSettings(min_tokens=1000, step_base_s=0.0, decode_seq_s=0.0, decode_ctx_s=0.0, attention_tokens=a)
        x = RequestAccount(seg, slot, long, long, now=0.0, learn=ls)
        assert line(seg, slot)["prefill_tokens"] == round(prefill_work(long, long, a))
        x.first_token(prefill_work(long, long, a_tok) / rate)
        y = RequestAccount(seg, slot + 1, short, short, now=0.0, learn=ls)
        y.first_token(prefill_work(short, short, a_tok) / rate)
        for r in (x, y):
            r.finish(100.0)
        assert line(seg, slot)["prefill_tokens"] == line(seg, slot + 1)["prefill_tokens"] == 0
    # in work per second both workers learn the engine's rate
    assert line(seg, 0)["prefill_rate"] == pytest.approx(rate, rel=1e-3)
    assert line(seg, 1)["prefill_rate"] == pytest.approx(rate, rel=1e-3)
    # in plain tokens the worker that served the long prompt looks half as fast as the other
    assert line(seg, 2)["prefill_rate"] < 0.55 * line(seg, 3)["prefill_rate"]


def test_the_kernel_prices_prefill_work_and_route_rows_show_both(seg):
    pol = DplbPolicy(seg, TtftParams(), PrefixIndex(64), rng=random.Random(0), clock=lambda: NOW_NS,
                     attention_tokens=30_500.0)
    d = pol.choose(snaps(seg), info(WORDS), explain=True)
    work = prefill_work(3000, 3000, 30_500.0)
    for row in d.scores:
        assert row["uncached_tokens"] == 3000 and row["prefill_work"] == pytest.approx(work)
        assert row["prefill_s"] == pytest.approx(work / TtftParams().prefill_rate)
    assert d.uncached_tokens == 3000          # the lease converts tokens to work itself


def test_a_non_streamed_request_answered_as_a_stream_teaches_its_ttft_but_not_the_rate(seg):
    # its decode load at dispatch was not read (observed=False), and the rate needs it
    ls = LearnSettings(min_tokens=1000, step_base_s=0.0, decode_seq_s=0.0, decode_ctx_s=0.0)
    a = RequestAccount(seg, 2, 8000, 8000, now=0.0, learn=ls, observed=False)
    assert a.first_token(0.8) == pytest.approx(0.8)
    assert line(seg, 2)["router_ttft_s"] == pytest.approx(0.8)
    assert line(seg, 2)["prefill_rate_n"] == 0
    a.finish(1.0)


def test_scheduler_sweep_moves_blind_requests_past_their_estimate(seg):
    from router.config import load_config
    from router.metrics import Metrics
    from router.scheduling import Scheduler
    from router.workers import Registry

    cfg = load_config(None, {"routing_policy.policy": "round_robin"})
    reg = Registry(seg, cfg)
    reg.sync(seg.snapshot())
    from router.policies import RoundRobinPolicy

    sch = Scheduler(reg, RoundRobinPolicy(rng=random.Random(0)), seg, Metrics(), default_rate=1000.0)
    r = RequestInfo(text="a " * 500, prompt_len=500, stream=False)
    lease, _ = sch.select(r, now=100.0)
    wid = lease.handle.worker_id
    assert line(seg, wid)["prefill_tokens"] == 500
    assert sch.sweep(now=100.4) == 0                     # 500 tokens at 1,000/s: 0.5 s estimated
    assert sch.sweep(now=100.6) == 1
    assert line(seg, wid)["prefill_tokens"] == 0 and line(seg, wid)["decode_reqs"] == 1
    lease.release(now=101.0)
    assert line(seg, wid)["decode_reqs"] == 0 and line(seg, wid)["router_inflight"] == 0
    assert not sch.blind


class _Written:
    """A connection the fake transport wrote on; ``closed`` once the proxy gave up on it."""

    def __init__(self) -> None:
        self.closed = False
        self.transport = self

    def close(self) -> None:
        self.closed = True


class _Answer:
    status = 200
    is_stream = False
    request_id = b"r1"
    whole = None
    answered = False

    def __init__(self) -> None:
        self.headers = [(b"content-type", b"application/json")]

    async def first_chunk(self) -> bytes:
        return b'{"ok":1}'

    async def read(self, first: bytes) -> bytes:
        return first

    def release(self, abort: bool = False) -> None:
        return None


class _OrderTransport:
    """Records the worker's router line at the moment the request is written, and what send got."""

    def __init__(self, seg) -> None:
        self.seg = seg
        self.at_write: list[dict] = []
        self.conns: list[_Written] = []
        self.sent_written: list[object] = []

    def write_pooled(self, endpoint, method, path, headers, body):
        wid = int(endpoint.rsplit("/", 1)[1].split(".")[0])
        self.at_write.append(self.seg.router_line(wid))
        self.conns.append(_Written())
        return self.conns[-1]

    async def send(self, endpoint, method, path, headers, body, timeout_s=None, written=None, on_whole=None, deadline=None):
        self.sent_written.append(written)
        return _Answer()


def _proxy(seg, transport):
    from router.config import load_config
    from router.metrics import Metrics
    from router.proxy import Proxy, ProxySettings
    from router.scheduling import Scheduler
    from router.workers import Registry

    reg = Registry(seg, load_config(None, {}))
    reg.sync(seg.snapshot())
    sch = Scheduler(reg, policy(seg), seg, Metrics())
    return Proxy(sch, transport, Metrics(), ProxySettings()), sch


def _exchange(req, send):
    from router.exchange import Exchange

    return Exchange("POST", "/v1/completions", "/v1/completions", [], b"{}", req, b"r1", 0.0, send)


async def test_the_request_reaches_the_engine_before_the_lease_and_the_lease_before_any_await(seg):
    t = _OrderTransport(seg)
    proxy, sch = _proxy(seg, t)
    sent: list[dict] = []

    async def send(msg) -> None:
        sent.append(msg)

    req = info("hello " * 40)
    await proxy.forward(_exchange(req, send))
    assert sent[0]["status"] == 200 and sent[1]["body"] == b'{"ok":1}'
    assert t.at_write[0]["router_inflight"] == 0 and t.at_write[0]["dispatched"] == 0   # written first
    assert t.sent_written == [t.conns[0]]                    # send only waits for that connection's head
    wid = next(i for i in range(4) if line(seg, i)["dispatched"] == 1)    # then the lease was taken
    assert line(seg, wid)["router_inflight"] == 0 and len(sch.policy.index) > 0   # released; prefix indexed


async def test_a_lease_that_fails_after_the_write_closes_that_connection(seg):
    t = _OrderTransport(seg)
    proxy, sch = _proxy(seg, t)

    def broken(*a, **k):
        raise RuntimeError("lease failed")

    sch.lease = broken   # type: ignore[method-assign]

    async def send(msg) -> None:
        raise AssertionError("nothing is answered from here")

    with pytest.raises(RuntimeError):
        await proxy.forward(_exchange(info("x y"), send))
    assert len(t.conns) == 1 and t.conns[0].closed                     # the engine is told to stop


def test_cluster_cost_terms_are_config_keys():
    """``routing_policy.w_interf`` / ``w_miss`` / ``interf_batch_cap`` reach the kernel's parameters (each term switchable)."""
    from router.config import load_config
    from router.state import ttft_params

    p = ttft_params(load_config(None, {"routing_policy.w_interf": 0.0, "routing_policy.w_miss": 2.5,
                                       "routing_policy.interf_batch_cap": 0}))
    assert (p.w_interf, p.w_miss, p.interf_batch_cap) == (0.0, 2.5, 0.0)
    d = ttft_params(load_config(None))
    assert (d.w_interf, d.w_miss, d.interf_batch_cap) == (TtftParams().w_interf, TtftParams().w_miss, 64.0)


@pytest.mark.parametrize("name", ["dplb", "weighted", "cache_aware", "lmetric", "kv_cost"])
def test_the_configured_prefix_index_size_is_the_one_used(seg, name):
    """``prefix_max_chunks`` / ``prefix_chunk_chars`` reach the policy's index. An empty
    :class:`PrefixIndex` is falsy (``__len__`` 0), so ``index or PrefixIndex()`` silently swapped
    the configured index for the default one (2,048 chunks: a 54k-token document was credited
    half its cached prefix on docqa; issue 29 item 4)."""
    from router.config import load_config
    from router.policies import build_policy
    from router.state import scoring_params, ttft_params

    cfg = load_config(None, {"routing_policy.prefix_max_chunks": 4096, "routing_policy.prefix_chunk_chars": 32})
    pol = build_policy(name, cfg.routing_policy, kernel=seg, params=scoring_params(cfg),
                       ttft_params=ttft_params(cfg), rng=random.Random(0), clock=lambda: NOW_NS)
    assert (pol.index.max_chunks, pol.index.chunk_chars) == (4096, 32)
