"""What an operator runs, for real (issue 16): one launch serving two models on simulated engines
(two workers of ``alpha``, one of ``beta``, per-worker specs), requests for both answered by the
right workers, the router's TTFT against the client's, and a real Prometheus (Debian's
``prometheus``) scraping the router and, through it, every engine with the example config of
deploy/, evaluating every expression of the Grafana dashboard and of the rules through its HTTP
API while traffic runs: each returns data.

Loopback only; one launch for the module, stopped with SIGINT; Prometheus is a child in its own
process group with its data in a temporary directory; everything is killed in teardown even when
a test fails.
"""
from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Self

import httpx
import pytest
import yaml

from tests.deploy.promql import (
    PROM_CONFIG,
    RULES,
    alert_exprs,
    dashboard_exprs,
    recording_exprs,
)
from tests.helpers import Procs, free_port, launched, metric, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPECS = ["model=alpha,engine=sim,count=2", "model=beta,engine=sim"]
WORKERS = {"alpha": {"0", "1"}, "beta": {"2"}}
ENGINE_TIME_SCALE = "2"  # prefills long enough to time, short enough for a test


@pytest.fixture(scope="module")
def launch():
    args = ["--time-scale", ENGINE_TIME_SCALE, "--start-timeout", "240"]
    for s in SPECS:
        args += ["--worker", s]
    with launched(*args, prefix="dplb-op-") as ln:
        yield ln


def chat(base: str, model: str, words: int = 20, stream: bool = False, max_tokens: int = 8,
         client: httpx.Client | None = None, tag: str = "") -> tuple[str, str, float | None]:
    """One chat request (its prompt opens with ``tag``): (worker id, the answer's model, client
    TTFT for a stream)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": tag + " " + " ".join(f"w{i % 97}" for i in range(words))}]}
    c = client or httpx.Client(timeout=120)
    try:
        if not stream:
            r = c.post(base + "/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.headers["x-dplb-worker-id"], r.json()["model"], None
        t0 = time.perf_counter()
        ttft = None
        answered = None
        with c.stream("POST", base + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if ttft is None and '"content":"' in line and '"content":""' not in line:
                    ttft = time.perf_counter() - t0
                if answered is None and '"model":"' in line:
                    answered = line.split('"model":"', 1)[1].split('"', 1)[0]
        return r.headers["x-dplb-worker-id"], answered or "", ttft
    finally:
        if client is None:
            c.close()


def test_two_models_answered_by_their_own_workers(launch):
    base = launch.url.removesuffix("/v1")
    out = launch.out()
    assert "models           alpha, beta" in out and "worker 0-1: engine sim model alpha" in out, out
    assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["alpha", "beta"]
    for m in ("alpha", "beta"):
        r = httpx.get(f"{base}/v1/models/{m}")
        assert r.status_code == 200 and r.json()["id"] == m
    assert httpx.get(base + "/v1/models/gamma").status_code == 404
    served: dict[str, Counter] = {"alpha": Counter(), "beta": Counter()}
    with httpx.Client(timeout=120) as c:
        for i in range(12):
            for m in ("alpha", "beta"):
                wid, answered, _ = chat(base, m, stream=bool(i % 2), client=c, tag=f"q{i}")
                assert answered == m  # the engine itself answered under that name: the right engine
                served[m][wid] += 1
    assert set(served["alpha"]) <= WORKERS["alpha"] and set(served["beta"]) == WORKERS["beta"], served
    assert sum(served["alpha"].values()) == sum(served["beta"].values()) == 12
    r = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    rows = {w["id"]: w["model"] for w in httpx.get(base + "/dplb/status").json()["workers"]}
    assert rows == {0: "alpha", 1: "alpha", 2: "beta"}


def test_router_ttft_agrees_with_the_client(launch):
    """Sequential streamed chats with long prompts (a prefill of ~0.3 s of wall time): the
    router's TTFT histogram (arrival to first content) and the client's agree within 10 % (and
    50 ms a request)."""
    base = launch.url.removesuffix("/v1")

    def hist() -> tuple[float, float]:
        t = httpx.get(base + "/metrics").text
        return (metric(t, "dplb_router_time_to_first_token_seconds_count", route="/v1/chat/completions") or 0.0,
                metric(t, "dplb_router_time_to_first_token_seconds_sum", route="/v1/chat/completions") or 0.0)

    n0, s0 = hist()
    client = []
    with httpx.Client(timeout=120) as c:
        for i in range(6):
            _, _, ttft = chat(base, "beta" if i % 2 else "alpha", words=16000, stream=True, max_tokens=4, client=c,
                              tag=f"long{i}")
            assert ttft is not None
            client.append(ttft)
    n1, s1 = hist()
    assert n1 - n0 == 6
    router, mine = s1 - s0, sum(client)
    assert mine > 6 * 0.15, client  # the prefill was timed, not a role chunk
    # 10 %, plus 50 ms a request for the client's own delays on a busy machine (the upload of a
    # 16,000-word body and the read of the first chunk are outside the router's clock)
    assert abs(router - mine) <= 0.10 * mine + 6 * 0.05, (router, mine, client)


# ------------------------------------------------------------------------ a real Prometheus
def _prometheus_config(d: Path, port: int) -> Path:
    """deploy/prometheus/prometheus.yml aimed at this launch, scraping every second; the rules
    evaluated every second."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    text = yaml.safe_dump(cfg).replace("127.0.0.1:30000", f"127.0.0.1:{port}")
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        g["interval"] = "1s"
    (d / "dplb.rules.yml").write_text(yaml.safe_dump(rules))
    p = d / "prometheus.yml"
    p.write_text(text)
    return p


class Traffic:
    """Streamed and plain chats for both models from a few threads until stopped."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(4)]

    def run(self, i: int) -> None:
        with httpx.Client(timeout=120) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    # long prompts now and then: the routers learn each worker's prefill rate
                    chat(self.base, ("alpha", "beta")[(i + n) % 2], words=1500 if n % 3 == 0 else 40,
                         stream=n % 4 != 0, max_tokens=12, client=c, tag=f"t{i}.{n}")
                    self.done += 1
                except Exception as e:  # noqa: BLE001 - recorded and asserted on
                    self.errors.append(repr(e))

    def __enter__(self) -> Self:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus not installed (Debian package prometheus; .ci/run installs it)")
def test_a_real_prometheus_evaluates_every_dashboard_and_rule_expression(launch, tmp_path):
    base = launch.url.removesuffix("/v1")
    port = free_port()
    cfg = _prometheus_config(tmp_path, launch.port)
    prom = f"http://127.0.0.1:{port}"
    with Procs(grace_s=10) as procs:
        p = procs.start([shutil.which("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                        name="prometheus", log=tmp_path / "prometheus.log")

        def query(expr: str) -> list:
            r = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=30)
            assert r.status_code == 200, (expr, r.text)
            return r.json()["data"]["result"]

        def plog() -> str:
            return (tmp_path / "prometheus.log").read_text(errors="replace")[-3000:]

        wait_until(lambda: p.poll() is not None or httpx.get(prom + "/-/ready", timeout=2).status_code == 200, 60,
                   interval=0.2, what="prometheus ready")
        assert p.poll() is None, plog()
        with Traffic(base) as traffic:
            # the router and, through service discovery, the three engines are scraped
            wait_until(lambda: sorted(float(s["value"][1]) for s in query('up{job="dplb-engines"}')) == [1.0] * 3,
                       60, interval=0.5, what="three engines up via /dplb/prometheus/targets")
            engines = {(s["metric"]["worker"], s["metric"]["model"]) for s in query('up{job="dplb-engines"}')}
            assert engines == {("0", "alpha"), ("1", "alpha"), ("2", "beta")}
            # scraped on its own schedule: on a busy machine its first scrape may come after the engines'
            wait_until(lambda: [s["value"][1] for s in query('up{job="dplb-router"}')] == ["1"], 60, interval=0.5,
                       what="the router up")
            time.sleep(12)  # a dozen scrapes and rule evaluations under traffic
            exprs = dashboard_exprs() + recording_exprs() + alert_exprs()
            exprs += [(f"recorded {name}", name) for name, _ in recording_exprs()]
            empty = []
            for what, expr in exprs:
                if not query(expr):
                    empty.append(f"{what}: {expr}")
        assert not traffic.errors, traffic.errors[:5]
        assert traffic.done > 20
        assert not empty, "expressions without data:\n" + "\n".join(empty) + "\n" + plog()
        # every alert is quiet on this healthy system
        firing = [a for a in httpx.get(prom + "/api/v1/alerts", timeout=30).json()["data"]["alerts"]
                  if a["state"] == "firing"]
        assert not firing, firing
