"""The endpoint picker's admission queue through a real Envoy (docs/admission.md): with every
worker full, ``dplb-epp`` holds the ext_proc stream of a new request, dispatches it when a worker
has room again (Envoy then sends it where the picker says), and sheds a request that waited its
budget with an ``ImmediateResponse`` 429 whose ``Retry-After`` and OpenAI-shaped body reach the
client through Envoy.

The stack is this module's own: two agent-like fake workers in the picker's segment, each with
``max_num_seqs`` 2, a ``round_robin`` picker (a policy without a TTFT estimate has room while the
chosen worker's in-flight count is below ``max_num_seqs``) with admission on, and one Envoy
(``BUFFERED`` request bodies) whose ``message_timeout`` (how long it waits for each picker answer)
is shorter than the queue wait, as a production queue budget is longer than any per-message
timeout. Every process is killed and the segment unlinked at teardown."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from bench.fakes import start_fake
from tests.epp.conftest import STARTUP_S, live_slots
from tests.helpers import (
    ROOT,
    Procs,
    free_port,
    metric,
    script,
    unique_shm_name,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SEATS = 2                  # max_num_seqs of each of the two fake workers
HOLD_S = 4.0               # a held request streams for about this long
MESSAGE_TIMEOUT_S = 2.0    # Envoy's wait for each picker answer: shorter than the queued wait
MODEL = "fake-model"
CONFIG = ("health_check:\n  heartbeat_timeout_ms: 2000\n"
          "admission:\n  enabled: true\n  queue_budget_s: 60\n  shed_late: false\n")


class Stack:
    def __init__(self, mode: str) -> None:
        from dplb_shm import Segment
        from epp.envoy import EnvoySettings, bootstrap_yaml, envoy_argv
        from launcher.stack import wait_for

        self.dir = tempfile.mkdtemp(prefix="dplb-epa-", dir="/tmp")
        self.shm = unique_shm_name()
        self.procs = Procs()
        self.seg = Segment.create(self.shm, num_slots=8)
        try:
            fakes = [start_fake(self.procs, self.shm, i, self.dir, "--max-num-seqs", str(SEATS), port=free_port())
                     for i in range(2)]
            conf = Path(self.dir) / "dplb.yaml"
            conf.write_text(CONFIG)
            epp_port, self.metrics_port = free_port(), free_port()
            epp = self.procs.start([script("dplb-epp"), "--config", str(conf), "--shm", self.shm, "--policy",
                                    "round_robin", "--port", str(epp_port), "--health-port", str(free_port()),
                                    "--metrics-port", str(self.metrics_port), "--state-dir",
                                    os.path.join(self.dir, "state"), "--log-level", "info"],
                                   log=os.path.join(self.dir, "epp.log"), cwd=str(ROOT))
            want = {f.endpoint for f in fakes}
            wait_for(lambda: want <= {ep for ep, s in live_slots(self.seg).items() if int(s.state) == 2}
                     and httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).status_code == 200,
                     STARTUP_S, "dplb-epp with 2 ready workers", children=[epp])
            port, admin = free_port(), free_port()
            cfg = Path(self.dir) / "envoy.yaml"
            cfg.write_text(bootstrap_yaml(EnvoySettings(listen_port=port, admin_port=admin, epp_port=epp_port,
                                                        request_body_mode=mode,
                                                        message_timeout_s=MESSAGE_TIMEOUT_S)))
            envoy = self.procs.start(envoy_argv(str(cfg)), log=os.path.join(self.dir, "envoy.log"), cwd=str(ROOT))
            wait_for(lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=2).text.strip() == "LIVE",
                     STARTUP_S, "Envoy admin /ready", children=[envoy])
            self.envoy = f"http://127.0.0.1:{port}"
        except BaseException:
            self.close()
            raise

    def inflight(self) -> int:
        return sum(int(self.seg.router_line(i)["router_inflight"]) for i in range(2))

    def idle(self) -> bool:
        fields = ("router_inflight", "prefill_tokens", "decode_reqs", "decode_ctx_tokens")
        return not any(int(self.seg.router_line(i)[k]) for i in range(2) for k in fields)

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text

    def log_tail(self) -> str:
        try:
            return "\n".join(Path(self.dir, "epp.log").read_text().splitlines()[-20:])
        except OSError as e:
            return str(e)

    def close(self) -> None:
        try:
            self.procs.close()
        finally:
            self.seg.close()
            if os.path.exists(f"/dev/shm/{self.shm}"):
                os.unlink(f"/dev/shm/{self.shm}")
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module", params=["STREAMED", "BUFFERED"])
def stack(request):
    s = Stack(request.param)   # the hold works whether Envoy waits for the head's answer or not
    try:
        yield s
    finally:
        s.close()


async def _stream(ac: httpx.AsyncClient, i: int) -> tuple[int, str, float]:
    """One streamed chat request held ``HOLD_S`` at the worker: (status, body, seconds)."""
    t0 = time.monotonic()
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"req {i}"}], "max_tokens": 4, "stream": True}
    hdr = {"x-fake-mode": "stream", "x-fake-chunks": str(int(HOLD_S / 0.1)), "x-fake-delay": "0.1"}
    async with ac.stream("POST", "/v1/chat/completions", json=body, headers=hdr) as r:
        text = (await r.aread()).decode(errors="replace")
        return r.status_code, text, time.monotonic() - t0


def test_queued_requests_go_when_room_frees_and_a_budget_expiry_is_a_429_through_envoy(stack):
    async def run() -> tuple[list, list, BaseException | None, float]:
        async with httpx.AsyncClient(base_url=stack.envoy, timeout=httpx.Timeout(120),
                                     limits=httpx.Limits(max_keepalive_connections=0)) as ac:
            first = [asyncio.ensure_future(_stream(ac, i)) for i in range(2 * SEATS)]
            t0 = time.monotonic()
            while stack.inflight() < 2 * SEATS and time.monotonic() - t0 < 60:
                await asyncio.sleep(0.05)
            assert stack.inflight() == 2 * SEATS, stack.log_tail()
            queued = [asyncio.ensure_future(_stream(ac, 100 + i)) for i in range(2)]
            t1 = time.monotonic()
            while (metric(await asyncio.to_thread(stack.metrics), "dplb_router_admission_queue_depth") or 0) < 2:
                assert time.monotonic() - t1 < 30, "the two requests never waited in the picker's queue"
                await asyncio.sleep(0.05)
            # while they wait, a request with a short budget of its own is shed: a 429 through Envoy
            sdk = openai.AsyncOpenAI(base_url=stack.envoy + "/v1", api_key="none", timeout=30, max_retries=0)
            shed: BaseException | None = None
            t2 = time.monotonic()
            try:
                await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "late"}],
                                                  extra_headers={"x-dplb-queue-budget-ms": "500"})
            except openai.APIStatusError as e:
                shed = e
            shed_wait = time.monotonic() - t2
            return list(await asyncio.gather(*first)), list(await asyncio.gather(*queued)), shed, shed_wait

    first, queued, shed, shed_wait = asyncio.run(run())
    # the client got the picker's 429 as the OpenAI SDK knows it, Retry-After and reason included
    assert isinstance(shed, openai.RateLimitError), shed
    assert shed.status_code == 429 and shed_wait >= 0.5
    assert int(shed.response.headers["retry-after"]) >= 1
    assert shed.response.headers["x-dplb-shed-reason"] == "budget"
    err = shed.response.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == 429 and "queue budget" in err["message"]
    # every held and every queued request was served to its end; the queued ones only once the
    # first ones ended (they waited longer than Envoy's per-message timeout)
    for status, text, _ in first + queued:
        assert status == 200 and "[DONE]" in text, (status, text[:300], stack.log_tail())
    assert min(s for _, _, s in queued) >= HOLD_S > MESSAGE_TIMEOUT_S
    text = stack.metrics()
    assert (metric(text, "dplb_router_admission_wait_seconds_count", **{"class": "0"}) or 0) >= 2
    assert (metric(text, "dplb_router_admission_shed_total", reason="budget", **{"class": "0"}) or 0) >= 1
    assert metric(text, "dplb_router_admission_queue_depth") == 0
    wait_until(stack.idle, 15, what="router lines back to 0")
