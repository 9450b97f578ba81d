"""Issue 27, the router's request path (items 1, 2, 8 and 9); see :mod:`bench.faultsuite.scenarios`.

Scenario ids are the issue's item numbers: ``27.1a`` kill -9 of an engine under streamed and
non-streamed load (real agents, sim engines), ``27.1b`` kill -9 of a worker with every request in
flight on it still before its first byte (0 failed), ``27.1c`` a query of death, ``27.1d`` every
worker down before the router noticed; ``27.2`` a model whose workers are all down; ``27.8`` 200
streams read with the official sync ``openai`` client, and a real disconnect; ``27.9`` framing
errors.
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

from bench.faultsuite.cluster import MODEL_SIM, Stack
from bench.faultsuite.common import Result, metric_value
from bench.faultsuite.load import (
    Outcome,
    chat,
    classify,
    openai_error,
    sse_events,
    steady,
)
from launcher.stack import wait_for

CHAT = "/v1/chat/completions"


def _events_before_error(o: Outcome) -> int:
    """SSE data events a failed stream delivered before its error event (0: none reached the client)."""
    n = 0
    for e in sse_events(o.body):
        if b'"error"' in e:
            return n
        n += 1
    return n


def _status_counts(text: str) -> dict[str, float]:
    """``dplb_router_requests_total`` summed per status label."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "dplb_router_requests_total":
                out[s.labels["status"]] = out.get(s.labels["status"], 0.0) + float(s.value)
    return out


# ----------------------------------------------------------------------------------- 27.1a

def run_engine_kill_retried(workers: int = 3, rate: float = 24.0, duration: float = 5.0, kill_at: float = 1.5,
                            max_tokens: int = 48) -> Result:
    """kill -9 of worker 0's sim engine (its agent restarts it) under steady load of alternating
    streamed / non-streamed chats, at a moment when at least two requests are in flight on it.
    Every request whose engine connection broke before its first byte reached the client is sent
    once more to another worker: no non-streamed request fails, nor any stream that had not yet
    relayed a byte. Only a stream that was cut mid-way may fail (its bytes are the client's: running
    it again would repeat them), with an SSE error event after the events it delivered."""
    res = Result("27.1a kill -9 engine, in-flight requests retried",
                 f"SIGKILL of worker 0's sim engine with requests in flight, {rate:.0f} req/s streamed + not")
    box: dict[str, Any] = {}
    with Stack() as st:
        st.agents_up(workers, "--max-num-seqs", "64")
        base = st.router({}, ready=workers)
        pid = st.agents[0].engine_pid()

        def kill() -> None:
            # (bounded) wait until worker 0 has at least two requests in flight, then kill its engine
            deadline = time.monotonic() + 2.0
            while st.seg.read_slot(0).router_inflight < 2 and time.monotonic() < deadline:
                time.sleep(0.002)
            box["inflight_at_kill"] = st.seg.read_slot(0).router_inflight
            box["t"] = time.monotonic()
            os.kill(pid, signal.SIGKILL)

        outs = asyncio.run(steady(base, rate, duration,
                                  lambda i: chat(stream=i % 2 == 0, max_tokens=max_tokens, model=MODEL_SIM, tag=i),
                                  events={kill_at: kill}, timeout=60))
        res.add(outs)
        text = httpx.get(base + "/metrics", timeout=10).text
        failed = [o for o in outs if o.kind != "ok"]
        res.extra["inflight_at_kill"] = box.get("inflight_at_kill")
        res.extra["failed_non_streamed"] = [o.detail for o in failed if not o.stream]
        res.extra["failed_before_first_byte"] = [o.detail for o in failed if o.status != 200 or
                                                 _events_before_error(o) == 0]
        res.extra["cut_mid_stream"] = sum(1 for o in failed if o.stream and o.status == 200 and _events_before_error(o))
        res.extra["retried"] = sum(metric_value(text, "dplb_router_retries_total", reason=r) or 0.0
                                   for r in ("connect", "stream_broken"))
        res.extra["query_of_death"] = metric_value(text, "dplb_router_query_of_death_total")
        res.extra["by_worker"] = dict(sorted(Counter(o.worker for o in outs).items(), key=str))
        res.detection_s = None
        if res.lost:   # the run dir goes with the stack: keep what the router logged for the report
            with open(st.routers[-1][0].log or os.devnull, errors="replace") as f:
                res.extra["router_log_tail"] = f.read()[-4000:]
    return res


# ----------------------------------------------------------------------------------- 27.1b

def run_in_flight_retried_streamed_and_not(rate: float = 30.0, duration: float = 3.0, kill_at: float = 1.0) -> Result:
    """kill -9 of fake worker 0 (three workers, round robin) under steady load of streams that
    wait 0.4 s before their first byte (a prefill) and non-streamed answers that take 0.3 s: every
    request in flight on it has received nothing yet, so every one is served by another worker:
    0 failed (the fault the issue saw: 2 of about 1,390 non-streamed requests got 502)."""
    res = Result("27.1b kill -9 worker, nothing reached the clients", "SIGKILL of worker 0 (fake) with streams in "
                 f"prefill and non-streamed requests in flight on it, {rate:.0f} req/s")
    box: dict[str, Any] = {}
    with Stack() as st:
        for i in range(3):
            st.fake(i)
        base = st.router({"routing_policy": {"policy": "round_robin"}}, ready=3)
        f0 = st.fakes[0]

        def kill() -> None:
            box["active"] = f0.client().stats()["active"]
            box["t"] = st.kill(f0.proc)

        def hdr(i: int) -> dict[str, str]:
            if i % 2 == 0:
                return {"x-fake-mode": "stream", "x-fake-chunks": "1", "x-fake-first-delay": "0.4"}
            return {"x-fake-mode": "slow", "x-fake-delay": "0.3"}

        outs = asyncio.run(steady(base, rate, duration, lambda i: chat(stream=i % 2 == 0, tag=i), headers=hdr,
                                  events={kill_at: kill}, timeout=30))
        res.add(outs)
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["in_flight_on_0_at_kill"] = box.get("active")
        res.extra["streamed_ok"] = sum(1 for o in outs if o.stream and o.kind == "ok")
        res.extra["non_streamed_ok"] = sum(1 for o in outs if not o.stream and o.kind == "ok")
        res.extra["retried"] = sum(metric_value(text, "dplb_router_retries_total", reason=r) or 0.0
                                   for r in ("connect", "stream_broken"))
        res.extra["statuses"] = _status_counts(text)
        res.extra["served_by_0_after_kill"] = sum(1 for o in outs if o.worker == "0" and o.t_start > box["t"] + 0.2)
    return res


# ----------------------------------------------------------------------------------- 27.1c

def run_query_of_death(n_ordinary: int = 20) -> Result:
    """A request that kills its engine's connection on every worker (``X-Fake-Mode: drop``, carried
    by the request itself: each worker reads it and closes the connection without a byte) among
    ordinary traffic, on three workers: it is tried on two, answered 502 naming the second, counted
    in ``dplb_router_query_of_death_total``, and never reaches the third; the ordinary requests
    all succeed."""
    res = Result("27.1c query of death", "a request that makes every worker drop its connection, among ordinary ones")
    with Stack() as st:
        for i in range(3):
            st.fake(i)
        base = st.router({"routing_policy": {"policy": "round_robin"}}, ready=3)

        async def go(n: int, **kw: Any) -> list[Outcome]:
            from bench.faultsuite.load import send
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                tag, hs = kw.get("tag", "r"), kw.get("headers")
                return [await send(c, chat(tag=f"{tag}{i}"), headers=hs) for i in range(n)]

        bad = asyncio.run(go(1, tag="qod", headers={"x-fake-mode": "drop"}))[0]
        read = [f.client().stats()["requests"] for f in st.fakes.values()]   # who read the query of death
        good = asyncio.run(go(n_ordinary))
        res.add([bad, *good])
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["qod_status"] = bad.status
        res.extra["qod_error"] = orjson.loads(bad.body)["error"]["type"] if bad.status and bad.status >= 400 else None
        res.extra["qod_worker_header"] = bad.worker
        res.extra["read_by_worker"] = read
        res.extra["query_of_death"] = metric_value(text, "dplb_router_query_of_death_total")
        res.extra["ordinary_ok"] = sum(1 for o in good if o.kind == "ok")
    return res


# ----------------------------------------------------------------------------------- 27.1d

def run_all_down_before_noticed(n: int = 6) -> Result:
    """Every worker is killed while the router cannot have noticed yet (probes off, a 60 s
    heartbeat timeout): a request tries each worker, each refuses the connection. Nothing was done
    anywhere and no worker is left: 503 + Retry-After, OpenAI-shaped (was: 502 "all 3 worker(s)
    tried failed before the first byte: connect error"). Then with a worker back: 200."""
    res = Result("27.1d all workers down, not yet noticed", "kill -9 of all 3 workers with probes off (the "
                 "router learns it from refused connections)")
    cfg = {"health_check": {"enabled": False, "heartbeat_timeout_ms": 60000}}
    with Stack() as st:
        for i in range(3):
            st.fake(i)
        base = st.router(cfg, ready=3)
        for f in list(st.fakes.values()):
            st.kill(f.proc)
        for f in st.fakes.values():
            f.proc.wait(5)
        rs = [httpx.post(base + CHAT, json=chat(tag=i), timeout=30) for i in range(n)]
        res.add([classify(Outcome(0.0, 0.0, False, status=r.status_code, worker=r.headers.get("x-dplb-worker-id"),
                                  body=r.content)) for r in rs])
        res.extra["statuses"] = dict(Counter(r.status_code for r in rs))
        res.extra["retry_after"] = sorted({r.headers.get("retry-after") for r in rs}, key=str)
        res.extra["first_message"] = rs[0].json()["error"]["message"]
        res.extra["worker_header"] = sorted({r.headers.get("x-dplb-worker-id") for r in rs}, key=str)
        st.fake(1)
        wait_for(lambda: httpx.post(base + CHAT, json=chat(), timeout=10).status_code == 200, 20, "worker 1 back")
        r = httpx.post(base + CHAT, json=chat(tag="back"), timeout=10)
        res.extra["after_back"] = (r.status_code, r.headers.get("x-dplb-worker-id"))
    return res


# ----------------------------------------------------------------------------------- 27.2

def run_model_known_while_down() -> Result:
    """Two models, one worker each (``alpha`` on 0, ``beta`` on 1). Worker 1 is killed: a request
    for ``beta`` sent before the router noticed, one after, and one after an admin removed the
    worker all get 503 + Retry-After (not 404 "does not exist (served: none)": OpenAI clients never
    retry a 404); ``/v1/models`` keeps listing ``beta`` and ``/v1/models/beta`` answers; ``/dplb/status``
    shows beta's worker and that none is eligible; a model no slot ever served is still a 404;
    ``alpha`` is served throughout; worker 1 back (re-added) serves ``beta`` again."""
    res = Result("27.2 model known while its workers are down", "kill -9 of the only worker of model beta, then its "
                 "removal, then its return")
    with Stack() as st:
        st.fake(0, "--model", "alpha")
        f1 = st.fake(1, "--model", "beta")
        base = st.router({}, ready=2)
        checks: dict[str, Any] = {}

        def ask(name: str, model: str) -> None:
            r = httpx.post(base + CHAT, json=chat(model=model, tag=name), timeout=30)
            res.add([classify(Outcome(0.0, 0.0, False, status=r.status_code, worker=r.headers.get("x-dplb-worker-id"),
                                      body=r.content))])
            err = r.json().get("error") if r.status_code >= 400 else None
            checks[name] = (r.status_code, r.headers.get("retry-after"), err["message"] if err else None)

        st.kill(f1.proc)
        f1.proc.wait(5)
        ask("beta at once", "beta")     # before the router noticed: the connection is refused
        wait_for(lambda: (st.row(base, 1) or {}).get("eligible") is False, 20, "worker 1 out")
        ask("beta, worker out", "beta")
        ask("alpha meanwhile", "alpha")
        ask("gamma (never served)", "gamma")
        res.extra["models_listed"] = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
        res.extra["model_beta"] = httpx.get(base + "/v1/models/beta", timeout=10).status_code
        res.extra["model_gamma"] = httpx.get(base + "/v1/models/gamma", timeout=10).status_code
        status = httpx.get(base + "/dplb/status", timeout=10).json()
        res.extra["status_models"] = status.get("models")
        row = st.row(base, 1) or {}
        res.extra["row1"] = {k: row.get(k) for k in ("model", "routing", "eligible")}
        res.extra["remove_1"] = httpx.delete(base + "/dplb/workers/1", timeout=10).status_code
        ask("beta, worker removed", "beta")
        res.extra["models_after_remove"] = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
        f1 = st.fake(1, "--model", "beta")
        res.extra["re_add"] = httpx.post(base + "/dplb/workers", json={"endpoint": f1.endpoint}, timeout=10).status_code
        wait_for(lambda: httpx.post(base + CHAT, json=chat(model="beta"), timeout=10).status_code == 200, 20,
                 "beta served again")
        ask("beta, back", "beta")
        res.extra["checks"] = checks
    return res


# ----------------------------------------------------------------------------------- 27.8

_SYNC_CLIENT = r'''
import json, sys
from openai import OpenAI
base, n, model, max_tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
c = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
done = 0
for i in range(n):
    s = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"stream {i}"}],
                                  max_tokens=max_tokens, stream=True)
    got = 0
    for chunk in s:
        got += 1
    done += got > 0
print(json.dumps({"done": done}))
'''


def run_sync_openai_streams_counted(n: int = 200, max_tokens: int = 16, busy_core: bool = True) -> Result:
    """``n`` streams read to their end, one after another, with the official sync ``openai`` client
    (which closes its connection at ``data: [DONE]``, often before the engine's terminating chunk
    reached the router) through 2 sim engines, one core kept busy (``busy_core``: a spinning
    process for the run; the fault needs the router to read ``[DONE]`` and the terminator apart).
    Every stream must be counted ``dplb_router_requests_total{status="200"}`` and none as a
    client disconnect (was: 3.5-5 % counted ``client_disconnect``, missing from the 200s). Then
    a real disconnect (a client that leaves a 1 s stream after its first chunk) is counted with
    status 499."""
    res = Result("27.8 complete streams counted 200", f"{n} streams read with the sync openai client"
                 + (", one core kept busy" if busy_core else "") + "; then a client that leaves mid-stream")
    with Stack() as st:
        st.agents_up(2, "--max-num-seqs", "64")
        base = st.router({}, ready=2)
        hog = st.procs.start([sys.executable, "-c", "while True: pass"]) if busy_core else None
        try:
            p = subprocess.run([sys.executable, "-c", _SYNC_CLIENT, base, str(n), MODEL_SIM, str(max_tokens)],
                               capture_output=True, text=True, timeout=600, check=False)
        finally:
            if hog is not None:
                st.kill(hog)
        res.sent += n
        got = orjson.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"done": 0}
        res.ok += got["done"]
        res.lost += n - got["done"]
        if p.returncode != 0:
            res.extra["client_error"] = p.stderr[-500:]
        text = httpx.get(base + "/metrics", timeout=10).text
        res.extra["statuses"] = _status_counts(text)
        res.extra["client_disconnect"] = metric_value(text, "dplb_router_request_errors_total",
                                                      kind="client_disconnect") or 0.0

        async def leave() -> int:
            async with httpx.AsyncClient(base_url=base, timeout=30) as c, \
                    c.stream("POST", CHAT, json=chat(stream=True, max_tokens=200, model=MODEL_SIM, tag="gone")) as r:
                async for _ in r.aiter_raw():
                    break
                return r.status_code

        res.extra["leaver_status"] = asyncio.run(leave())
        res.sent += 1
        res.honest += 1    # the client chose to leave
        t_end = time.monotonic() + 10    # the router counts it when it sees the connection close
        while True:
            after = _status_counts(httpx.get(base + "/metrics", timeout=10).text)
            if after.get("499", 0) >= 1 or time.monotonic() > t_end:
                break
            time.sleep(0.05)
        res.extra["statuses_after_leaver"] = after
    return res


# ----------------------------------------------------------------------------------- 27.9

#: request heads HTTP/1.1's parser refuses (smuggling vectors and plain garbage), each with a body
FRAMING_ERRORS: dict[str, bytes] = {
    "Content-Length with chunked": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                                   b"\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "two Content-Lengths": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                           b"Content-Length: 3\r\n\r\n{}",
    "obs-fold": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Folded: a\r\n b\r\nContent-Length: 2\r\n\r\n{}",
    "bare LF": b"POST /v1/chat/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
    "HTTP/1.2": b"POST /v1/chat/completions HTTP/1.2\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
    "space in a header name": b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent Length: 2\r\n\r\n{}",
}


def _raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> tuple[bytes, bool]:
    """Send ``data`` on a new connection; ``(everything answered, the router closed the connection)``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        closed = False
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                b = s.recv(65536)
            except TimeoutError:
                break
            if not b:
                closed = True
                break
            out += b
    return out, closed


def run_framing_errors() -> Result:
    """Each head of :data:`FRAMING_ERRORS`, on its own connection: answered 400 with the OpenAI
    error body (``application/json``, the parser's reason in the message, ``X-DPLB-Worker-ID:
    none``) instead of uvicorn's plain text, the connection closed, and nothing forwarded to the
    engine (the fake counts every request it reads); an ordinary request still succeeds."""
    res = Result("27.9 framing errors", f"{len(FRAMING_ERRORS)} request heads HTTP/1.1 refuses (smuggling vectors)")
    with Stack() as st:
        f0 = st.fake(0)
        base = st.router({}, ready=1)
        port = int(base.rsplit(":", 1)[1])
        seen: dict[str, Any] = {}
        for name, data in FRAMING_ERRORS.items():
            out, closed = _raw_exchange(port, data)
            head, _, body = out.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            hs = dict(ln.lower().split(b": ", 1) for ln in lines[1:] if b": " in ln)
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError:
                obj = None
            shaped = openai_error(obj)
            seen[name] = {"status": lines[0].decode("latin-1"), "json": hs.get(b"content-type") == b"application/json",
                          "shaped": shaped, "closed": closed, "worker": hs.get(b"x-dplb-worker-id", b"").decode(),
                          "message": obj["error"]["message"] if shaped else body[:80].decode("latin-1")}
            res.add([Outcome(0.0, 0.0, False, "honest" if shaped and b" 400 " in lines[0] else "lost",
                             int(lines[0].split()[1]) if len(lines[0].split()) > 1 else None)])
        res.extra["answers"] = seen
        res.extra["forwarded"] = f0.client().stats()["requests"]
        ok = httpx.post(base + CHAT, json=chat(), timeout=10)
        res.add([classify(Outcome(0.0, 0.0, False, status=ok.status_code, body=ok.content))])
        res.extra["forwarded_after_ok"] = f0.client().stats()["requests"]
    return res


__all__ = ["FRAMING_ERRORS", "run_all_down_before_noticed", "run_engine_kill_retried", "run_framing_errors",
           "run_in_flight_retried_streamed_and_not", "run_model_known_while_down", "run_query_of_death",
           "run_sync_openai_streams_counted"]
