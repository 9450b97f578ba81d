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
    assert shm_leftovers(shm_name) == []
