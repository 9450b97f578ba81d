"""``bench.router_inproc`` drives the real protocol and app: every request is answered (one
client write each, the router's one-write answer), the profile counts calls, no segment is left."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.timeout(120)
def test_router_inproc_answers_every_request_in_one_write_and_cleans_up():
    before = {f for f in os.listdir("/dev/shm") if f.startswith("dplb-bench-")}
    out = subprocess.run([sys.executable, "-m", "bench.router_inproc", "--requests", "300", "--profile", "--top", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"([\d.]+) µs per tiny request, ([\d.]+) client writes per request", out.stdout)
    assert m and float(m.group(1)) > 0 and m.group(2) == "1.00", out.stdout
    calls = re.search(r"Python function calls per request: ([\d.]+)", out.stdout)
    assert calls and 50 < float(calls.group(1)) < 1000, out.stdout
    # none left of its own (another bench running beside may add or remove its own meanwhile)
    assert {f for f in os.listdir("/dev/shm") if f.startswith("dplb-bench-")} - before == set()
