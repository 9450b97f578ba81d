"""Scenarios 13-19 (issue 15: stays up and tells the truth), run by ``tests/faults/test_stays_up.py``
and ``bench/faults.py``; see :mod:`bench.faultsuite.scenarios`.

13 an engine that keeps crashing: restarted with backoff, then DEAD (gave up), admin restart
14 dead, draining and removed workers in /dplb/status, /dplb/workers, /metrics and the dump
15 a slow request: one 504 on one worker, not run again on every worker
16 first-byte vs idle timeout: a long prefill passes, a stalled stream is a timeout
17 round robin and prefix state per model
18 header limits (431 before the body; memory flat under an unfinished huge header)
19 admin behind a proxy / beyond loopback
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx
import orjson

from bench.faultsuite.cluster import MODEL_FAKE, MODEL_SIM, Stack
from bench.faultsuite.common import Result, metric_value
from bench.faultsuite.load import Outcome, chat, classify, send, sse_events
from launcher.stack import ROOT, free_port, wait_for
from router.config import Config


def _outcome(r: httpx.Response, t0: float, stream: bool = False) -> Outcome:
    o = Outcome(t0, time.monotonic(), stream, status=r.status_code, worker=r.headers.get("x-dplb-worker-id"),
                body=r.content)
    return classify(o)


def _row(base: str, wid: int, path: str = "/dplb/status") -> dict[str, Any] | None:
    rows = httpx.get(base + path, timeout=10).json()["workers"]
    return next((w for w in rows if w["id"] == wid), None)


# ----------------------------------------------------------------------------------- scenario 13

def run_crash_loop_gave_up_then_admin_restart() -> Result:
    """Scenario 13: worker 0's engine (real agent, ``--restart-max 1``) is killed twice: the first
    crash is restarted after the backoff, the second exceeds the budget and the worker stays DEAD
    with reason ``gave_up``, visible in /dplb/status and /metrics; ``POST /dplb/workers/0/restart``
    brings it back. Requests meanwhile go to worker 1."""
    res = Result("13 engine crash loop: gave up, admin restart",
                 "kill -9 of worker 0's engine twice (--restart-max 1, backoff 0.3 s), then an admin restart")
    with Stack() as st:
        st.agents_up(2, agent_args=("--restart-max", "1", "--restart-backoff", "0.3"))
        base = st.router({}, ready=2)
        a0 = st.agents[0]
        t0 = time.monotonic()
        os.kill(a0.engine_pid(), signal.SIGKILL)
        wait_for(lambda: st.seg.read_slot(0).restarts == 1 and st.seg.read_slot(0).state.name == "READY", 60,
                   what="first crash restarted")
        res.extra["first_restart_s"] = round(time.monotonic() - t0, 3)
        t1 = time.monotonic()
        os.kill(a0.engine_pid(), signal.SIGKILL)
        wait_for(lambda: (_row(base, 0) or {}).get("state_reason") == "gave_up", 30, what="gave up in /dplb/status")
        res.detection_s = round(time.monotonic() - t1, 3)
        row = _row(base, 0)
        res.extra["row_gave_up"] = {k: row[k] for k in ("state", "state_reason", "restarts", "last_exit_code",
                                                         "eligible", "routing", "restart_in_s")}
        res.extra["listed_in_workers"] = _row(base, 0, "/dplb/workers") is not None
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["metrics_gave_up"] = {
            "ready": metric_value(text, "dplb_worker_ready", worker="0"),
            "dead": metric_value(text, "dplb_worker_state", worker="0", state="dead"),
            "restarts": metric_value(text, "dplb_worker_engine_restarts_total", worker="0")}
        outs = asyncio.run(_some(base, 10))
        res.add(outs)
        res.extra["served_while_dead"] = dict(Counter(o.worker for o in outs))
        time.sleep(1.0)
        res.extra["restarts_after_wait"] = st.seg.read_slot(0).restarts   # no attempt of its own
        t2 = time.monotonic()
        r = httpx.post(base + "/dplb/workers/0/restart", timeout=15)
        res.extra["admin_restart"] = (r.status_code, r.json())
        wait_for(lambda: (_row(base, 0) or {}).get("eligible") is True, 60, what="worker 0 back after admin restart")
        res.recovery_s = round(time.monotonic() - t2, 3)
        res.extra["slot_after"] = {"state": st.seg.read_slot(0).state.name, "restarts": st.seg.read_slot(0).restarts}
        res.extra["unknown_restart"] = httpx.post(base + "/dplb/workers/9/restart", timeout=10).status_code
        outs = asyncio.run(_some(base, 12))
        res.add(outs)
        res.extra["served_after"] = dict(Counter(o.worker for o in outs))
        with open(a0.log, errors="replace") as f:
            log = f.read()
        res.extra["agent_log_says"] = [s for s in ("exited unexpectedly with code -9", "last lines", "giving up",
                                                   "restarting engine") if s in log]
    return res


async def _some(base: str, n: int, **kw: Any) -> list[Outcome]:
    async with httpx.AsyncClient(base_url=base, timeout=30) as c:
        return [await send(c, chat(tag=i, model=kw.get("model"))) for i in range(n)]


# ----------------------------------------------------------------------------------- scenario 14

def run_dead_and_departed_workers_in_plain_sight() -> Result:
    """Scenario 14: worker 0 (real agent, restarts off) loses its engine; worker 2 (a fake) turns
    DRAINING; every state must read the same in /dplb/status, /dplb/workers, /metrics and
    ``dplb-shm-dump --json``. Then worker 2 is removed (admin) and worker 0's agent stops (slot
    EMPTY): their series leave /metrics and their rows the listings."""
    res = Result("14 dead workers in plain sight", "engine of worker 0 killed (restarts off), worker 2 draining, "
                 "then worker 2 removed and worker 0 stopped")
    with Stack() as st:
        st.agents_up(2, agent_args=("--restart-max", "0"))
        f2 = st.fake(2)
        base = st.router({}, ready=3)
        t0 = time.monotonic()
        os.kill(st.agents[0].engine_pid(), signal.SIGKILL)
        f2.client().set_mode(state=3)   # DRAINING in its slot

        def states() -> dict[str, dict[int, Any]]:
            text = httpx.get(base + "/metrics", timeout=10).text
            dump = subprocess.run([sys.executable, "-m", "dplb_shm.dump", "--shm", st.shm, "--json"], cwd=str(ROOT),
                                  capture_output=True, text=True, timeout=30, check=False)
            return {
                "status": {w["id"]: w["state"] for w in httpx.get(base + "/dplb/status", timeout=10).json()["workers"]},
                "workers": {w["id"]: w["state"] for w in httpx.get(base + "/dplb/workers", timeout=10).json()["workers"]},
                "dump": {w["worker_id"]: w["state"] for w in orjson.loads(dump.stdout)["workers"]},
                "metric_state": {w: next((s for s in ("starting", "ready", "draining", "dead") if metric_value(
                    text, "dplb_worker_state", worker=str(w), state=s) == 1.0), None) for w in (0, 1, 2)},
                "ready_gauge": {w: metric_value(text, "dplb_worker_ready", worker=str(w)) for w in (0, 1, 2)},
            }

        wait_for(lambda: states()["metric_state"] == {0: "dead", 1: "ready", 2: "draining"}, 20,
                   what="dead and draining in the metrics")
        res.detection_s = round(time.monotonic() - t0, 3)
        res.extra["seen"] = states()
        outs = asyncio.run(_some(base, 8, model=MODEL_SIM))
        res.add(outs)
        res.extra["served"] = dict(Counter(o.worker for o in outs))
        r = httpx.delete(base + "/dplb/workers/2", timeout=10)
        res.extra["remove_2"] = r.status_code
        st.agents[0].proc.popen.send_signal(signal.SIGTERM)
        st.agents[0].proc.popen.wait(30)
        wait_for(lambda: st.seg.read_slot(0).state.name == "EMPTY", 10, what="slot 0 EMPTY")
        wait_for(lambda: _row(base, 0) is None, 10, what="worker 0 unlisted")
        time.sleep(0.5)   # a health tick or two
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["after_leave"] = {
            "rows": sorted(w["id"] for w in httpx.get(base + "/dplb/status", timeout=10).json()["workers"]),
            "series_0": [ln for ln in text.splitlines() if 'worker="0"' in ln and ln.startswith(
                ("dplb_worker_",))],
            "series_2": [ln for ln in text.splitlines() if 'worker="2"' in ln and ln.startswith(
                ("dplb_worker_",))],
            "ready_1": metric_value(text, "dplb_worker_ready", worker="1")}
    return res


# ----------------------------------------------------------------------------------- scenario 15

def run_slow_request_one_504(first_byte_timeout_s: float = 1.0, delay: float = 4.0) -> Result:
    """Scenario 15: three workers all answer after ``delay`` s; with ``first_byte_timeout_s`` below
    it, one non-streamed request is answered 504 once, by one worker, after about one timeout —
    not run on every worker in turn. Then a single hung worker (no other to try): 504, not 502;
    and a stream whose head comes at once but whose first token is late: 504 too."""
    res = Result("15 slow request: one 504 on one worker", f"3 workers answer after {delay}s, "
                 f"first_byte_timeout_s={first_byte_timeout_s}")
    with Stack() as st:
        fs = [st.fake(i, "--mode", "slow", "--delay", str(delay)) for i in range(3)]
        base = st.router({"router": {"first_byte_timeout_s": first_byte_timeout_s}}, ready=3)
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json=chat(), timeout=60)
        res.add([_outcome(r, t0)])
        res.extra["status"] = r.status_code
        res.extra["error_type"] = r.json()["error"]["type"] if r.status_code >= 400 else None
        res.extra["elapsed_s"] = round(time.monotonic() - t0, 3)
        res.extra["worker_header"] = r.headers.get("x-dplb-worker-id")
        time.sleep(0.3)
        res.extra["requests_per_worker"] = [f.client().stats()["requests"] for f in fs]
        res.extra["disconnects_per_worker"] = [f.client().stats()["disconnects"] for f in fs]
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["timeout_errors"] = sum(metric_value(text, "dplb_router_request_errors_total", worker=str(i),
                                                       kind="timeout") or 0 for i in range(3))
        res.extra["retries"] = metric_value(text, "dplb_router_retries_total", reason="timeout")
        # the stream: head at once, first token after the timeout
        for f in fs:
            f.client().set_mode("ok", reset_stats=True)
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json=chat(stream=True), timeout=60,
                       headers={"x-fake-mode": "stream", "x-fake-first-delay": str(delay)})
        res.add([_outcome(r, t0, stream=True)])
        res.extra["stream_status"] = r.status_code
        res.extra["stream_elapsed_s"] = round(time.monotonic() - t0, 3)
    with Stack() as st:
        st.fake(0, "--mode", "hang")
        base = st.router({"router": {"first_byte_timeout_s": first_byte_timeout_s}}, ready=1)
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", json=chat(), timeout=60)
        res.add([_outcome(r, t0)])
        res.extra["lone_hung_worker"] = (r.status_code, r.headers.get("x-dplb-worker-id"))
    return res


# ----------------------------------------------------------------------------------- scenario 16

def run_first_byte_vs_idle_timeout() -> Result:
    """Scenario 16: first_byte_timeout_s 5, idle_timeout_s 0.5. A stream whose first token takes
    1.5 s (long prefill) and then flows every 0.1 s completes; a stream that stalls 2 s after its
    first chunk ends with an SSE error event (504, ``timeout_error``) and is counted as kind
    ``timeout``, not ``stream_broken``."""
    res = Result("16 first-byte vs idle timeout", "first_byte_timeout_s=5, idle_timeout_s=0.5: a 1.5 s "
                 "prefill, then a stream stalled 2 s mid-way")
    with Stack() as st:
        st.fake(0)
        base = st.router({"router": {"first_byte_timeout_s": 5.0, "idle_timeout_s": 0.5}}, ready=1)

        async def go() -> list[Outcome]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                a = await send(c, chat(stream=True), headers={"x-fake-mode": "stream", "x-fake-chunks": "6",
                                                              "x-fake-delay": "0.1", "x-fake-first-delay": "1.5"})
                b = await send(c, chat(stream=True), headers={"x-fake-mode": "stream", "x-fake-chunks": "3",
                                                              "x-fake-delay": "2.0"})
                return [a, b]

        outs = asyncio.run(go())
        res.add(outs)
        a, b = outs
        res.extra["prefill_stream"] = (a.kind, round(a.t_end - a.t_start, 3))
        ev = sse_events(b.body)
        res.extra["stalled_stream"] = (b.kind, b.status, round(b.t_end - b.t_start, 3))
        try:
            err = orjson.loads(ev[-1])["error"]
            res.extra["stalled_error"] = (err["type"], err["code"])
        except (IndexError, orjson.JSONDecodeError, KeyError, TypeError):
            res.extra["stalled_error"] = ev[-1:] if ev else None
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["errors"] = {k: metric_value(text, "dplb_router_request_errors_total", worker="0", kind=k)
                               for k in ("timeout", "stream_broken")}
        res.extra["requests_504"] = metric_value(text, "dplb_router_requests_total", worker="0", status="504")
    return res


# ----------------------------------------------------------------------------------- scenario 17

def run_round_robin_per_model(n: int = 40) -> Result:
    """Scenario 17: workers 0, 1 serve model-a, workers 2, 3 model-b; under ``round_robin``,
    requests alternate a, b, a, b: each model's requests must alternate over its two workers
    (one shared position sent every model-a request to one worker)."""
    res = Result("17 round robin per model", f"{n} requests alternating two models, two workers each")
    with Stack() as st:
        for i in range(4):
            st.fake(i, "--model", "model-a" if i < 2 else "model-b")
        base = st.router({"routing_policy": {"policy": "round_robin"}}, ready=4)

        async def go() -> list[Outcome]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                return [await send(c, chat(tag=i, model="model-a" if i % 2 == 0 else "model-b")) for i in range(n)]

        outs = asyncio.run(go())
        res.add(outs)
        res.extra["model_a"] = dict(sorted(Counter(o.worker for i, o in enumerate(outs) if i % 2 == 0).items()))
        res.extra["model_b"] = dict(sorted(Counter(o.worker for i, o in enumerate(outs) if i % 2 == 1).items()))
    return res


# ----------------------------------------------------------------------------------- scenario 18

def run_header_limits() -> Result:
    """Scenario 18: a 64 KB header value, 200 headers and a 16 MB header get 431 (OpenAI body), none
    forwarded; a head over the limit with a declared 1 MB body that never comes is answered 431 at
    once (checked before the body); one unfinished 64 MB header leaves the router's RSS flat."""
    import psutil

    res = Result("18 header limits", "64 KB header value, 200 headers, 16 MB header, unfinished 64 MB header")
    with Stack() as st:
        f0 = st.fake(0)
        base = st.router({}, ready=1)
        port = int(base.rsplit(":", 1)[1])
        router = psutil.Process(st.routers[-1][0].pid)
        codes: dict[str, Any] = {}
        for name, hs in (("64KB value", {"x-big": "a" * 65536}),
                         ("200 headers", {f"x-h{i}": "v" for i in range(200)}),
                         ("16MB header", {"x-huge": "a" * (16 << 20)})):
            t0 = time.monotonic()
            try:
                r = httpx.post(base + "/v1/chat/completions", json=chat(), headers=hs, timeout=30)
                res.add([_outcome(r, t0)])
                codes[name] = r.status_code
            except httpx.HTTPError as e:    # the router may close before reading all 16 MB
                codes[name] = f"{type(e).__name__}"
                res.add([Outcome(t0, time.monotonic(), False, "lost", None, None, repr(e))])
        ok = httpx.post(base + "/v1/chat/completions", json=chat(), headers={"x-normal": "a" * 1000}, timeout=30)
        res.add([_outcome(ok, time.monotonic())])
        codes["1KB header"] = ok.status_code
        res.extra["codes"] = codes
        res.extra["forwarded"] = f0.client().stats()["requests"]
        # head over the limit, a 1 MB body declared and never sent: the answer must not wait for it
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000000\r\nX-Big: " + b"a" * 40000 + b"\r\n\r\n")
            head = s.recv(200)
        res.extra["before_body"] = (head.split(b"\r\n", 1)[0].decode(), round(time.monotonic() - t0, 3))
        rss0 = router.memory_info().rss
        sent = 0
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Flood: ")
            chunk = b"a" * 65536
            try:
                while sent < (64 << 20):
                    s.sendall(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            try:
                first = s.recv(100).split(b"\r\n", 1)[0].decode()
            except OSError as e:
                first = repr(e)
        rss1 = router.memory_info().rss
        res.extra["flood"] = {"sent_mb": round(sent / 2**20, 1), "answer": first,
                              "rss_before_mb": round(rss0 / 2**20, 1), "rss_after_mb": round(rss1 / 2**20, 1)}
        res.extra["health_after"] = httpx.get(base + "/health", timeout=10).status_code
    return res


# ----------------------------------------------------------------------------------- scenario 19

def run_admin_exposure() -> Result:
    """Scenario 19: a router told to listen on 0.0.0.0 without ``admin_token`` refuses to start; on
    loopback without a token, an admin call carrying forwarding headers (a reverse proxy in front)
    is refused (403) while a direct one passes; with a token, a forwarded ``X-Forwarded-For:
    127.0.0.1`` never stands in for it (401), the token does."""
    res = Result("19 admin behind a proxy / beyond loopback", "router on 0.0.0.0 without a token; admin calls "
                 "with X-Forwarded-For / Forwarded / Via")
    with Stack() as st:
        st.fake(0)
        port = free_port()
        p = subprocess.run([sys.executable, "-m", "router", "--host", "0.0.0.0", "--port", str(port), "--shm", st.shm],
                           cwd=str(ROOT), capture_output=True, text=True, timeout=60, check=False)
        res.extra["open_host_no_token"] = (p.returncode, "admin_token" in p.stderr)
        base = st.router({}, ready=1)
        codes = {}
        for name, hs in (("direct", {}), ("x-forwarded-for", {"x-forwarded-for": "203.0.113.9"}),
                         ("forwarded", {"forwarded": "for=203.0.113.9"}), ("via", {"via": "1.1 nginx"})):
            codes[name] = httpx.get(base + "/dplb/workers", headers=hs, timeout=10).status_code
        res.extra["no_token"] = codes
        tok = "s3cret-token"
        base2 = st.router({"router": {"admin_token": tok}}, ready=1)
        res.extra["with_token"] = {
            "forwarded loopback, no token": httpx.get(base2 + "/dplb/workers", timeout=10,
                                                      headers={"x-forwarded-for": "127.0.0.1"}).status_code,
            "forwarded, token": httpx.get(base2 + "/dplb/workers", timeout=10,
                                          headers={"x-forwarded-for": "203.0.113.9",
                                                   "authorization": f"Bearer {tok}"}).status_code}
        res.extra["open_host_with_token_allowed"] = not Config.model_validate(
            {"router": {"host": "0.0.0.0", "admin_token": tok}}).admin_exposed()
        expected = {"direct": 200, "x-forwarded-for": 403, "forwarded": 403, "via": 403}
        got = {**codes, **res.extra["with_token"], "open host, no token": res.extra["open_host_no_token"][0]}
        want = {**expected, "forwarded loopback, no token": 401, "forwarded, token": 200, "open host, no token": 2}
        res.sent = len(want)
        res.ok = sum(1 for k, v in want.items() if got.get(k) == v)
        res.lost = res.sent - res.ok
        res.extra["mismatches"] = {k: got.get(k) for k, v in want.items() if got.get(k) != v}
    return res


__all__ = ["MODEL_FAKE", "run_admin_exposure", "run_crash_loop_gave_up_then_admin_restart",
           "run_dead_and_departed_workers_in_plain_sight", "run_first_byte_vs_idle_timeout", "run_header_limits",
           "run_round_robin_per_model", "run_slow_request_one_504"]
