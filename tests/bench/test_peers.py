"""Peer routers' command lines (bench/peers.py): loopback binds, policy, warn-level logs; no install needed."""
from __future__ import annotations

import subprocess

import pytest

from bench.peers import PEERS, PEERS_DIR, peer_command, peer_python, peer_version
from bench.systems import PEER_POLICIES, SystemSpec, all_systems

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


def _flag(cmd: list[str], name: str) -> str:
    """The value after ``name`` in ``cmd`` (``name`` must occur exactly once)."""
    assert cmd.count(name) == 1, f"{name} occurs {cmd.count(name)} times in {cmd}"
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize("policy", PEER_POLICIES["smg"])
def test_smg_command(tmp_path, policy):
    cmd = peer_command("smg", policy, 1111, 2222, URLS, root=tmp_path)
    assert cmd[:3] == [str(tmp_path / "smg" / "bin" / "python"), "-m", "smg.launch_router"]
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--port") == "1111"
    assert _flag(cmd, "--prometheus-host") == "127.0.0.1" and _flag(cmd, "--prometheus-port") == "2222"
    assert _flag(cmd, "--policy") == policy
    assert _flag(cmd, "--log-level") == "warn"
    i = cmd.index("--worker-urls")
    assert cmd[i + 1:i + 3] == URLS and cmd[i + 3].startswith("--")
    # smg holds its listener open min(grace / 2, 5 s) after SIGTERM: keep its stop under the 3 s grace
    assert float(_flag(cmd, "--shutdown-grace-period-secs")) <= 2
    assert "0.0.0.0" not in cmd and "::" not in cmd


def test_smg_spec_is_pinned():
    spec = PEERS["smg"]
    assert (spec.package, spec.version, spec.module, spec.warn_level) == ("smg", "1.13.0", "smg.launch_router", "warn")


@pytest.mark.parametrize("name", sorted(PEERS))
def test_every_peer_is_loopback_and_quiet(name):
    cmd = peer_command(name, PEER_POLICIES[name][0], 1111, 2222, URLS)
    assert _flag(cmd, "--host") == "127.0.0.1" and _flag(cmd, "--prometheus-host") == "127.0.0.1"
    assert _flag(cmd, "--log-level") == PEERS[name].warn_level
    assert PEERS[name].warn_level in ("warn", "warning")
    assert "0.0.0.0" not in cmd


def test_peer_policies_match_specs():
    assert set(PEER_POLICIES) == set(PEERS)
    labels = {s.label for s in all_systems()}
    assert {"smg/cache_aware", "smg/least_load"} <= labels
    assert SystemSpec("smg", "least_load").label == "smg/least_load"


def test_smg_not_installed_elsewhere(tmp_path):
    assert peer_version("smg", root=tmp_path) == "not installed"
    assert peer_python("smg", root=tmp_path) == tmp_path / "smg" / "bin" / "python"


def test_smg_accepts_the_command_line():
    """smg's own argument parser takes the command line (only where smg is already installed)."""
    py = peer_python("smg")
    if not py.exists():
        pytest.skip(f"smg not installed in {PEERS_DIR / 'smg'}")
    args = peer_command("smg", "least_load", 1111, 2222, URLS)[3:]
    code = ("import sys; from smg.launch_router import parse_router_args; a = parse_router_args(sys.argv[1:]); "
            "print(a.host, a.port, a.prometheus_host, a.prometheus_port, a.policy, a.log_level, "
            "a.shutdown_grace_period_secs, *a.worker_urls)")
    r = subprocess.run([str(py), "-c", code, *args], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["127.0.0.1", "1111", "127.0.0.1", "2222", "least_load", "warn", "2", *URLS]
