"""Issue 46 (what fails stays contained), the items of the router's request path; see
:mod:`bench.faultsuite.scenarios`.

``46.5`` (text and JSON access logs): requests whose model name, ``X-Request-Id`` and path carry
line breaks, control characters, forged ``key=value`` fields and a 4 MiB model name; the router's
log must gain exactly one access line per request, each one parsing into the router's own fields
with the client's values inside them, and stay small.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections import Counter
from typing import Any

import httpx
import orjson

from bench.fakes import start_fake
from bench.faultsuite.cluster import MODEL_FAKE, MODEL_SIM, Stack
from bench.faultsuite.common import Result
from launcher.stack import ROOT, free_port, wait_for

CHAT = "/v1/chat/completions"
#: a whole forged router line, as a client would try to slip it in after a line break
FORGED = "2026-12-07 03:00:00,000 WARNING dplb.router.workers: worker 0: ready -> dead"
#: the access line's own fields (router/access_log.py), besides its two bare tokens (method, route)
ACCESS_KEYS = {"rid", "model", "worker", "status", "ttft_ms", "duration_ms", "prompt_tokens", "output_tokens",
               "attempts", "queue_ms"}
_TOKEN = re.compile(r'(?:(\w+)=)?("(?:[^"\\]|\\.)*"(?:\.\.\.\(\+\d+ chars\))?|[^ ]*)(?: |$)')


def hostile_requests() -> list[tuple[str, str, bytes, dict[str, bytes]]]:
    """(label, path, body, extra headers) of every hostile request the scenario sends."""
    def body(model: str) -> bytes:
        return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})

    ok = body(MODEL_FAKE)
    return [
        ("CRLF + forged line in the model", CHAT, body("m\r\n" + FORGED), {}),
        ("LF, NEL, U+2028, ANSI, NUL in the model", CHAT, body("a\nb\x85c\u2028d\x1b[31me\x00f"), {}),
        ("forged fields in the model", CHAT, body('x" worker=9 status=500 y="'), {}),
        ("forged fields in X-Request-Id", CHAT, ok, {"x-request-id": b"abc worker=9 status=500"}),
        ("quote and backslash in X-Request-Id", CHAT, ok, {"x-request-id": b'q"\\" attempts=7'}),
        ("obs-text in X-Request-Id", CHAT, ok, {"x-request-id": b"id\xc2\x85\xe2\x80\xa8z"}),
        ("CRLF in the path (percent-encoded)", CHAT + "%0d%0a" + FORGED.replace(" ", "%20"), ok, {}),
        ("tab and forged field in the path", "/v1/x%09worker=9%20status=500", ok, {}),
    ]


def _send(port: int, method: str, path: str, body: bytes, headers: dict[str, bytes]) -> int | None:
    """One raw HTTP/1.1 request on its own connection; the status, or None when none came."""
    head = [f"{method} {path} HTTP/1.1".encode(), b"host: 127.0.0.1", b"content-type: application/json",
            b"content-length: %d" % len(body), b"connection: close"]
    head += [k.encode() + b": " + v for k, v in headers.items()]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        while True:   # drain to the end: the access line is written once the answer is
            chunk = s.recv(65536)
            if not chunk:
                break
    m = re.match(rb"HTTP/1\.1 (\d{3})", data)
    return int(m.group(1)) if m else None


def parse_access(msg: str) -> tuple[list[str], dict[str, str]]:
    """A text access line's message as (bare tokens, key=value fields); a quoted value keeps its
    quotes. Raises ValueError when the message does not split into tokens."""
    bare: list[str] = []
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(msg):
        m = _TOKEN.match(msg, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"unparsable at {pos}: {msg[pos:pos + 40]!r}")
        k, v = m.group(1), m.group(2)
        if k is None:
            bare.append(v)
        elif k in fields:
            raise ValueError(f"field {k} twice")
        else:
            fields[k] = v
        pos = m.end()
    return bare, fields


def _new_lines(path: str, start: int, want: int = 0, wait_s: float = 5.0) -> tuple[list[str], int]:
    """The lines written to ``path`` past byte ``start`` and their bytes, once at least ``want``
    lines are there or ``wait_s`` s have passed (the access lines come in batches, written within
    ``router.access_log.FLUSH_S``)."""
    deadline = time.monotonic() + wait_s
    while True:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        lines = data.decode("utf-8", "replace").split("\n")[:-1]
        if len(lines) >= want or time.monotonic() >= deadline:
            return lines, len(data)
        time.sleep(0.02)


def _check_text(lines: list[str], sent: int) -> dict[str, Any]:
    access = [ln.split(" dplb.router.access: ", 1)[1] for ln in lines if " INFO dplb.router.access: " in ln]
    bad: list[str] = []
    for msg in access:
        try:
            bare, fields = parse_access(msg)
        except ValueError as e:
            bad.append(f"{e}: {msg[:120]}")
            continue
        if set(fields) != ACCESS_KEYS or len(bare) != 2 or fields["worker"] not in ("0", "-") \
                or fields["attempts"] not in ("0", "1"):
            bad.append(msg[:200])
    return {"access_lines": len(access), "bad_access_lines": bad}


def _check_json(lines: list[str]) -> dict[str, Any]:
    objs, bad = [], []
    for ln in lines:
        if ln.startswith("{"):
            try:
                objs.append(orjson.loads(ln))
            except orjson.JSONDecodeError:
                bad.append(ln[:200])
    keys = ACCESS_KEYS | {"method", "route"}
    bad += [str(o)[:200] for o in objs if set(o) != keys or o["worker"] not in ("0", "-")]
    return {"access_lines": len(objs), "bad_access_lines": bad}


def run_log_injection(mode: str = "text", big_mib: int = 4, big_n: int = 3) -> Result:
    """A fake worker and a router (``router.access_log: mode``); every request of
    :func:`hostile_requests`, then ``big_n`` requests naming a ``big_mib`` MiB model. Counts the
    router log's new lines: one access line per request, each parsing into exactly the router's
    fields (text: ``key=value`` with the client's values quoted; json: one valid object), no other
    line but known ones, and the growth in bytes."""
    res = Result(f"46.5 client data in the {mode} log",
                 f"{len(hostile_requests())} requests with CR/LF, controls and forged fields in model, X-Request-Id "
                 f"and path; {big_n} requests naming a {big_mib} MiB model")
    with Stack() as st:
        st.fake(0)
        base = st.router({"router": {"access_log": mode}}, ready=1)
        port = int(base.rsplit(":", 1)[1])
        log = st.routers[-1][0].log
        start = os.path.getsize(log)
        statuses = {}
        for label, path, body, hdrs in hostile_requests():
            statuses[label] = _send(port, "POST", path, body, hdrs)
        lines, _ = _new_lines(log, start, len(statuses))
        res.sent = len(statuses)
        big = orjson.dumps({"model": "M" * (big_mib << 20), "messages": [{"role": "user", "content": "hi"}]})
        before_big = os.path.getsize(log)
        big_status = [_send(port, "POST", CHAT, big, {}) for _ in range(big_n)]
        res.sent += big_n
        lines_big, grown = _new_lines(log, before_big, big_n)
    checked = _check_json(lines) if mode == "json" else _check_text(lines, len(statuses))
    others = [ln[:160] for ln in lines if " dplb.router.access: " not in ln and not ln.startswith("{")]
    forged = [ln[:160] for ln in lines + lines_big if ln.startswith(FORGED[:10]) and "worker 0: ready -> dead" in ln
              and "dplb.router.access" not in ln and not ln.startswith("{")]
    res.extra.update(statuses=statuses, lines=len(lines), other_lines=others, forged_lines=forged, **checked,
                     big_statuses=big_status, big_lines=len(lines_big), big_growth_bytes=grown)
    clean = (not checked["bad_access_lines"] and not forged and not others
             and checked["access_lines"] == len(statuses) == len(lines) and len(lines_big) == big_n)
    res.honest = sum(1 for s in statuses.values() if s is not None and s >= 400) + sum(1 for s in big_status if s)
    res.ok = res.sent - res.honest if clean else 0
    res.lost = 0 if clean else res.sent - res.honest
    return res


def _cpu_s(pid: int) -> float:
    import psutil

    ct = psutil.Process(pid).cpu_times()
    return float(ct.user + ct.system)


def _idle_cpu(pid: int, seconds: float) -> float:
    """Share of one core process ``pid`` used over the next ``seconds`` (wall clock)."""
    import time

    c0, t0 = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return round((_cpu_s(pid) - c0) / (time.monotonic() - t0), 4)


def _freeze_slot(shm: str, slot: int) -> int:
    """Make slot ``slot``'s sequence odd (the first of a write's two stores); returns the odd value."""
    import mmap

    from dplb_shm import layout

    off = layout.slot_offset(slot) + layout.Slot.seq.offset
    with open(f"/dev/shm/{shm}", "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0)
        try:
            seq = int.from_bytes(mm[off:off + 8], "little") | 1
            mm[off:off + 8] = seq.to_bytes(8, "little")
        finally:
            mm.close()
    return seq


def run_slot_frozen_mid_write(idle_s: float = 5.0, requests: int = 20) -> Result:
    """Two fake workers and a router; the router's CPU over ``idle_s`` idle seconds; then worker
    1's writer is SIGSTOPped, its slot's sequence made odd (a write's first store) and the writer
    SIGKILLed (its process group), and the router's idle CPU is measured again once the slot's
    heartbeat is 1 s old; ``requests`` chats must all be served by worker 0."""
    import signal
    import time

    from dplb_shm import Segment
    from dplb_shm.dump import render_table

    res = Result("46.4 slot frozen mid-write",
                 "worker 1's slot writer SIGKILLed between the two stores of its seqlock write (sequence left odd)")
    with Stack() as st:
        st.fake(0)
        f1 = st.fake(1)
        base = st.router({}, ready=2)
        rpid = st.routers[-1][0].pid
        res.extra["idle_cpu_before"] = _idle_cpu(rpid, idle_s)
        st.kill(f1.proc, signal.SIGSTOP)
        _freeze_slot(st.shm, 1)
        t_kill = st.kill(f1.proc, signal.SIGKILL)
        wait_for(lambda: (st.row(base, 1) or {}).get("routing") == "stale", 20, "worker 1 out of routing")
        res.detection_s = round(time.monotonic() - t_kill, 3)
        time.sleep(1.5)   # past the 1 s deadline: reads give up at once
        res.extra["idle_cpu_frozen"] = _idle_cpu(rpid, idle_s)
        served: Counter[str] = Counter()
        with httpx.Client(base_url=base, timeout=60) as c:
            for i in range(requests):
                rr = c.post("/v1/chat/completions", json={"model": MODEL_FAKE, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": f"hi {i}"}]})
                served[f"{rr.status_code}/{rr.headers.get('x-dplb-worker-id')}"] += 1
        res.sent, res.ok = requests, served.get("200/0", 0)
        res.lost = requests - res.ok
        res.extra["served"] = dict(served)
        res.extra["routing_1"] = (st.row(base, 1) or {}).get("routing")
        seg = Segment.attach(st.shm, readonly=True)
        try:
            before = seg.read_spins
            res.extra["stale_read"] = seg.read_slot(1).stale
            res.extra["spins_per_read"] = seg.read_spins - before
            res.extra["dump_state_1"] = next(ln.split()[1] for ln in render_table(seg).splitlines()[2:]
                                             if ln.split()[0] == "1")
        finally:
            seg.close()
    return res


_ERROR_KEY = b'"error"'


def _metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every series ``name`` with ``labels`` in Prometheus exposition ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(float(s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _chat(c: httpx.Client, stream: bool, mode: str | None = None, chunks: int = 3) -> tuple[int, str | None, bytes]:
    hs = {"x-fake-mode": mode, "x-fake-chunks": str(chunks)} if mode else {}
    r = c.post("/v1/chat/completions", headers=hs, json={"model": MODEL_FAKE, "stream": stream, "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "hi"}]})
    return r.status_code, r.headers.get("x-dplb-worker-id"), r.content


def run_engine_abort(n: int = 6, starve_s: float = 0.0) -> Result:
    """Two fake workers. (a) worker 0 answers every request with an engine-side abort before any
    content (``n`` non-streamed and ``n`` streamed requests): each must be served whole by worker 1;
    (b) a non-streamed abort on both workers: 502; (c) ``n`` streams aborted by the engine after 3
    content chunks and ``n`` after 1 (both workers): each must end with an SSE error event (then
    the engine's ``[DONE]``, never before it) and be counted 502.

    ``starve_s`` > 0: worker 1's fake is stopped (SIGSTOP) for ``2 * starve_s`` seconds from
    ``starve_s`` before (c), as a busy machine starves a process. Its probes time out and its
    heartbeat ages meanwhile; the router here is configured not to act on either, and its circuit
    breaker is off: with the defaults the router took worker 1 out, sent (c) to worker 0, whose
    breaker opened at its 20th outcome (all aborts), and answered the rest 503 in JSON, a stream
    ending with neither an error event nor ``[DONE]`` (what one heavy-load run showed)."""
    import signal
    import threading

    res = Result("46.2 engine-side abort", "finish_reason \"abort\" from the engine, before any content and "
                 "after 3 content chunks, streamed and not")
    with Stack() as st:
        f0 = st.fake(0)
        f1 = st.fake(1)
        # what this measures is the relay of aborts: a worker's probes and heartbeat on a starved
        # machine, and the breaker on the aborts it provokes on both workers, are not (see above)
        base = st.router({"routing_policy": {"policy": "round_robin"}, "circuit_breaker": {"enabled": False},
                          "health_check": {"timeout_ms": 10_000, "heartbeat_timeout_ms": 60_000}}, ready=2)
        f0.client().set_mode("abort", chunks=0)
        early: Counter[str] = Counter()
        with httpx.Client(base_url=base, timeout=60) as c:
            for i in range(2 * n):
                status, wid, body = _chat(c, stream=i % 2 == 1)
                early[f"{status}/{wid}/{'abort' if b'abort' in body else 'whole'}"] += 1
            f0.client().set_mode("ok")
            status, _, body = _chat(c, stream=False, mode="abort")
            res.extra["non_streamed_everywhere"] = (status, orjson.loads(body).get("error", {}).get("type"))
            cut: Counter[str] = Counter()
            wake = None
            if starve_s > 0:
                os.kill(f1.proc.pid, signal.SIGSTOP)
                wake = threading.Timer(2 * starve_s, os.kill, (f1.proc.pid, signal.SIGCONT))
                wake.start()
                time.sleep(starve_s)
            try:
                for i in range(2 * n):   # 3 chunks 50 ms apart (the native relay), or 1 (one read: the Python path)
                    status, wid, body = _chat(c, stream=True, mode="abort", chunks=3 if i % 2 else 1)
                    ending = stream_ending(body)
                    cut[f"{status}/{ending}"] += 1
                    if ending != "error_event":   # what the client read, for the report
                        res.extra.setdefault("odd_endings", []).append((status, wid, body[-600:]))
            finally:   # never leave the fake stopped
                if wake is not None:
                    wake.join()
            text = httpx.get(base + "/metrics", timeout=10).text
        res.extra.update(early=dict(early), cut=dict(cut))
        res.extra["requests_502"] = _metric_sum(text, "dplb_router_requests_total", status="502")
        res.extra["engine_abort_errors"] = _metric_sum(text, "dplb_router_request_errors_total", kind="engine_abort")
        res.sent = 4 * n + 1
        res.ok = early.get("200/1/whole", 0)
        res.honest = cut.get("200/error_event", 0) + (res.extra["non_streamed_everywhere"][0] == 502)
        res.lost = res.sent - res.ok - res.honest
    return res


def _raw_chat(port: int, model: str, stream: bool, max_tokens: int) -> socket.socket:
    """Send one chat request on a raw connection and return the connection, unread."""
    b = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
                      "stream": stream, "ignore_eos": True})
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(b) + b)
    return s


def run_queued_client_leaves(stream: bool = True, timeout_s: float = 20.0) -> Result:
    """One sim worker (``--max-num-seqs 1``) busy with a long non-streamed answer; a second request
    (``stream``) waits in its queue; its client closes the connection. Records whether the engine
    dropped the queued request while the long one still ran, and how many engine steps that took."""
    import time

    res = Result(f"46.6 client leaves while queued ({'streamed' if stream else 'non-streamed'})",
                 "the client of a request waiting in the engine's queue (max_num_seqs 1, busy) closes its connection")
    with Stack() as st:
        a = st.agent(0, "--max-num-seqs", "1")
        base = st.router({}, ready=1)
        port = int(base.rsplit(":", 1)[1])
        long = _raw_chat(port, MODEL_SIM, False, 4000)
        try:
            wait_for(lambda: a.engine_state()["running"] == 1, 30, "the long request running")
            long_id = a.engine_state()["running_ids"][0]
            q = _raw_chat(port, MODEL_SIM, stream, 50)
            wait_for(lambda: a.engine_state()["waiting"] == 1, 30, "the second request queued")
            queued_id = a.engine_state()["waiting_ids"][0]
            steps0 = a.engine_state()["steps"]
            q.close()
            t0 = time.monotonic()

            def dropped() -> bool:
                s = a.engine_state()
                return queued_id not in s["in_flight"] or long_id not in s["in_flight"]

            wait_for(dropped, timeout_s, "the queued request dropped or the long one done", interval=0.01)
            s = a.engine_state()
            res.detection_s = round(time.monotonic() - t0, 3)
            res.sent = 1
            aborted = queued_id not in s["in_flight"] and long_id in s["running_ids"]
            res.ok, res.lost = (1, 0) if aborted else (0, 1)
            res.extra.update(aborted_while_queued=aborted, engine_steps_meanwhile=s["steps"] - steps0,
                             long_still_running=long_id in s["running_ids"])
        finally:
            long.close()
    return res


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run_add_plain_engine(requests: int = 20) -> Result:
    """A router with one local fake worker; then ``POST /add_worker?url=`` of (a) a sim engine on
    TCP started without an agent, (b) a plain HTTP file server (neither agent nor engine), (c) a
    fake DPLB agent's control address on TCP. ``requests`` chats naming the sim engine's model go
    through the router; every one must be served by the engine's slot."""
    res = Result("46.8 /add_worker?url= of a plain engine",
                 "POST /add_worker?url= of a sim engine on TCP without an agent, of a plain HTTP server, "
                 "and of a DPLB agent's control address")
    with Stack() as st:
        st.fake(0)
        base = st.router({}, ready=1)
        port = free_port()
        st.procs.start([sys.executable, "-m", "sim_engine", "--port", str(port), "--model", MODEL_SIM],
                       name="plain-engine", log=st.path("plain-engine.log"), cwd=str(ROOT))
        wait_for(lambda: _http_ok(f"http://127.0.0.1:{port}/health"), 60, "the plain sim engine up")
        r = httpx.post(base + "/add_worker", params={"url": f"http://127.0.0.1:{port}"}, timeout=30)
        added = r.json()
        res.extra["engine_added"] = (r.status_code, added.get("engine"), added.get("message"))
        slot = added.get("worker_id")

        def row() -> dict[str, Any]:
            return st.row(base, int(slot)) or {} if slot is not None else {}

        wait_for(lambda: row().get("routing") == "eligible", 20, "the plain engine eligible")
        res.extra["engine_row"] = {k: row().get(k) for k in ("state", "routing", "model", "endpoint", "control")}
        served: Counter[str] = Counter()
        with httpx.Client(base_url=base, timeout=60) as c:
            for i in range(requests):
                stream = i % 2 == 1
                rr = c.post("/v1/chat/completions", json={"model": MODEL_SIM, "max_tokens": 8, "stream": stream,
                                                          "messages": [{"role": "user", "content": f"hi {i}"}]})
                served[f"{rr.status_code}/{rr.headers.get('x-dplb-worker-id')}"] += 1
        res.sent, res.ok = requests, served.get(f"200/{slot}", 0)
        res.lost = requests - res.ok
        res.extra["served"] = dict(served)
        res.extra["scraped_kv_cache_usage"] = st.seg.read_slot(int(slot)).kv_cache_usage if slot is not None else None
        # (b) neither an agent nor an engine: a plain file server
        fport = free_port()
        st.procs.start([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(fport), "--directory",
                        st.dir], name="file-server", log=st.path("file-server.log"), cwd=str(ROOT))
        wait_for(lambda: _http_ok(f"http://127.0.0.1:{fport}/"), 30, "the file server up")
        r = httpx.post(base + "/add_worker", params={"url": f"http://127.0.0.1:{fport}"}, timeout=30)
        res.extra["neither"] = (r.status_code, r.json().get("error", {}).get("message"))
        # (c) a DPLB agent's control address still mirrors as before
        aport = free_port()
        start_fake(st.procs, None, 9, st.dir, port=aport)
        r = httpx.post(base + "/add_worker", params={"url": f"http://127.0.0.1:{aport}"}, timeout=30)
        res.extra["agent_added"] = (r.status_code, r.json().get("engine"))
        res.extra["slots"] = sorted(s.worker_id for s in st.seg.snapshot() if int(s.state) != 0)
    return res




def _error_of(event: bytes) -> dict[str, Any] | None:
    """The OpenAI ``error`` object of one SSE event, or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and _ERROR_KEY in line:
            try:
                err = orjson.loads(line[5:]).get("error")
            except orjson.JSONDecodeError:
                return None
            return err if isinstance(err, dict) else None
    return None


def stream_ending(body: bytes) -> str:
    """How an aborted or cut SSE body ends: ``error_event`` (an error event, nothing but the
    engine's ``[DONE]`` after it), ``error_after_done`` (an error event after a ``[DONE]``: the
    client stopped reading at the ``[DONE]`` and took a truncated answer as whole),
    ``done_without_error`` or ``no_error_event``."""
    events = [e.strip() for e in body.split(b"\n\n") if e.strip()]
    done = [i for i, e in enumerate(events) if e in (b"data: [DONE]", b"data:[DONE]")]
    errors = [i for i, e in enumerate(events) if _error_of(e) is not None]
    if errors and done and done[0] < errors[-1]:
        return "error_after_done"
    if errors and all(i in done for i in range(errors[-1] + 1, len(events))):
        return "error_event"
    return "done_without_error" if done else "no_error_event"


def run_drain_cut(streams: int = 3, drain_timeout_s: float = 1.0) -> Result:
    """One fake worker streaming slowly (400 chunks 50 ms apart) and answering a non-streamed
    request after 30 s; a router with ``--drain-timeout`` ``drain_timeout_s`` gets SIGTERM while
    ``streams`` streams (content already read) and one non-streamed request are in flight. At the
    drain limit each stream must end with an OpenAI-shaped SSE error event (503) and a whole
    chunked body, the non-streamed request get a 503 with ``Retry-After``, and the router's
    access log count them 503, never 499 (before: the streams were cut without their body's end
    and counted 499 ``client_disconnect``, like a client that left)."""
    import signal
    import threading
    import time

    res = Result("46.2d the router's drain limit cuts long streams",
                 f"SIGTERM of the router (--drain-timeout {drain_timeout_s:g}) with {streams} 20 s streams "
                 "and a 30 s non-streamed request in flight")
    answers: list[dict[str, Any]] = []
    started = threading.Semaphore(0)

    def client(base: str, stream: bool) -> None:
        hs = {"x-fake-mode": "stream", "x-fake-chunks": "400", "x-fake-delay": "0.05"} if stream else \
            {"x-fake-mode": "slow", "x-fake-delay": "30"}
        body = {"model": MODEL_FAKE, "stream": stream, "max_tokens": 400, "messages": [{"role": "user", "content": "hi"}]}
        a: dict[str, Any] = {"stream": stream, "status": None, "body": b"", "error": None, "retry_after": None}
        try:
            with httpx.Client(base_url=base, timeout=90) as c, c.stream("POST", CHAT, headers=hs, json=body) as r:
                a["status"], a["retry_after"] = r.status_code, r.headers.get("retry-after")
                for chunk in r.iter_raw():
                    if stream and not a["body"]:
                        started.release()
                    a["body"] += chunk
        except httpx.HTTPError as e:
            a["error"] = type(e).__name__
        finally:
            answers.append(a)
            if not stream or not a["body"]:
                started.release()

    with Stack() as st:
        f = st.fake(0)
        base = st.router({}, "--drain-timeout", f"{drain_timeout_s:g}", ready=1)
        router, log = st.routers[-1][0], st.routers[-1][0].log or ""
        threads = [threading.Thread(target=client, args=(base, i < streams), daemon=True) for i in range(streams + 1)]
        for t in threads:
            t.start()
        for _ in range(streams):
            started.acquire(timeout=60)
        wait_for(lambda: f.client().stats()["active"] == streams + 1, 60, "every request in flight at the fake")
        t0 = time.monotonic()
        router.popen.send_signal(signal.SIGTERM)
        rc = router.popen.wait(60)
        for t in threads:
            t.join(60)
        res.extra["stop_s"] = round(time.monotonic() - t0, 2)
        res.extra["router_rc"] = rc
        with open(log, errors="replace") as fh:
            all_lines = fh.readlines()
        lines = [ln for ln in all_lines if " POST " in ln and "status=" in ln]
    statuses = Counter(re.search(r"status=(\d+)", ln).group(1) for ln in lines)  # type: ignore[union-attr]
    ends: Counter[str] = Counter()
    for a in answers:
        if a["stream"]:
            events = [e for e in a["body"].split(b"\n\n") if e.strip()]
            err = next((_error_of(e) for e in reversed(events) if _error_of(e) is not None), None)
            ends[f"{a['status']}/{a['error'] or 'whole'}/{stream_ending(a['body'])}/"
                 f"{err.get('code') if err else None}/{err.get('type') if err else None}"] += 1
        else:
            err = orjson.loads(a["body"]).get("error", {}) if a["body"].startswith(b"{") else {}
            res.extra["non_streamed"] = (a["status"], a["retry_after"], err.get("type"), a["error"])
    res.extra["streams"] = dict(ends)
    res.extra["access_statuses"] = dict(statuses)
    res.extra["drain_cut_lines"] = sum("answered 503" in ln and "drain limit" in ln for ln in all_lines)
    res.sent = streams + 1
    res.honest = ends.get("200/whole/error_event/503/service_unavailable", 0) + \
        (res.extra.get("non_streamed", (None,))[0] == 503)
    res.lost = res.sent - res.honest
    return res


__all__ = ["ACCESS_KEYS", "FORGED", "hostile_requests", "parse_access", "run_add_plain_engine", "run_drain_cut",
           "run_engine_abort", "run_log_injection", "run_queued_client_leaves", "run_slot_frozen_mid_write",
           "stream_ending"]
