"""Behind Envoy, a stream broken by an engine crash is counted as the HTTP router counts it
(issue 46, item 7): 502 with a ``stream_broken`` error, not 499 ``client_disconnect``.

The failure: the picker counted every stream that ended before its response's end as the client's
leaving (499), so the 5xx alerts missed engines that crashed under streams. Now the picker asks the
engine (one ``GET /health``) when a stream is cut: an engine that is gone means the stream broke;
a client that leaves a stream of a live engine is still a 499."""
from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import orjson
import pytest

from launcher.stack import wait_for
from tests.epp import faults_stack as fs
from tests.helpers import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _open_stream(url: str, max_tokens: int) -> tuple[socket.socket, str]:
    """Start one streamed chat through Envoy; returns the connection and the serving worker id
    once the first content arrived."""
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    body = orjson.dumps({**fs.chat_body(0, max_tokens), "stream": True, "ignore_eos": True})
    s = socket.create_connection((host, int(port)), timeout=60)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(body) + body)
    data = b""
    while b'"content"' not in data.split(b"\r\n\r\n", 1)[-1]:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
    wid = next(ln.split(":", 1)[1].strip() for ln in head.split("\r\n") if ln.startswith("x-dplb-worker-id:"))
    return s, wid


def _count(st: fs.FaultStack, wid: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{st.epp_ports[2]}/metrics", timeout=5).text
    return metric(text, labels.pop("name"), worker=wid, **labels) or 0.0


def test_a_stream_broken_by_an_engine_crash_is_502_stream_broken_not_499(procs, run_dir, segment, shm_name):
    st = fs.start_stack(procs, run_dir, shm_name, segment, engines=2, engine_args=("--time-scale", "0.2"))
    # a client that leaves a stream of a live engine: 499, as before
    s, wid = _open_stream(st.url, 400)
    s.close()
    wait_for(lambda: _count(st, wid, name="dplb_router_requests_total", status="499") >= 1, 30, "the 499")
    # an engine killed under a stream: 502 stream_broken
    s, wid = _open_stream(st.url, 400)
    try:
        endpoint = segment.read_slot(int(wid)).endpoint
        os.kill(st.engines[st.endpoints.index(endpoint)].pid, signal.SIGKILL)
        t_end = time.monotonic() + 30
        while time.monotonic() < t_end and s.recv(65536):
            pass   # Envoy resets the client's stream when the engine's breaks
    finally:
        s.close()
    wait_for(lambda: _count(st, wid, name="dplb_router_requests_total", status="502") >= 1, 30, "the 502",
             children=[st.epp])
    assert _count(st, wid, name="dplb_router_request_errors_total", kind="stream_broken") == 1
    assert _count(st, wid, name="dplb_router_requests_total", status="499") == 1   # only the first stream's
