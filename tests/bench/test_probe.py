"""The harness's readiness probe is the same tenant as the load it precedes (bench/systems.py).

DPLB's admission queue takes a request without a tenant header or ``user`` field for the tenant of
its ``Authorization`` value. A probe without that header was a second tenant, dispatched within
``admission.reserve_window_s`` of the replayed load, so the load counted as above its fair share and
filled only ``tenant_reserve`` of the headroom for that long: live runs held requests the simulator
(one tenant) did not (tests/simulate/test_fidelity_live.py; bench/results/admission.md, "Round 5
fidelity"). Both requests here go to a loopback server that records their ``Authorization``.
"""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from bench.replay import ReplayOptions, make_client
from bench.systems import MODEL, probe

ANSWER = {"id": "x", "object": "chat.completion", "created": 0, "model": MODEL,
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}]}


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append(self.headers.get("Authorization"))
        body = json.dumps(ANSWER).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder():
    _Recorder.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", _Recorder.seen
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


async def _one_replay_request(base_url: str) -> None:
    client = make_client(ReplayOptions(base_url=base_url + "/v1", stream=False))
    try:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    finally:
        await client.close()


@pytest.mark.parametrize("env_key", [None, "sk-operator"])
def test_the_probe_sends_the_replay_clients_key(recorder, monkeypatch, env_key):
    base, seen = recorder
    if env_key is None:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    else:
        monkeypatch.setenv("OPENAI_API_KEY", env_key)
    assert probe(base)
    asyncio.run(_one_replay_request(base))
    assert len(seen) == 2
    probe_auth, replay_auth = seen
    assert replay_auth is not None and replay_auth.startswith("Bearer ")
    assert probe_auth == replay_auth
    if env_key is not None:
        assert replay_auth == f"Bearer {env_key}"
