"""The launcher's command line and scripts/launch_dplb.sh, without starting any worker (--dry-run)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "launch_dplb.sh"


def launch(*args: str, script: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    argv = (["bash", str(SCRIPT)] if script else [sys.executable, "-m", "launcher"]) + list(args)
    full_env = {**os.environ, "DPLB_PYTHON": sys.executable, **(env or {})}
    return subprocess.run(argv, capture_output=True, check=False, text=True, cwd=ROOT, env=full_env, timeout=120)


def plan(*args: str, **kw) -> dict:
    args_l = list(args)
    cut = args_l.index("--") if "--" in args_l else len(args_l)
    cp = launch(*args_l[:cut], "--dry-run", "--json", *args_l[cut:], **kw)
    assert cp.returncode == 0, cp.stderr
    return json.loads(cp.stdout)


@pytest.mark.parametrize("script", [False, True])
def test_eight_gpus_four_workers_tp2(script):
    doc = plan("--num-workers", "4", "--gpus", "0-7", "--model", "meta-llama/Llama-3.1-8B-Instruct", script=script)
    assert doc["engine"] == "vllm" and doc["tp_size"] == 2
    assert [w["cuda_visible_devices"] for w in doc["workers"]] == ["0,1", "2,3", "4,5", "6,7"]
    a0 = doc["workers"][0]["argv"]
    assert a0[1:3] == ["-m", "worker_agent"]
    assert a0[a0.index("--tp-size") + 1] == "2" and a0[a0.index("--gpus") + 1] == "0,1"
    assert a0[a0.index("--worker-id") + 1] == "0" and a0[a0.index("--shm") + 1] == "dplb-30000"
    assert a0[a0.index("--uds") + 1].endswith("/agent-0.sock")
    assert doc["router"]["argv"][1:3] == ["-m", "router"]
    e0 = doc["workers"][0]["engine_argv"]           # the engine's own command line, not only the agent's
    assert e0[1:3] == ["-m", "vllm.entrypoints.openai.api_server"], e0
    assert e0[e0.index("--tensor-parallel-size") + 1] == "2" and e0[e0.index("--uds") + 1].endswith("/engine-0.sock")


@pytest.mark.parametrize("script", [False, True])
def test_three_gpus_two_workers_is_a_clear_error(script):
    cp = launch("--num-workers", "2", "--gpus", "0,1,2", "--model", "m", "--dry-run", script=script)
    assert cp.returncode == 2
    assert "cannot split 3 GPU(s)" in cp.stderr and "uneven" in cp.stderr


def test_no_gpu_no_model_is_sim_with_time_scale_passed_to_engine():
    doc = plan("-n", "3", "--gpus", "none", "--time-scale", "0.25", "--port", "30123", "--policy", "round_robin")
    assert doc["engine"] == "sim" and doc["tp_size"] == 1 and doc["shm"] == "dplb-30123"
    for k, w in enumerate(doc["workers"]):
        assert w["cuda_visible_devices"] is None and w["gpus"] == []
        argv = w["argv"]
        assert argv[argv.index("--") + 1:] == ["--time-scale", "0.25"]
        assert argv[argv.index("--engine") + 1] == "sim"
    r = doc["router"]["argv"]
    assert r[r.index("--port") + 1] == "30123" and r[r.index("--policy") + 1] == "round_robin"
    e = doc["workers"][0]["engine_argv"]
    assert e[1:3] == ["-m", "sim_engine"] and e[e.index("--time-scale") + 1] == "0.25", e
    cp = launch("-n", "1", "--gpus", "none", "--dry-run")
    assert "  engine 0: " in cp.stdout and "-m sim_engine --uds" in cp.stdout, cp.stdout


def test_extra_engine_args_after_double_dash():
    doc = plan("-n", "1", "--gpus", "0", "--model", "m", "--", "--max-model-len", "4096")
    argv = doc["workers"][0]["argv"]
    assert argv[argv.index("--") + 1:] == ["--max-model-len", "4096"]


def test_openai_engine_needs_one_url_per_worker():
    cp = launch("-n", "2", "--engine", "openai", "--engine-url", "http://127.0.0.1:8001", "--dry-run")
    assert cp.returncode == 2 and "one --engine-url per worker" in cp.stderr
    doc = plan("-n", "2", "--engine", "openai", "--engine-url", "http://127.0.0.1:8001",
               "--engine-url", "http://127.0.0.1:8002")
    urls = [w["argv"][w["argv"].index("--engine-url") + 1] for w in doc["workers"]]
    assert urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


@pytest.mark.parametrize("args,msg", [
    (["-n", "0"], "at least 1"),
    (["-n", "2", "--engine", "vllm", "--gpus", "0,1"], "needs --model"),
    (["-n", "2", "--port", "70000"], "--port"),
    (["-n", "2", "--config", "/nonexistent/dplb.yaml"], "no such file"),
    (["-n", "2", "--gpus", "0,x"], "not a GPU id"),
    (["-n", "1", "--gpus", "0", "--model", "m", "--time-scale", "2"], "only applies to --engine sim"),
])
def test_usage_errors_exit_2(args, msg):
    cp = launch(*args, "--dry-run")
    assert cp.returncode == 2 and msg in cp.stderr, cp.stderr


def test_run_dir_from_environment(tmp_path):
    doc = plan("-n", "1", env={"DPLB_RUN_DIR": str(tmp_path / "rd")})
    assert doc["run_dir"] == str(tmp_path / "rd")
    assert doc["workers"][0]["argv"][doc["workers"][0]["argv"].index("--uds") + 1] == str(tmp_path / "rd" / "agent-0.sock")


def test_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cp = launch("-n", "1", "--port", str(port), "--run-dir", str(tmp_path / "rd"))
    assert cp.returncode == 2 and f"port {port}" in cp.stderr and "not free" in cp.stderr
    assert not os.path.exists(f"/dev/shm/dplb-{port}")


def test_script_help_lists_flags():
    cp = launch("--help", script=True)
    assert cp.returncode == 0
    for flag in ("--num-workers", "--gpus", "--engine", "--model", "--port", "--config", "--state-interval-ms",
                 "--policy", "--time-scale"):
        assert flag in cp.stdout
    from router.policies import policy_names

    text = " ".join(cp.stdout.split())
    assert all(p in text for p in policy_names()) and "one of: dplb, weighted" in text   # the --policy choices
    bad = launch("--policy", "fastest", "--dry-run")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_router_flags_passed_through(tmp_path):
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("routing_policy: {policy: dplb}\n")
    doc = plan("-n", "2", "--config", str(cfg), "--router-workers", "2", "--log-level", "info", "--host", "0.0.0.0",
               "--state-interval-ms", "100")
    r = doc["router"]["argv"]
    assert r[r.index("--config") + 1] == str(cfg) and r[r.index("--workers") + 1] == "2"
    assert r[r.index("--host") + 1] == "0.0.0.0" and r[r.index("--log-level") + 1] == "info"
    assert doc["url"] == "http://127.0.0.1:30000"  # what a client on this machine uses
    a = doc["workers"][1]["argv"]
    assert a[a.index("--state-interval-ms") + 1] == "100"


def test_model_without_gpu_exits_2_and_says_why():
    cp = launch("-n", "2", "--gpus", "none", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--dry-run")
    assert cp.returncode == 2 and "--engine sim" in cp.stderr and "needs GPUs" in cp.stderr, cp.stderr
    doc = plan("-n", "2", "--gpus", "none", "--engine", "sim", "--model", "my-name")
    assert doc["engine"] == "sim" and doc["model"] == "my-name"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_config_file_router_fields_apply_to_the_launch(tmp_path):
    # regression (issue 11): a config with port 31000 still bound 30000 (the launcher always passed
    # its own --host/--port/--shm defaults, which override the file)
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("router: {host: '::1', port: 31000, shm: my-seg}\nrouting_policy: {latency_window_sec: 3.5}\n")
    doc = plan("-n", "2", "--config", str(cfg))
    r = doc["router"]["argv"]
    assert (_flag(r, "--host"), _flag(r, "--port"), _flag(r, "--shm")) == ("::1", "31000", "my-seg")
    assert doc["shm"] == "my-seg" and doc["url"] == "http://[::1]:31000"
    assert doc["run_dir"].endswith("dplb-31000") or "DPLB_RUN_DIR" in os.environ
    for w in doc["workers"]:
        assert _flag(w["argv"], "--shm") == "my-seg" and _flag(w["argv"], "--latency-window-s") == "3.5"


def test_flags_override_the_config_file(tmp_path):
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("router: {host: '::1', port: 31000, shm: my-seg}\n")
    doc = plan("-n", "1", "--config", str(cfg), "--port", "31001", "--shm", "other", "--host", "127.0.0.1")
    r = doc["router"]["argv"]
    assert (_flag(r, "--host"), _flag(r, "--port"), _flag(r, "--shm")) == ("127.0.0.1", "31001", "other")


def test_built_in_defaults_without_config():
    doc = plan("-n", "1")
    r = doc["router"]["argv"]
    assert (_flag(r, "--host"), _flag(r, "--port"), _flag(r, "--shm")) == ("127.0.0.1", "30000", "dplb-30000")
    assert _flag(doc["workers"][0]["argv"], "--latency-window-s") == "10"


def test_invalid_config_field_is_a_usage_error(tmp_path):
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("router: {port: 70000}\n")
    cp = launch("-n", "1", "--config", str(cfg), "--dry-run")
    assert cp.returncode == 2 and "router.port" in cp.stderr, cp.stderr


# ------------------------------------------------------------------ several models on one box (issue 16)
def test_worker_specs_two_models_on_eight_gpus():
    doc = plan("--worker", "model=org/A,gpus=0-3,count=2",
               "--worker", "model=org/B,gpus=4,5,6,7,args=--max-model-len 8192", "--", "--seed", "1")
    assert doc["num_workers"] == 3 and doc["engine"] == "vllm" and doc["models"] == ["org/A", "org/B"]
    ws = doc["workers"]
    assert [(w["model"], w["cuda_visible_devices"], w["tp_size"]) for w in ws] == [
        ("org/A", "0,1", 2), ("org/A", "2,3", 2), ("org/B", "4,5,6,7", 4)]
    a2 = ws[2]["argv"]
    assert a2[a2.index("--model") + 1] == "org/B" and a2[a2.index("--tp-size") + 1] == "4"
    # the launcher's engine args first, then the spec's
    assert a2[a2.index("--") + 1:] == ["--seed", "1", "--max-model-len", "8192"]
    assert ws[0]["argv"][ws[0]["argv"].index("--") + 1:] == ["--seed", "1"]


def test_worker_specs_from_the_config_file(tmp_path):
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("workers:\n"
                   "  - {model: alpha, engine: sim, count: 2}\n"
                   "  - {model: beta, engine: sim, weight: 2, engine_args: ['--max-num-seqs', '8']}\n")
    doc = plan("--config", str(cfg), "--time-scale", "5")
    assert [(w["engine"], w["model"], w["gpus"]) for w in doc["workers"]] == [
        ("sim", "alpha", []), ("sim", "alpha", []), ("sim", "beta", [])]
    b = doc["workers"][2]["argv"]
    assert b[b.index("--weight") + 1] == "2"
    assert b[b.index("--") + 1:] == ["--time-scale", "5", "--max-num-seqs", "8"]


@pytest.mark.parametrize("args,msg", [
    (["--worker", "model=A,gpus=0-3", "--worker", "model=B,gpus=3-4"], "GPU 3 is given to worker spec 1"),
    (["--worker", "model=A,gpus=0-2,count=2"], "cannot split 3 GPU(s)"),
    (["--worker", "model=A,colour=red"], "unknown key 'colour'"),
    (["--worker", "model=A,engine=vllm", "--worker", "model=B,engine=vllm,gpus=0"], "needs gpus="),
    (["--worker", "model=A,engine=sim", "--gpus", "0"], "give each spec its gpus"),
    (["--worker", "model=A,engine=sim,count=2", "-n", "3"], "--num-workers 3 but the worker specs start 2"),
    ([], "give --num-workers N"),
])
def test_worker_spec_errors_are_usage_errors(args, msg):
    cp = launch(*args, "--dry-run")
    assert cp.returncode == 2 and msg in cp.stderr, cp.stderr


def test_worker_spec_parsing():
    from launcher.specs import parse_worker_spec

    s = parse_worker_spec("model=m,gpus=0,1,2,3,count=2,args=--x a,b --y 'c d',weight=0.5")
    assert s.model == "m" and s.gpus == "0,1,2,3" and s.count == 2 and s.weight == 0.5
    assert s.engine_args == ("--x", "a,b", "--y", "c d")


def test_one_set_of_keys_for_a_worker_spec_in_the_flag_and_the_file(tmp_path):
    """Issue 32: the README said the file's ``workers:`` take "the same keys" as ``--worker``; the
    flag's ``args``/``url`` and the file's ``engine_args``/``engine_url`` are now both accepted in both."""
    from launcher.config import LaunchWorker
    from launcher.specs import parse_worker_spec

    assert parse_worker_spec("model=m,engine_args=--x 1").engine_args == ("--x", "1")
    assert parse_worker_spec("engine=openai,engine_url=http://127.0.0.1:8000").engine_url == "http://127.0.0.1:8000"
    assert LaunchWorker.model_validate({"model": "m", "args": "--x 1 --y 'a b'"}).engine_args == ["--x", "1", "--y", "a b"]
    assert LaunchWorker.model_validate({"url": "http://127.0.0.1:8000", "engine": "openai"}).engine_url.endswith(":8000")
    with pytest.raises(ValueError, match="not both"):
        LaunchWorker.model_validate({"args": "--x", "engine_args": ["--y"]})
    cfg = tmp_path / "dplb.yaml"
    cfg.write_text("workers:\n  - {model: beta, engine: sim, args: '--max-num-seqs 8'}\n")
    b = plan("--config", str(cfg))["workers"][0]["argv"]
    assert b[b.index("--") + 1:][-2:] == ["--max-num-seqs", "8"]


def test_metrics_port_reaches_the_router_and_is_checked():
    """``--metrics-port``: the router serves ``/metrics`` on a port of its own too (router/metrics_port.py)."""
    r = plan("-n", "1", "--metrics-port", "29017")["router"]["argv"]
    assert r[r.index("--metrics-port") + 1] == "29017"
    assert "--metrics-port" not in plan("-n", "1")["router"]["argv"]
    cp = launch("-n", "1", "--port", "30111", "--metrics-port", "30111", "--dry-run")
    assert cp.returncode == 2 and "metrics.port 30111 is router.port" in cp.stderr


def test_the_workers_section_is_the_launchers(tmp_path):
    """Issue 28: ``LaunchWorker`` lives in launcher/; the launcher validates ``workers:`` (errors
    name the field, engines from the engine table), the router reads the same file and leaves the
    section alone."""
    from launcher.config import LaunchConfig
    from router.config import config_from_json, load_config
    from router.errors import ConfigError

    p = tmp_path / "dplb.yaml"
    p.write_text("workers:\n  - {model: m, engine: tgi}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p, model=LaunchConfig)
    assert ei.value.field == "workers.0.engine" and "sim, vllm, sglang, openai" in str(ei.value)
    rcfg = load_config(p)                     # the router: the section is not its to judge
    assert rcfg.workers == [{"model": "m", "engine": "tgi"}]
    assert config_from_json(rcfg.model_dump_json()) == rcfg
    p.write_text("workers:\n  - {model: m, engine: sglang, gpus: [0, 1], args: '--x 1'}\n")
    w = load_config(p, model=LaunchConfig).workers[0]
    assert (w.engine, w.gpus, w.engine_args) == ("sglang", "0,1", ["--x", "1"])
