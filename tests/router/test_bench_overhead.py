"""Smoke test of bench/router_overhead.py (tiny run: it must start, measure, print and clean up)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, shm_leftovers

pytestmark = pytest.mark.slow


def test_router_overhead_bench_prints_figures_and_cleans_up(shm_name):
    r = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--requests", "60", "--rounds", "2",
                        "--seconds", "0.5", "--conns", "2", "--pin", "-1", "--shm", shm_name], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert re.search(r"added by router\s*: p50 -?\d+\.\d{3} ms   p99 -?\d+\.\d{3} ms", r.stdout), r.stdout
    assert re.search(r"[\d,]+ req/s per router core", r.stdout), r.stdout
    assert re.search(r"[\d,]+ SSE chunks relayed per router core per second; \d+\.\d\d client reads per event", r.stdout)
    # the gaps the client saw between a stream's events (what a router holding events back adds to)
    m = re.search(r"inter-token latency at the client .*: p50 (\d+\.\d\d) ms, p90 ([\d.]+) ms, p99 ([\d.]+) ms; "
                  r"\d+% of events arrived in the same read", r.stdout)
    assert m and float(m.group(1)) <= float(m.group(2)) <= float(m.group(3)), r.stdout
    assert shm_leftovers(shm_name) == []


def test_versus_refuses_a_second_peer_or_router_processes():
    r = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--versus", "sglang", "--peer", "vllm"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "--versus runs DPLB's router beside the peer" in r.stderr


def test_versus_measures_both_routers_in_alternating_blocks_and_cleans_up(shm_name):
    """Only where SGLang's router is installed (bench/.peers, ``make bench`` installs it)."""
    from bench.peers import PEERS_DIR, peer_python

    if not peer_python("sglang").exists():
        pytest.skip(f"sglang router not installed in {PEERS_DIR / 'sglang'}")
    r = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--versus", "sglang", "--blocks", "2",
                        "--block-requests", "30", "--rounds", "2", "--seconds", "0.5", "--conns", "2", "--pin", "-1",
                        "--shm", shm_name], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("dplb", "sglang"):
        assert re.search(rf"added p50, {name}\s*: -?\d+ µs median of blocks", r.stdout), r.stdout
        assert re.search(rf"router CPU per request, {name}\s*: \d+ µs median of 2 closed loops", r.stdout), r.stdout
    assert re.search(r"dplb minus sglang, per block: median [+-]\d+ µs; dplb at or below in \d of 2 blocks", r.stdout)
    assert shm_leftovers(shm_name) == []


def test_versus_measures_the_sse_relay_of_each_router_in_rounds(shm_name):
    """``--versus`` with ``--streams``: each router's CPU per SSE event and the inter-token gaps,
    round by round beside the other (no peer needed: the access-log-off variant is the other)."""
    r = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--versus", "no-access-log", "--blocks", "1",
                        "--block-requests", "20", "--rounds", "2", "--seconds", "0.5", "--conns", "2", "--streams", "2",
                        "--chunks", "8", "--pin", "-1", "--shm", shm_name], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("dplb", "no-access-log"):
        m = re.search(rf"SSE relay, {name}\s*: router CPU ([\d.]+) µs per event median of 2 rounds .*inter-token gap "
                      r"p50 ([\d.]+) ms, p99 ([\d.]+) ms", r.stdout)
        assert m and float(m.group(1)) > 0 and float(m.group(2)) <= float(m.group(3)), r.stdout
    assert re.search(r"SSE dplb / no-access-log: CPU per event \d+\.\d\d× \(per round \[[\d.]+–[\d.]+\]\); "
                     r"inter-token gap p99 \d+\.\d\d×", r.stdout), r.stdout
    assert shm_leftovers(shm_name) == []


def test_burst_sends_several_events_per_engine_write(shm_name):
    """``--burst K``: the instant worker writes K events per write (the same event rate), so the
    client reads the router's relay in about one read per K events (a router relaying one write
    per read: at most one read per engine write, plus the head and the end)."""
    r = subprocess.run([sys.executable, "-m", "bench.router_overhead", "--skip-latency", "--rounds", "1", "--seconds",
                        "1", "--conns", "1", "--streams", "2", "--chunks", "8", "--burst", "4", "--pin", "-1",
                        "--shm", shm_name], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"SSE relay, 2 streams, one event per 2 ms \(4 per engine write\): .* (\d+\.\d\d) client reads per "
                  r"event", r.stdout)
    # 8 events in 2 writes of 4, then [DONE]: 3 engine writes per stream, so at most 3 client reads
    # (fewer when reads merge); one per event would be 1.00
    assert m and 0 < float(m.group(1)) <= 3 / 8 + 0.01, r.stdout
    assert shm_leftovers(shm_name) == []
