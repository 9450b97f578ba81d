"""A gateway stack for the fault tests (issue 30): simulated engines on loopback TCP (no agents),
listed in an endpoints file, ``dplb-epp --shm <the test's segment> --envoy-eds`` scraping them,
and one real Envoy on the pool cluster (``override_host`` + retries, :mod:`epp.envoy`). The
picker can be killed and started again on the same ports; :func:`load` sends a bounded number of
concurrent non-streamed chat requests and records each answer.

Everything started goes through the caller's :class:`tests.helpers.Procs` (killed at teardown);
every wait is bounded."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from epp.envoy import EnvoySettings, bootstrap_yaml, envoy_argv
from launcher.stack import wait_for
from tests.helpers import ROOT, Procs, free_port, script, wait_for_port

STARTUP_S = 90.0
MODEL = "sim-model"


@dataclass
class Answer:
    """One request's outcome: ``status`` (None: no answer: a transport error or the client's
    timeout, ``detail`` says which), the ``x-dplb-worker-id`` header, when it was sent and ended
    (``time.monotonic()``), and the body (a 200's first 300 characters, an error's whole)."""

    status: int | None
    worker: str | None
    t_sent: float
    t_end: float
    detail: str = ""


@dataclass
class FaultStack:
    """The started stack (module docstring)."""

    procs: Procs
    run_dir: str
    shm: str
    seg: Any
    engines: list[Any]
    endpoints: list[str]
    url: str
    admin: str
    epp_ports: tuple[int, int, int]
    fail_open: bool
    epp: Any = None
    epp_argv: list[str] = field(default_factory=list)

    def start_epp(self) -> Any:
        """Start the picker (same ports each time) and wait until its gRPC port listens."""
        self.epp = self.procs.start(self.epp_argv, log=os.path.join(self.run_dir, "epp.log"), cwd=str(ROOT))
        wait_for_port(self.epp_ports[0], timeout=STARTUP_S)
        return self.epp

    def ready_slots(self) -> set[str]:
        """Endpoints whose slot is READY."""
        return {s.endpoint for s in self.seg.snapshot() if int(s.state) == 2}

    def idle(self) -> bool:
        """Every live slot's router line back to zero (in flight, outstanding prefill, decoding)."""
        for s in self.seg.snapshot():
            if int(s.state) == 0:
                continue
            line = self.seg.router_line(s.worker_id)
            if line["router_inflight"] or line["prefill_tokens"] or line["decode_reqs"] or line["decode_ctx_tokens"]:
                return False
        return True

    def lines(self) -> dict[str, dict[str, Any]]:
        """The router line of every live slot, by endpoint (assertion messages)."""
        return {s.endpoint: self.seg.router_line(s.worker_id) for s in self.seg.snapshot() if int(s.state) != 0}

    def envoy_stat(self, name: str) -> int:
        """A counter from Envoy's admin ``/stats`` (0 when absent)."""
        for line in httpx.get(f"{self.admin}/stats?filter={name}", timeout=5).text.splitlines():
            k, _, v = line.partition(": ")
            if k == name:
                return int(v)
        return 0

    def logs(self) -> str:
        """The last lines of every log (assertion messages)."""
        out = []
        for p in sorted(Path(self.run_dir).glob("*.log")):
            out.append(f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(out)


def start_stack(procs: Procs, run_dir: str, shm: str, seg: Any, engines: int = 3, fail_open: bool = False,
                engine_args: tuple[str, ...] = (), epp_args: tuple[str, ...] = ()) -> FaultStack:
    """Start ``engines`` simulated engines, the picker and Envoy (module docstring); returns when
    Envoy is LIVE and every engine's slot is READY."""
    ports = [free_port() for _ in range(engines)]
    kids = [procs.start([sys.executable, "-m", "sim_engine", "--port", str(p), "--model", MODEL, *engine_args],
                        log=os.path.join(run_dir, f"engine-{i}.log"), cwd=str(ROOT)) for i, p in enumerate(ports)]
    for p in ports:
        wait_for_port(p, timeout=STARTUP_S)
    endpoints = [f"127.0.0.1:{p}" for p in ports]
    eps = Path(run_dir) / "endpoints.yaml"
    eps.write_text("".join(f"- {{address: '{e}', model: {MODEL}}}\n" for e in endpoints))
    eds = os.path.join(run_dir, "eds", "pool.json")
    epp_ports = (free_port(), free_port(), free_port())
    argv = [script("dplb-epp"), "--shm", shm, "--endpoints-file", str(eps), "--envoy-eds", eds,
            "--port", str(epp_ports[0]), "--health-port", str(epp_ports[1]), "--metrics-port", str(epp_ports[2]),
            "--state-dir", os.path.join(run_dir, "state"), "--log-level", "info", *epp_args]
    lport, admin = free_port(), free_port()
    st = FaultStack(procs, run_dir, shm, seg, kids, endpoints, f"http://127.0.0.1:{lport}",
                    f"http://127.0.0.1:{admin}", epp_ports, fail_open, epp_argv=argv)
    st.start_epp()
    wait_for(lambda: set(endpoints) <= st.ready_slots() and os.path.exists(eds), STARTUP_S,
             "dplb-epp with every engine READY and the EDS file written", children=[st.epp, *kids])
    cfg = Path(run_dir) / "envoy.yaml"
    cfg.write_text(bootstrap_yaml(EnvoySettings(listen_port=lport, admin_port=admin, epp_port=epp_ports[0],
                                                failure_mode_allow=fail_open, pool_eds=eds,
                                                access_log=os.path.join(run_dir, "access.txt"))))
    envoy = procs.start(envoy_argv(str(cfg)), log=os.path.join(run_dir, "envoy.log"), cwd=str(ROOT))
    wait_for(lambda: httpx.get(f"{st.admin}/ready", timeout=2).text.strip() == "LIVE", STARTUP_S, "Envoy LIVE",
             children=[envoy, st.epp])
    # the pool cluster has read the EDS file: Envoy knows every engine
    wait_for(lambda: st.envoy_stat("cluster.dplb_pool.membership_total") == engines, 30,
             "Envoy's pool cluster with every engine", children=[envoy, st.epp])
    return st


def chat_body(i: int, max_tokens: int = 16) -> dict[str, Any]:
    """A non-streamed chat request, its prompt distinct per ``i``."""
    return {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": f"request {i}: " + " ".join(f"w{(i * 7 + k) % 89}" for k in range(24))}]}


async def _one(client: httpx.AsyncClient, url: str, i: int, timeout: float) -> Answer:
    t0 = time.monotonic()
    try:
        r = await client.post(url + "/v1/chat/completions", json=chat_body(i), timeout=timeout)
        ok = r.status_code != 200 or bool(r.json()["choices"][0]["message"]["content"])
        # an error's whole body (the tests parse it; Envoy's %RESPONSE_CODE_DETAILS% alone can pass
        # 300 characters, CI saw one cut there), a success's first bytes
        return Answer(r.status_code if ok else -1, r.headers.get("x-dplb-worker-id"), t0, time.monotonic(),
                      r.text if r.status_code != 200 else r.text[:300])
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Answer(None, None, t0, time.monotonic(), f"{type(e).__name__}: {e}")


async def load(url: str, total: int, concurrency: int, timeout: float = 60.0, on_progress: Any = None,
               pace_s: float = 0.0, stop: Any = None) -> list[Answer]:
    """Send up to ``total`` requests, ``concurrency`` at a time (each client loops; ``pace_s``
    between its requests), fewer when ``stop()`` turns true; ``on_progress(done, answers)`` (a
    coroutine function) runs after each answer. Returns every answer, in completion order."""
    answers: list[Answer] = []
    it = iter(range(total))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in it:
            if stop is not None and stop():
                return
            answers.append(await _one(client, url, i, timeout))
            if on_progress is not None:
                await on_progress(len(answers), answers)
            if pace_s:
                await asyncio.sleep(pace_s)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return answers


def counts(answers: list[Answer]) -> Counter:
    """Answers by status (None: no answer)."""
    return Counter(a.status for a in answers)
