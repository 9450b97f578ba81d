"""Scenarios 1-5 of issue 8 (workers die, hang, fail, all go away, are drained and removed);
see :mod:`bench.faultsuite.scenarios`."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from bench.faultsuite.cluster import MODEL_SIM, Stack
from bench.faultsuite.common import (
    DispatchWatch,
    Result,
    StatusWatch,
    admin_call,
    circuit_of,
    eligible,
    wait_time,
)
from bench.faultsuite.load import Outcome, chat, steady

# ------------------------------------------------------------------------------------ scenario 1


def run_kill_engine(target: str = "engine", workers: int = 3, rate: float = 25.0, duration: float | None = None,
                    kill_at: float = 1.2, max_tokens: int = 48) -> Result:
    """Scenario 1: ``kill -9`` worker 0's engine (``target="engine"``: the sim engine under the
    agent, which restarts it after its backoff, default 1 s) or the whole worker (``target="worker"``:
    agent and engine; nothing restarts an agent) under steady load of alternating streamed /
    non-streamed chats through real agents and sim engines (time scale 1).

    Counted: only requests in flight on worker 0 at the kill may fail, honestly (a 502 or an SSE
    error event naming worker 0); every other request — those not yet started, and those that
    reached worker 0's agent after its engine died (refused: 503, retried) — must succeed. Worker
    0's timeline in ``/dplb/status`` and ``dplb_worker_ready`` is recorded (``extra``)."""
    if duration is None:
        duration = 9.0 if target == "engine" else 3.0
    res = Result(f"1 kill -9 {target}", f"SIGKILL of worker 0's {'sim engine' if target == 'engine' else 'agent + engine'}"
                 f" at t={kill_at}s under {rate:.0f} req/s")
    box: dict[str, float] = {}
    with Stack() as st:
        st.agents_up(workers, "--max-num-seqs", "64")
        base = st.router({}, ready=workers)
        a0 = st.agents[0]
        engine_pid = a0.engine_pid()

        def kill() -> None:
            import os
            import signal

            box["t"] = time.monotonic()
            if target == "engine":
                os.kill(engine_pid, signal.SIGKILL)
            else:
                # the whole worker: the agent's group and the engine's own session (an engine
                # outlives its agent, so killing the agent alone leaves it serving)
                st.kill(a0.proc)
                os.killpg(os.getpgid(engine_pid), signal.SIGKILL)

        with DispatchWatch(st.seg, 0) as watch, StatusWatch(base, 0) as status:
            outs = asyncio.run(steady(base, rate, duration,
                                      lambda i: chat(stream=i % 2 == 0, max_tokens=max_tokens, model=MODEL_SIM, tag=i),
                                      events={kill_at: kill}, timeout=30))
            time.sleep(0.3)
        res.add(outs)
        t_kill = box["t"]
        t_back = status.first(lambda smp: smp[2] == "eligible", after=status.first(
            lambda smp: smp[1] != "ready", after=t_kill) or float("inf"))
        # the slot left DEAD (restart began) here: dispatches after it are the worker coming back
        t_restart = watch.state_at("STARTING", t_kill)
        res.detection_s = watch.detection_after(t_kill, until=t_restart)
        res.recovery_s = None if t_back is None else round(t_back - t_kill, 3)
        # dispatches to worker 0 the router made from 0.6 s after the kill until its restart began,
        # read off the router's own dispatch counter: a client's send time says nothing of when a
        # busy router dispatched the request (it may reach worker 0 once that is back, rightly)
        res.extra["after_kill_dispatched_to_0"] = sum(1 for t in watch.changes if t_kill + 0.6 < t and
                                                      (t_restart is None or t < t_restart))
        res.extra["dead_s"] = None if t_restart is None else round(t_restart - t_kill, 3)
        res.extra["served_by_0_after_back"] = sum(1 for o in outs if t_back is not None and o.t_start > t_back
                                                  and o.worker == "0" and o.kind == "ok")
        res.extra["failed_not_in_flight_on_0"] = [o.detail for o in outs if o.kind != "ok" and
                                                  not (o.worker == "0" and o.t_start < t_kill)]
        res.extra["failed_in_flight"] = sum(1 for o in outs if o.kind != "ok")
        res.extra["by_worker"] = dict(sorted(Counter(o.worker for o in outs).items(), key=str))
        res.extra["states0"] = status.states()
        res.extra["ready_gauge0"] = status.gauges()
        res.extra["row0"] = st.row(base, 0)
        res.extra["slot0"] = st.seg.read_slot(0)
    return res


# ------------------------------------------------------------------------------------ scenario 2


def run_hung_worker(rate: float = 20.0, duration: float = 3.0, stop_at: float = 0.8,
                    first_byte_timeout_s: float = 1.0, retry_on_timeout: bool = False) -> Result:
    """Scenario 2a: worker 0 is frozen with SIGSTOP (its socket still accepts, nothing answers)
    under steady load spread round robin; the router's ``first_byte_timeout_s`` is ``first_byte_timeout_s``. The
    requests caught on it time out once: 504 naming worker 0 (default), or run again elsewhere
    with ``retry_on_timeout``. Detection: until the router stops dispatching to it; recovery:
    SIGCONT until it is eligible."""
    res = Result("2a hung worker (SIGSTOP)" + (", retry_on_timeout" if retry_on_timeout else ""),
                 f"SIGSTOP of worker 0 at t={stop_at}s, first_byte_timeout_s={first_byte_timeout_s}"
                 + (", retries.retry_on_timeout" if retry_on_timeout else ""))
    import signal

    box: dict[str, float] = {}
    with Stack() as st:
        for i in range(3):
            st.fake(i)
        # round robin: a third of the requests land on worker 0 whatever the load on this machine
        # (the router stops dispatching to a frozen worker within about 0.1 s, so with instant
        # answers and a load-aware policy nothing may be in flight there to test)
        base = st.router({"router": {"first_byte_timeout_s": first_byte_timeout_s},
                          "retries": {"retry_on_timeout": retry_on_timeout},
                          "routing_policy": {"policy": "round_robin"}}, ready=3)
        p0 = st.fakes[0].proc

        def freeze() -> None:
            box["t"] = st.kill(p0, signal.SIGSTOP)

        try:
            with DispatchWatch(st.seg, 0) as watch:
                # every answer takes 0.25 s, so requests are in flight on worker 0 when it freezes
                outs = asyncio.run(steady(base, rate, duration, lambda i: chat(tag=i), events={stop_at: freeze},
                                          headers={"X-Fake-Mode": "slow", "X-Fake-Delay": "0.25"},
                                          timeout=first_byte_timeout_s * 4 + 10))
            res.add(outs)
            res.detection_s = watch.detection_after(box["t"])
            res.extra["eligible_while_hung"] = eligible(st, base, 0)
            res.extra["slowest_s"] = round(max(o.t_end - o.t_start for o in outs), 3)
            res.extra["timed_out"] = sum(1 for o in outs if o.t_end - o.t_start >= first_byte_timeout_s)
            res.extra["status_504_on_0"] = sum(1 for o in outs if o.status == 504 and o.worker == "0")
            res.extra["failed_not_504_on_0"] = [o.detail for o in outs if o.kind != "ok" and
                                                not (o.status == 504 and o.worker == "0")]
        finally:
            t_cont = st.kill(p0, signal.SIGCONT)
        res.recovery_s = wait_time(lambda: eligible(st, base, 0), t_cont, 20, "worker 0 back after SIGCONT")
    return res


def run_engine_hang(n: int = 16, first_byte_timeout_s: float = 0.5, retry_on_timeout: bool = False) -> Result:
    """Scenario 2b: worker 0's agent answers probes but its requests hang (a hung engine). Requests
    sent to it time out after ``first_byte_timeout_s``: answered 504 (default) or retried on
    worker 1 (``retry_on_timeout``); either way worker 0's breaker opens and takes it out."""
    res = Result("2b hung engine (probes pass)" + (", retry_on_timeout" if retry_on_timeout else ""),
                 f"worker 0 never answers requests, first_byte_timeout_s={first_byte_timeout_s}"
                 + (", retries.retry_on_timeout" if retry_on_timeout else ""))
    with Stack() as st:
        st.fake(0, "--mode", "hang")
        st.fake(1)
        base = st.router({"router": {"first_byte_timeout_s": first_byte_timeout_s},
                          "retries": {"retry_on_timeout": retry_on_timeout},
                          "routing_policy": {"policy": "round_robin"},
                          "circuit_breaker": {"minimum_requests": 4, "open_time_s": 60}}, ready=2)
        t0 = time.monotonic()
        with DispatchWatch(st.seg, 0) as watch:
            outs = asyncio.run(steady(base, 8.0, n / 8.0, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
        res.extra["circuit0"] = circuit_of(st, base, 0)
        res.extra["served"] = dict(Counter(o.worker for o in outs))
        res.extra["tried_on_hung"] = st.fakes[0].client().stats()["requests"]
        res.extra["statuses"] = dict(Counter(o.status for o in outs))
        # load start → last request sent to the hung worker (its breaker opened after that one)
        res.detection_s = None if res.extra["circuit0"] != "open" else round(watch.detection_after(t0), 3)
    return res


def run_long_prefill_default(delay: float = 3.0) -> Result:
    """Scenario 2c: with the default config, a worker that takes ``delay`` s before its first byte
    (a long prefill) is not cut off by the router."""
    res = Result("2c long prefill, default timeout", f"worker answers after {delay}s (default config)")
    with Stack() as st:
        st.fake(0, "--mode", "slow", "--delay", str(delay))
        base = st.router({}, ready=1)
        outs = asyncio.run(steady(base, 4.0, 1.0, lambda i: chat(tag=i, stream=i % 2 == 1), timeout=delay + 20))
        res.add(outs)
        res.extra["min_latency_s"] = round(min(o.t_end - o.t_start for o in outs), 3)
    return res


# ------------------------------------------------------------------------------------ scenario 3


def run_breaker(n_fail: int = 30, open_time_s: float = 2.5, min_requests: int = 6) -> Result:
    """Scenario 3: worker 0 answers 500 → its breaker opens (requests are retried on worker 1);
    it recovers → a half-open probe closes the breaker. Then worker 0 answers 400 and 429 for a
    while: its breaker stays closed with a failure rate of 0."""
    res = Result("3 breaker (500, then 400/429)", "worker 0 answers 500, then recovers; then 400 and 429")
    with Stack() as st:
        f0 = st.fake(0, "--mode", "500")
        st.fake(1)
        # the operator opts into retrying 500s (the default retries only 429/503: what cost nothing)
        base = st.router({"circuit_breaker": {"minimum_requests": min_requests, "open_time_s": open_time_s},
                          "retries": {"retry_on_status": [429, 500, 503]}}, ready=2)
        t0 = time.monotonic()
        with DispatchWatch(st.seg, 0) as watch:
            outs = asyncio.run(steady(base, 20.0, n_fail / 20.0, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
        res.extra["circuit_after_500s"] = circuit_of(st, base, 0)
        res.extra["segment_circuit"] = st.seg.read_slot(0).circuit
        res.extra["requests_to_0_500"] = f0.client().stats()["requests"]
        res.detection_s = round(watch.detection_after(t0), 3)
        f0.client().set_mode("ok")
        t1 = time.monotonic()

        async def until_closed() -> list[Outcome]:
            from bench.faultsuite.load import send
            got: list[Outcome] = []
            async with httpx.AsyncClient(base_url=base, timeout=15) as c:
                while circuit_of(st, base, 0) != "closed" and time.monotonic() - t1 < open_time_s + 15:
                    got.append(await send(c, chat(tag=len(got))))
                    await asyncio.sleep(0.05)
            return got

        outs = asyncio.run(until_closed())
        res.add(outs)
        res.recovery_s = round(time.monotonic() - t1, 3)
        res.extra["circuit_after_recovery"] = circuit_of(st, base, 0)
        res.extra["served_by_0_after"] = sum(1 for o in outs if o.worker == "0")
        # 4xx / 429: the client's or backpressure's doing, never the worker's fault. Load goes on
        # in 0.5 s rounds until worker 0 has answered more of them than the breaker's
        # minimum_requests (how many the policy sends it depends on timing), at most 8 rounds.
        for code in ("400", "429"):
            f0.client().set_mode(code, reset_stats=True)
            for _ in range(8):
                res.add(asyncio.run(steady(base, 20.0, 0.5, lambda i: chat(tag=i), timeout=15)))
                if f0.client().stats()["requests"] >= min_requests + 2:
                    break
            res.extra[f"requests_to_0_{code}"] = f0.client().stats()["requests"]
            row = st.row(base, 0)
            res.extra[f"circuit_after_{code}"] = row["circuit"] if row else None
            res.extra[f"failure_rate_after_{code}"] = row["failure_rate"] if row else None
    return res


# ------------------------------------------------------------------------------------ scenario 4


def run_all_dead() -> Result:
    """Scenario 4: both workers are killed (``kill -9``). The router stays up, ``/health`` is 503,
    requests get 503 + Retry-After (OpenAI-shaped); worker 0 is restarted on the same socket and
    rejoins without a router restart. Detection: kill → /health 503; recovery: restart → a 200."""
    res = Result("4a all workers dead", "kill -9 of both workers, then worker 0 restarted on the same socket")
    with Stack() as st:
        st.fake(0)
        st.fake(1)
        base = st.router({}, ready=2)
        router_proc = st.routers[-1][0]
        t_kill = time.monotonic()
        for h in list(st.fakes.values()):
            st.kill(h.proc)
        res.detection_s = round(wait_time(lambda: httpx.get(base + "/health", timeout=5).status_code == 503,
                                           t_kill, 10, "/health 503"), 3)
        hr = httpx.get(base + "/health", timeout=5)
        res.extra["health"] = (hr.status_code, hr.headers.get("retry-after"))
        outs = asyncio.run(steady(base, 10.0, 1.0, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
        res.extra["statuses_while_dead"] = dict(Counter(o.status for o in outs))
        res.extra["retry_after"] = sorted({_retry_after(base)})
        t_back = time.monotonic()
        st.fake(0)
        res.recovery_s = round(wait_time(lambda: httpx.post(base + "/v1/chat/completions", json=chat(),
                                                             timeout=5).status_code == 200,
                                          t_back, 20, "worker 0 serving again"), 3)
        outs = asyncio.run(steady(base, 10.0, 1.0, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
        res.extra["served_after"] = dict(Counter(o.worker for o in outs))
        res.extra["router_alive"] = router_proc.poll() is None
        res.extra["health_after"] = httpx.get(base + "/health", timeout=5).status_code
    return res


def _retry_after(base: str) -> str | None:
    return httpx.post(base + "/v1/chat/completions", json=chat(), timeout=5).headers.get("retry-after")


# ------------------------------------------------------------------------------------ scenario 5

def run_drain_remove_cycles(rate: float = 20.0, duration: float = 3.2) -> Result:
    """Scenario 5: under steady load of 1 s streams and short chats on two workers, worker 0 is
    drained, undrained, removed and re-added, then worker 1 is removed and re-added. Every request
    must finish; afterwards every in-flight count (segment router atomics, router-local handles,
    agents' own counters) must be exactly zero — never negative, never leaked."""
    res = Result("5 drain/remove/re-add cycles", "drain, undrain, remove, re-add of workers with requests in flight")
    with Stack() as st:
        f0, f1 = st.fake(0), st.fake(1)
        # the admission queue's TPOT rule off: the fake's streams pace at 0.1 s per chunk, exactly
        # the default bound (tpot_slo_s), which admission reads as a full batch and holds requests
        # for (docs/admission.md) until the streams end; the removals must find requests in flight
        # on the removed worker. The queue itself stays in the path (its TTFT rule, tiny prompts).
        base = st.router({"admission": {"tpot_slo_s": 0}}, ready=2)
        calls: list[tuple[float, float, str, int, list[int]]] = []

        turn = threading.Condition()

        def act(k: int, method: str, path: str, busy: int | None = None, **kw: Any) -> Callable[[], None]:
            def run() -> None:
                # each call in its own thread at its offset: on a busy machine a later one can start
                # first (a re-add before its removal: 409); each waits for the calls before it
                with turn:
                    turn.wait_for(lambda: len(calls) >= k, timeout=15)
                # a removal waits (up to 2 s, while the load goes on) until the worker it removes
                # has a request in flight: on a busy machine the offsets alone do not ensure it
                give_up = time.monotonic() + 2.0
                while busy is not None and time.monotonic() < give_up:
                    if (f0, f1)[busy].client().stats()["active"] > 0:
                        break
                    time.sleep(0.01)
                active = [f.client().stats()["active"] for f in (f0, f1)]
                t = time.monotonic()
                code = admin_call(base, method, path, **kw)
                with turn:
                    calls.append((t, time.monotonic(), path, code, active))
                    turn.notify_all()
            return run

        events = {0.5: act(0, "POST", "/dplb/workers/0/drain"), 1.1: act(1, "POST", "/dplb/workers/0/undrain"),
                  1.6: act(2, "DELETE", "/dplb/workers/0", busy=0),
                  2.1: act(3, "POST", "/dplb/workers", json={"endpoint": f0.endpoint}),
                  2.5: act(4, "DELETE", "/dplb/workers/1", busy=1),
                  2.9: act(5, "POST", "/dplb/workers", json={"endpoint": f1.endpoint})}
        def hdr(i: int) -> dict[str, str]:  # streams of 10 chunks 0.1 s apart; chats answered after 0.3 s
            if i % 2 == 0:
                return {"x-fake-mode": "stream", "x-fake-chunks": "10", "x-fake-delay": "0.1"}
            return {"x-fake-mode": "slow", "x-fake-delay": "0.3"}

        def body(i: int) -> dict[str, Any]:
            return chat(tag=i, stream=i % 2 == 0)

        outs = asyncio.run(steady(base, rate, duration, body, headers=hdr, timeout=20, events=events))
        res.add(outs)
        res.extra["admin_calls"] = [(p, c) for _, _, p, c, _ in calls]
        # requests in flight on (worker 0, worker 1) when each admin call was made
        res.extra["active_at_calls"] = [a for *_, a in calls]
        t_drain = calls[0][1]
        t_undrain = calls[1][0]
        res.extra["sent_to_0_while_drained"] = sum(1 for o in outs if t_drain + 0.05 < o.t_start < t_undrain
                                                   and o.worker == "0")
        res.extra["served"] = dict(Counter(o.worker for o in outs))
        time.sleep(0.5)
        res.extra["router_inflight"] = [st.seg.read_slot(i).router_inflight for i in (0, 1)]
        res.extra["agent_inflight"] = [st.seg.read_slot(i).inflight for i in (0, 1)]
        res.extra["fake_active"] = [f.client().stats()["active"] for f in (f0, f1)]
        res.extra["local_inflight"] = {w["id"]: w["local_inflight"] for w in st.status(base)}
        res.extra["eligible_end"] = {w["id"]: w["eligible"] for w in st.status(base)}
    return res


def run_remote_rejoin() -> Result:
    """Scenario 4 for a remote worker (``host:port`` in ``backend_servers``, mirrored into a slot):
    it is killed, the router answers 503 + Retry-After, it is restarted on the same address and
    rejoins without a router restart. Detection: kill → ``/health`` 503; recovery: restart → a 200."""
    from bench.fakes import start_fake
    from launcher.stack import free_port

    res = Result("4b remote worker dead, back on the same address", "kill -9 of the only (TCP, mirrored) worker, "
                 "restarted on the same port")
    with Stack() as st:
        port = free_port()
        f = start_fake(st.procs, None, 0, st.dir, port=port)
        base = st.router({"backend_servers": [{"endpoint": f"127.0.0.1:{port}"}]}, ready=1)
        t_kill = st.kill(f.proc)
        res.detection_s = round(wait_time(lambda: httpx.get(base + "/health", timeout=5).status_code == 503,
                                          t_kill, 10, "/health 503"), 3)
        outs = asyncio.run(steady(base, 10.0, 0.5, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
        res.extra["statuses_while_dead"] = dict(Counter(o.status for o in outs))
        t_back = time.monotonic()
        start_fake(st.procs, None, 0, st.dir, port=port)
        res.recovery_s = round(wait_time(lambda: httpx.post(base + "/v1/chat/completions", json=chat(),
                                                            timeout=5).status_code == 200,
                                         t_back, 20, "remote worker serving again"), 3)
        outs = asyncio.run(steady(base, 10.0, 0.5, lambda i: chat(tag=i), timeout=15))
        res.add(outs)
        res.extra["served_after"] = dict(Counter(o.worker for o in outs))
    return res
