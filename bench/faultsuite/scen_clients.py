"""Scenarios 6-11 of issue 8 (client disconnects, streaming fidelity, ties and bursts, router
restart, bad input, security); see :mod:`bench.faultsuite.scenarios`."""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import httpx

from bench.faultsuite.cluster import MODEL_SIM, Stack
from bench.faultsuite.common import (
    Result,
    wait_time,
)
from bench.faultsuite.load import Outcome, chat, steady

# ------------------------------------------------------------------------------------ scenario 6


def run_client_disconnect(read_chunks: int = 3) -> Result:
    """Scenario 6: a client reads ``read_chunks`` chunks of a long stream (real agent + sim engine,
    the router forwarding straight to the engine) and disconnects. Detection: until the engine's own
    ``/sim/state`` no longer holds the request and counts one more abort; the slot's in-flight count
    (the router line's ``router_inflight``, which the agent drains on, and the agent's copy of it in
    ``inflight``) must drop to 0."""
    res = Result("6 client disconnect mid-stream", f"client closes the connection after {read_chunks} chunks")
    with Stack() as st:
        a = st.agents_up(1)[0]
        base = st.router({}, ready=1)
        before = a.engine_state()["request_success"]["abort"]
        box: dict[str, Any] = {}

        async def go() -> None:
            body = chat(stream=True, max_tokens=4000, model=MODEL_SIM, tag="dc")
            async with httpx.AsyncClient(base_url=base, timeout=30) as c, \
                    c.stream("POST", "/v1/chat/completions", json=body) as r:
                n = 0
                async for _ in r.aiter_raw():
                    n += 1
                    if n == 1:
                        box["running"] = a.engine_state()["in_flight"]
                        box["slot_inflight"] = st.seg.read_slot(0).router_inflight
                    if n >= read_chunks:
                        break
            box["t"] = time.monotonic()

        asyncio.run(go())
        res.sent = 1
        res.honest = 1  # the client chose to leave: nothing to lose
        res.extra.update(engine_had=len(box["running"]), slot_inflight_during=box["slot_inflight"])
        res.detection_s = round(wait_time(lambda: not a.engine_state()["in_flight"], box["t"], 10,
                                           "engine drops the request"), 3)
        res.extra["aborts"] = a.engine_state()["request_success"]["abort"] - before
        res.recovery_s = round(wait_time(lambda: st.seg.read_slot(0).router_inflight == 0
                                         and st.seg.read_slot(0).inflight == 0, box["t"], 10,
                                         "slot in-flight back to 0"), 3)
        res.extra["router_inflight"] = st.seg.read_slot(0).router_inflight
    return res


# ------------------------------------------------------------------------------------ scenario 7


def run_stream_fidelity() -> Result:
    """Scenario 7: streaming through the router is chunk by chunk and byte-exact.

    (a) 10 chunks 100 ms apart: the first one reaches the client long before the last;
    (b) an event split inside a 4-byte UTF-8 character across two writes arrives intact;
    (c) the usage chunk and ``data: [DONE]`` are preserved; (d) ``stream_options`` and other
    optional body fields, ``Authorization`` and ``X-Request-Id`` reach the worker unchanged."""
    from bench.fakes import UTF8_TEXT
    from bench.faultsuite.load import send, sse_events

    res = Result("7 streaming fidelity", "engine streams 1 chunk/100 ms; UTF-8 char split across reads; usage chunk")
    with Stack() as st:
        f0 = st.fake(0)
        base = st.router({}, ready=1)
        body = chat(stream=True, tag="fid", stream_options={"include_usage": True, "continuous_usage_stats": False},
                    temperature=0.25, top_k=7, seed=11, logit_bias={"42": -1.5}, vendor_ext={"a": [1, None, "ü"]})
        hdrs = {"authorization": "Bearer sk-user-123", "x-request-id": "req-fidelity-1"}
        reads: list[float] = []

        async def go() -> tuple[list[Outcome], Any]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                a = await send(c, body, headers={**hdrs, "x-fake-mode": "stream", "x-fake-chunks": "10",
                                                 "x-fake-delay": "0.1"},
                               on_first=lambda o: reads.append(time.monotonic()))
                seen = f0.client().stats()["last"]
                b = await send(c, chat(stream=True, tag="utf"), headers={"x-fake-mode": "utf8", "x-fake-chunks": "1",
                                                                         "x-fake-delay": "0.15"})
                return [a, b], seen

        (a, b), seen = asyncio.run(go())
        res.add([a, b])
        res.extra["first_chunk_s"] = round(a.t_first - a.t_start, 3)
        res.extra["total_s"] = round(a.t_end - a.t_start, 3)
        ev = sse_events(a.body)
        res.extra["events"] = len(ev)
        res.extra["done_last"] = bool(ev) and ev[-1] == b"[DONE]"
        import orjson

        res.extra["usage_before_done"] = len(ev) >= 2 and "usage" in orjson.loads(ev[-2])
        res.extra["body_at_worker_equal"] = seen["body"] == body
        res.extra["headers_at_worker"] = {k: seen["headers"].get(k) for k in hdrs}
        res.extra["request_id_back"] = a.status == 200
        texts = []
        for e in sse_events(b.body):
            if e.startswith(b"{"):
                d = orjson.loads(e)  # raises on a broken UTF-8 sequence
                texts += [c["delta"].get("content", "") for c in d.get("choices", [])]
        res.extra["utf8_intact"] = UTF8_TEXT in texts
        res.extra["utf8_body_decodes"] = _decodes(b.body)
    return res


def _decodes(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ------------------------------------------------------------------------------------ scenario 8


def run_ties_and_bursts(n_dry: int = 40, n_seq: int = 12, burst: int = 40) -> Result:
    """Scenario 8: four identical idle workers. (a) ``n_dry`` dry runs and ``n_seq`` sequential
    requests (each on idle workers) must not all go to one worker (never a bias towards worker 0);
    (b) a burst of ``burst`` concurrent 0.5 s requests must spread (no worker above 40 %)."""
    from bench.faultsuite.load import send

    res = Result("8 ties and bursts", f"4 idle identical workers; {n_seq} sequential requests, a burst of {burst}")
    with Stack() as st:
        for i in range(4):
            st.fake(i)
        base = st.router({}, ready=4)
        dry = Counter(httpx.post(base + "/dplb/route", json=chat(tag=f"d{i}"), timeout=10).json()["worker_id"]
                      for i in range(n_dry))
        res.extra["dry_run_choices"] = dict(dry)

        async def go() -> tuple[list[Outcome], list[Outcome]]:
            async with httpx.AsyncClient(base_url=base, timeout=30,
                                         limits=httpx.Limits(max_connections=burst + 8)) as c:
                seq = [await send(c, chat(tag=f"s{i}")) for i in range(n_seq)]
                b = await asyncio.gather(*(send(c, chat(tag=f"b{i}"), headers={"x-fake-mode": "slow",
                                                                               "x-fake-delay": "0.5"})
                                           for i in range(burst)))
                return seq, list(b)

        seq, b = asyncio.run(go())
        res.add(seq + b)
        res.extra["sequential"] = dict(Counter(o.worker for o in seq))
        res.extra["burst"] = dict(Counter(o.worker for o in b))
        res.extra["max_active_per_worker"] = [f.client().stats()["max_active"] for f in st.fakes.values()]
    return res


# ------------------------------------------------------------------------------------ scenario 9


def run_router_restart(rate: float = 10.0, duration: float = 5.0, kill_at: float = 1.0,
                       min_after: int = 10) -> Result:
    """Scenario 9: the router is killed (``kill -9``) under load of streams and chats and a new one
    is started on the same port and segment. The new router must list every worker at once (the
    state lives in the segment) and serve every request sent after it is up. Requests cut or
    refused while no router listened count as lost (also in ``extra['cut_or_refused_during_restart']``:
    a crashed lone router cannot save them); ``extra['router_inflight_after']`` shows whether the
    killed router's in-flight counts stayed behind in the segment. Recovery: kill → new router ready.
    When fewer than ``min_after`` requests of the load were sent after the new router was ready (it
    came up late on a busy machine), the load goes on at ``rate`` until that many were."""
    res = Result("9 router restart under load", f"kill -9 of the router at t={kill_at}s, new router on the same port")
    box: dict[str, Any] = {}
    with Stack() as st:
        for i in range(3):
            st.fake(i)
        base = st.router({}, ready=3)
        port = int(base.rsplit(":", 1)[1])
        old = st.routers[-1][0]

        def restart() -> None:
            box["t_kill"] = st.kill(old)
            old.wait(5)
            box["t_start"] = time.monotonic()
            st.router({}, ready=3, port=port)
            box["t_ready"] = time.monotonic()
            box["rows"] = st.status(base)

        def hdr(i: int) -> dict[str, str]:
            return {"x-fake-mode": "stream", "x-fake-chunks": "6", "x-fake-delay": "0.1"} if i % 2 == 0 else {}

        outs = asyncio.run(steady(base, rate, duration, lambda i: chat(tag=i, stream=i % 2 == 0), headers=hdr,
                                  events={kill_at: restart}, timeout=20))
        t_kill, t_ready = box["t_kill"], box["t_ready"]
        late = sum(1 for o in outs if o.t_start > t_ready)
        if late < min_after:   # the new router came up near the load's end (a busy machine): go on sending
            n = len(outs)
            outs += asyncio.run(steady(base, rate, (min_after - late) / rate,
                                       lambda i: chat(tag=n + i, stream=(n + i) % 2 == 0),
                                       headers=lambda i: hdr(n + i), timeout=20))
        during = [o for o in outs if o.t_start <= t_ready and o.kind != "ok"]
        after = [o for o in outs if o.t_start > t_ready]
        res.add(outs)  # the cut / refused ones count as lost: a crashed lone router cannot save them
        res.extra["not_ok_after_restart"] = sum(1 for o in after if o.kind != "ok")
        res.extra["cut_or_refused_during_restart"] = len(during)
        res.extra["cut_in_flight_at_kill"] = sum(1 for o in during if o.t_start < t_kill)
        res.extra["after_restart"] = len(after)
        res.extra["workers_seen_by_new_router"] = sorted(w["id"] for w in box["rows"] if w["eligible"])
        res.detection_s = None
        res.recovery_s = round(t_ready - t_kill, 3)
        time.sleep(0.5)
        res.extra["router_inflight_after"] = [st.seg.read_slot(i).router_inflight for i in range(3)]
        res.extra["agent_inflight_after"] = [st.seg.read_slot(i).inflight for i in range(3)]
    return res


# ------------------------------------------------------------------------------------ scenario 10

BIG = 65536
#: (name, path, body bytes, extra headers, expected status) — every one must be an OpenAI-shaped 4xx
BAD_INPUTS: list[tuple[str, str, bytes, dict[str, str], int]] = [
    ("malformed JSON", "/v1/chat/completions", b'{"model": "m", "messages": [', {}, 400),
    ("JSON array body", "/v1/chat/completions", b"[1, 2]", {}, 400),
    ("empty body", "/v1/chat/completions", b"", {}, 400),
    ("messages is a string", "/v1/chat/completions", b'{"messages": "hi"}', {}, 400),
    ("model is a number", "/v1/chat/completions", b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}',
     {}, 400),
    ("stream is a string", "/v1/chat/completions",
     b'{"stream": "yes", "messages": [{"role": "user", "content": "x"}]}', {}, 400),
    ("content is a number", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 7}]}', {}, 400),
    ("max_tokens is a string", "/v1/chat/completions",
     b'{"max_tokens": "ten", "messages": [{"role": "user", "content": "x"}]}', {}, 400),
    ("missing messages", "/v1/chat/completions", b'{"model": "sim-llama-3.1-8b"}', {}, 400),
    ("missing prompt", "/v1/completions", b'{"model": "sim-llama-3.1-8b", "max_tokens": 3}', {}, 400),
    ("empty messages", "/v1/chat/completions", b'{"messages": []}', {}, 400),
    ("negative max_tokens", "/v1/chat/completions",
     b'{"max_tokens": -5, "messages": [{"role": "user", "content": "x"}]}', {}, 400),
    ("zero max_tokens", "/v1/completions", b'{"max_tokens": 0, "prompt": "a b"}', {}, 400),
    ("huge max_tokens", "/v1/chat/completions",
     b'{"max_tokens": 1000000000000, "messages": [{"role": "user", "content": "x"}]}', {}, 400),
    ("max_tokens beyond 64 bits", "/v1/completions", b'{"max_tokens": 123456789012345678901234567890, "prompt": "a"}',
     {}, 400),
    ("invalid UTF-8 bytes", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}',
     {}, 400),
    ("lone high surrogate", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     {}, 400),
    ("lone low surrogate", "/v1/completions", b'{"prompt": "\\udc00", "max_tokens": 2}', {}, 400),
    ("unknown model", "/v1/chat/completions",
     b'{"model": "gpt-nonexistent", "messages": [{"role": "user", "content": "x"}]}', {}, 404),
    ("body over the limit", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "' + b"x " * BIG + b'"}]}', {}, 413),
    ("text/plain content type", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}',
     {"content-type": "text/plain"}, 415),
    ("form content type", "/v1/completions", b"prompt=hello&max_tokens=3",
     {"content-type": "application/x-www-form-urlencoded"}, 415),
    ("generate without text", "/generate", b'{"sampling_params": {}}', {}, 400),
]


def run_bad_input() -> Result:
    """Scenario 10: every body of :data:`BAD_INPUTS` sent to a router in front of a real agent and
    sim engine. ``extra['mismatches']`` lists (name, expected, got, body) where the status or the
    error shape was wrong; ``extra['worker']`` shows the worker's breaker and failure counters."""
    import orjson

    from bench.faultsuite.load import openai_error

    res = Result("10 bad input", f"{len(BAD_INPUTS)} malformed requests (JSON, types, UTF-8, sizes, content type)")
    with Stack() as st:
        st.agents_up(1)
        base = st.router({"router": {"max_body_bytes": BIG}}, ready=1)
        mismatches = []
        for name, path, body, hdrs, want in BAD_INPUTS:
            h = {"content-type": "application/json", **hdrs}
            t = time.monotonic()
            r = httpx.post(base + path, content=body, headers=h, timeout=30)
            try:
                shaped = openai_error(orjson.loads(r.content))
            except orjson.JSONDecodeError:
                shaped = False
            o = Outcome(t, time.monotonic(), False, "honest" if shaped and 400 <= r.status_code < 500 else "lost",
                        r.status_code, r.headers.get("x-dplb-worker-id"), f"{name}: {r.status_code}", body=r.content)
            res.add([o])
            if r.status_code != want or not shaped:
                mismatches.append((name, want, r.status_code, r.text[:200]))
        res.extra["mismatches"] = mismatches
        row = st.row(base, 0)
        s = st.seg.read_slot(0)
        res.extra["worker"] = {"circuit": row["circuit"], "failure_rate": row["failure_rate"], "failed": s.failed,
                               "eligible": row["eligible"]}
        res.extra["good_after"] = httpx.post(base + "/v1/chat/completions", json=chat(max_tokens=2),
                                             timeout=30).status_code
    return res


# ------------------------------------------------------------------------------------ scenario 11

#: endpoints the admin API must refuse: other schemes, credentials, relative paths, bad ports
BAD_ENDPOINTS = ["file:///etc/passwd", "ftp://127.0.0.1:21", "gopher://127.0.0.1:70", "unix:/tmp/x.sock",
                 "unix:///tmp/x.sock", "javascript:alert(1)", "http://user:pw@127.0.0.1:8080", "127.0.0.1:99999",
                 "relative/agent.sock", "127.0.0.1", "", "http://127.0.0.1:8080/../../admin",
                 "dict://127.0.0.1:11211", "127.0.0.1:80 #x"]


def _mode(path: str) -> int:
    import os
    import stat

    return stat.S_IMODE(os.stat(path).st_mode)


def run_security() -> Result:
    """Scenario 11: file modes of the segment (made by ``dplb-shm create`` under umask 000) and of
    the agent's and engine's Unix sockets (agent started under umask 000); admin token and API key
    enforcement; admin API refusing worker endpoints with other schemes (:data:`BAD_ENDPOINTS`)."""
    import os
    import subprocess
    import sys

    from bench.faultsuite.load import openai_error
    from launcher.stack import ROOT, unique_shm_name

    res = Result("11 security", "umask 000; requests without/with wrong admin token and API key; foreign URL schemes")
    name = unique_shm_name("dplb-test")
    try:
        subprocess.run([sys.executable, "-m", "dplb_shm", "create", "--name", name, "--slots", "4"], check=True,
                       cwd=str(ROOT), umask=0, capture_output=True, timeout=60)
        res.extra["segment_mode_cli"] = oct(_mode(f"/dev/shm/{name}"))
    finally:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
    tok, key = "adm-s3cret", "sk-k3y"
    with Stack() as st:
        res.extra["segment_mode"] = oct(_mode(f"/dev/shm/{st.shm}"))
        a = st.agent(0, umask=0)
        res.extra["agent_socket_mode"] = oct(_mode(a.uds))
        res.extra["engine_socket_mode"] = oct(_mode(a.engine_uds))
        base = st.router({"router": {"admin_token": tok, "api_key": key}}, ready=1)
        checks: dict[str, tuple[int, bool]] = {}

        def check(label: str, method: str, path: str, **kw: Any) -> None:
            import orjson

            r = httpx.request(method, base + path, timeout=30, **kw)
            try:
                shaped = openai_error(orjson.loads(r.content)) if r.status_code >= 400 else True
            except orjson.JSONDecodeError:
                shaped = False
            checks[label] = (r.status_code, shaped)
            res.add([Outcome(0, 0, False, "ok" if r.status_code < 400 else ("honest" if shaped else "lost"),
                             r.status_code, None, label)])

        good = {"json": chat(max_tokens=2)}
        check("admin list, no token", "GET", "/dplb/workers")
        check("admin list, wrong token", "GET", "/dplb/workers", headers={"authorization": "Bearer nope"})
        check("admin list, token header", "GET", "/dplb/workers", headers={"x-dplb-admin-token": tok})
        check("admin list, bearer token", "GET", "/dplb/workers", headers={"authorization": f"Bearer {tok}"})
        check("admin drain, no token", "POST", "/dplb/workers/0/drain")
        check("admin remove, api key only", "DELETE", "/dplb/workers/0", headers={"authorization": f"Bearer {key}"})
        check("chat, no key", "POST", "/v1/chat/completions", **good)
        check("chat, wrong key", "POST", "/v1/chat/completions", headers={"authorization": "Bearer sk-wrong"}, **good)
        check("chat, admin token as key", "POST", "/v1/chat/completions", headers={"authorization": f"Bearer {tok}"},
              **good)
        check("chat, key", "POST", "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, **good)
        check("models, no key", "GET", "/v1/models")
        check("route dry run, no key", "POST", "/dplb/route", **good)
        check("generate, no key", "POST", "/generate", json={"text": "a b"})
        admin = {"x-dplb-admin-token": tok}
        bad = {}
        for ep in BAD_ENDPOINTS:
            r = httpx.post(base + "/dplb/workers", json={"endpoint": ep}, headers=admin, timeout=30)
            bad[ep] = r.status_code
            res.add([Outcome(0, 0, False, "honest" if r.status_code == 400 else "lost", r.status_code, None, ep)])
        res.extra["checks"] = checks
        res.extra["bad_endpoints"] = bad
        res.extra["claimed_slots"] = [s.worker_id for s in st.seg.snapshot() if int(s.state) != 0]
        res.extra["drained_after"] = st.row(base, 0)["routing"]
    return res
