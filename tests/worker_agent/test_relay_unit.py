"""The relay app on its own (in-process ASGI, no sockets): refusals, limits and error shapes."""
from __future__ import annotations

import httpx
import pytest

from worker_agent.errors import NotReadyError, QueueFullError
from worker_agent.relay import RelayApp


class Sink:
    worker_id = 7

    def __init__(self, refuse=None):
        self.refuse = refuse
        self.started: list[int] = []
        self.finished: list[tuple] = []

    def admit(self, counted):
        if self.refuse is not None:
            raise self.refuse

    def on_start(self, prompt_tokens):
        self.started.append(prompt_tokens)

    def on_finish(self, *args):
        self.finished.append(args)


async def control(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"control"})


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://agent")


def assert_openai_error(r: httpx.Response, status: int, etype: str):
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == etype and err["code"] == status and err["message"]


@pytest.mark.parametrize("refuse, status, etype, retry", [
    (NotReadyError("DRAINING", worker_id=7), 503, "service_unavailable", True),
    (QueueFullError(4, worker_id=7), 429, "rate_limit_exceeded", True),
])
async def test_refusals_are_openai_shaped(refuse, status, etype, retry):
    sink = Sink(refuse)
    async with client(RelayApp(sink, lambda: None, control)) as c:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(r, status, etype)
    assert ("retry-after" in r.headers) == retry
    assert sink.started == [] and sink.finished == []


async def test_control_paths_bypass_the_relay():
    async with client(RelayApp(Sink(NotReadyError("STARTING")), lambda: None, control)) as c:
        assert (await c.get("/health")).text == "control"
        assert (await c.get("/dplb/state")).text == "control"


async def test_body_over_limit_is_413_and_not_counted():
    sink = Sink()
    async with client(RelayApp(sink, lambda: None, control, max_body_bytes=1000)) as c:
        r = await c.post("/v1/completions", content=b"x" * 1001)
    assert_openai_error(r, 413, "invalid_request_error")
    assert sink.started == []


async def test_no_engine_is_503_retryable_and_a_bug_is_a_shaped_500():
    """No engine to relay to: nothing began, so 503 + Retry-After (a router may try another worker)."""
    sink = Sink()
    async with client(RelayApp(sink, lambda: None, control)) as c:
        r = await c.post("/v1/completions", json={"prompt": "a"})
    assert_openai_error(r, 503, "service_unavailable")
    assert r.headers["retry-after"]

    def broken():
        raise RuntimeError("boom")

    async with client(RelayApp(sink, broken, control)) as c:
        r = await c.post("/v1/completions", json={"prompt": "a"})
    assert_openai_error(r, 500, "internal_error")
