"""bench.replay against a small fake OpenAI server: measurements, worker shares, errors, JSON report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.errors import ReplayError
from bench.replay import RequestResult, normalize_base_url, summarize
from tests.helpers import ROOT, free_port, wait_for_port


@pytest.fixture
def fake_url(procs, tmp_path):
    port = free_port()
    procs.start([sys.executable, "-m", "tests.e2e.fake_openai", "--port", str(port)], log=tmp_path / "fake.log",
                cwd=ROOT)
    wait_for_port(port, timeout=60)
    return f"http://127.0.0.1:{port}"


def _trace(tmp_path, out_lens):
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 600, "output_length": n,
                                     "hash_ids": [0, 100 + i]}) + "\n" for i, n in enumerate(out_lens)))
    return p


def _run(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bench.replay", *args], capture_output=True, check=False, text=True,
                          cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("stream", ["sse", "typed", "no"])
def test_replay_reports_every_request_and_worker_share(fake_url, tmp_path, api, stream):
    trace = _trace(tmp_path, [5, 7, 9, 4, 6, 8])
    out = tmp_path / "r.json"
    flags = {"sse": [], "typed": ["--typed-chunks"], "no": ["--no-stream"]}[stream]
    cp = _run([str(trace), "--url", fake_url, "--api", api, "--time-scale", "0.5", "--json-out", str(out),
               "--per-request", "--quiet"] + flags)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    rep = json.loads(out.read_text())
    assert rep["requests"] == 6 and rep["completed"] == 6 and rep["errors"] == 0
    assert rep["model"] == "fake-model"
    assert rep["output_tokens_total"] == 5 + 7 + 9 + 4 + 6 + 8
    assert {w: d["requests"] for w, d in rep["workers"].items()} == {"0": 2, "1": 2, "2": 2}
    assert rep["e2e_ms"]["p50"] > 0
    if stream != "no":
        assert rep["ttft_ms"]["p50"] > 0 and rep["ttft_ms"]["p99"] <= rep["e2e_ms"]["max"]
    else:
        assert rep["ttft_ms"]["p50"] is None
    assert [r["scheduled_s"] for r in rep["results"]] == pytest.approx([0.005 * i for i in range(6)])
    assert "TTFT ms" in cp.stdout and "worker" in cp.stdout


def test_replay_counts_errors_and_exits_1(fake_url, tmp_path):
    trace = _trace(tmp_path, [5, 13, 6])
    out = tmp_path / "r.json"
    cp = _run([str(trace), "--url", fake_url, "--json-out", str(out), "--time-scale", "0", "--quiet"])
    assert cp.returncode == 1
    rep = json.loads(out.read_text())
    assert rep["completed"] == 2 and rep["errors"] == 1
    assert rep["error_types"] == {"HTTP 503": 1}
    assert "no worker" in rep["first_errors"][0]


def test_limit_and_max_tokens_cap(fake_url, tmp_path):
    trace = _trace(tmp_path, [50, 60, 70, 80])
    out = tmp_path / "r.json"
    cp = _run([str(trace), "--url", fake_url + "/v1", "--limit", "3", "--max-tokens-cap", "10",
               "--time-scale", "0", "--json-out", str(out), "--quiet"])
    assert cp.returncode == 0, cp.stderr
    rep = json.loads(out.read_text())
    assert rep["requests"] == 3 and rep["output_tokens_total"] == 30


def test_unreachable_endpoint_exits_2_with_message(tmp_path):
    trace = _trace(tmp_path, [5])
    cp = _run([str(trace), "--url", f"http://127.0.0.1:{free_port()}", "--quiet"])
    assert cp.returncode == 2 and "cannot list models" in cp.stderr


def test_bad_trace_exits_2(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("{oops\n")
    cp = _run([str(p), "--quiet"])
    assert cp.returncode == 2 and "bad.jsonl:1" in cp.stderr


def test_normalize_base_url():
    assert normalize_base_url("http://127.0.0.1:30000") == "http://127.0.0.1:30000/v1"
    assert normalize_base_url("http://127.0.0.1:30000/v1/") == "http://127.0.0.1:30000/v1"
    with pytest.raises(ReplayError):
        normalize_base_url("127.0.0.1:30000")


def test_summarize_percentiles_and_tpot():
    rs = [RequestResult(index=i, ok=True, input_tokens=10, max_tokens=11, output_tokens=11, worker_id=str(i % 2),
                        ttft_s=0.1 * (i + 1), e2e_s=0.1 * (i + 1) + 1.0) for i in range(10)]
    rs.append(RequestResult(index=10, ok=False, input_tokens=10, max_tokens=5, worker_id=None, error="HTTP 503: x"))
    s = summarize(rs, wall_s=2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(550.0)
    assert s["ttft_ms"]["max"] == pytest.approx(1000.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(100.0)  # (e2e - ttft) / (11 - 1) = 1 s / 10
    assert s["output_tokens_total"] == 110 and s["output_tokens_per_s"] == 55.0
    assert s["workers"]["0"] == {"requests": 5, "share": round(5 / 11, 4), "errors": 0}
    assert s["workers"]["?"]["errors"] == 1


def test_counts_text_chunks_when_server_sends_no_usage(fake_url, tmp_path):
    trace = _trace(tmp_path, [5, 7])
    out = tmp_path / "r.json"
    cp = _run([str(trace), "--url", fake_url, "--no-usage", "--time-scale", "0", "--json-out", str(out), "--quiet"])
    assert cp.returncode == 0, cp.stderr
    assert json.loads(out.read_text())["output_tokens_total"] == 12


def test_error_event_inside_a_stream_counts_as_error(fake_url, tmp_path):
    trace = _trace(tmp_path, [6, 17])  # the fake server ends a 17-token stream with an error event
    out = tmp_path / "r.json"
    cp = _run([str(trace), "--url", fake_url, "--time-scale", "0", "--json-out", str(out), "--quiet"])
    assert cp.returncode == 1
    rep = json.loads(out.read_text())
    assert rep["errors"] == 1 and rep["error_types"] == {"StreamError": 1} and "engine died" in rep["first_errors"][0]
