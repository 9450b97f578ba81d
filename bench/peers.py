"""The field's routers, each installed in its own virtualenv under ``bench/.peers/`` (git-ignored).

Peers (facts from ``docs/peers-and-engines.md``, checked on this kind of machine):

- ``sglang``: ``pip install sglang-router`` (Rust, about 150 MB), started with
  ``python -m sglang_router.launch_router``; log levels ``debug|info|warn|error``.
- ``vllm``: ``pip install vllm-router`` (Rust fork of SGLang's, about 130 MB), started with
  ``python -m vllm_router.launch_router``; log levels ``debug|info|warning|error|critical``; it
  waits at start until every worker answers ``GET /health``.
- ``smg``: ``pip install smg`` (SGLang's new gateway, "Shepherd Model Gateway"; Rust, one abi3
  wheel; the venv is about 155 MB, 102 MB of it the extension), started with
  ``python -m smg.launch_router`` (the console script spells it ``smg launch``); the same main
  flags as ``sglang``, log levels ``debug|info|warn|error``. It takes the sim engines for vLLM
  (``GET /version`` answers) and polls every worker's load from ``GET /metrics`` (vLLM gauges)
  every 10 s, whatever the policy. On SIGTERM it keeps its listener open for
  min(grace / 2, 5 s) before draining (grace: ``--shutdown-grace-period-secs``, default 180), so
  it gets ``--shutdown-grace-period-secs 2`` and exits within the harness's 3 s stop grace.

All are pointed at the engines directly (that is how they are deployed), bound to loopback with
``--host 127.0.0.1 --prometheus-host 127.0.0.1`` (smg's defaults for both are ``0.0.0.0``), and run
at warn level: their default per-request info logging costs them about 20 % throughput on this
machine.

Installation happens on first use (:func:`ensure_peer`) with pip from the configured index; a
failed install raises :class:`bench.errors.PeerInstallError` naming pip's log.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.errors import PeerInstallError

PEERS_DIR = Path(__file__).resolve().parent / ".peers"


@dataclass(frozen=True)
class PeerSpec:
    """How to install and start one peer router.

    ``package``/``version``: the PyPI distribution pinned for repeatable runs; ``module``: the
    launcher module (run as ``python -m module``); ``warn_level``: its spelling of the warning log
    level; ``extra``: flags appended after the common ones (:func:`peer_command`), verbatim.
    """

    name: str
    package: str
    version: str
    module: str
    warn_level: str
    extra: tuple[str, ...] = ()


PEERS: dict[str, PeerSpec] = {
    "sglang": PeerSpec("sglang", "sglang-router", "0.3.2", "sglang_router.launch_router", "warn"),
    "vllm": PeerSpec("vllm", "vllm-router", "0.1.17", "vllm_router.launch_router", "warning"),
    # SIGTERM: listener held open min(grace / 2, 5 s), then drained; 2 s keeps its stop under 3 s
    "smg": PeerSpec("smg", "smg", "1.13.0", "smg.launch_router", "warn",
                    extra=("--shutdown-grace-period-secs", "2")),
}


def peer_python(name: str, root: Path = PEERS_DIR) -> Path:
    """Path of the interpreter of peer ``name``'s venv (it may not exist yet)."""
    return root / name / "bin" / "python"


def _importable(py: Path, module: str) -> bool:
    if not py.exists():
        return False
    r = subprocess.run([str(py), "-c", f"import importlib.util,sys; sys.exit(importlib.util.find_spec('{module}') is None)"],
                       check=False, capture_output=True, timeout=120)
    return r.returncode == 0


def ensure_peer(name: str, root: Path = PEERS_DIR, timeout_s: float = 900.0) -> Path:
    """Make sure peer ``name`` is installed in ``root/<name>``; return its interpreter path.

    Creates the venv with the running interpreter's ``venv`` module and pip-installs the pinned
    package when the launcher module is not importable there. Raises :class:`PeerInstallError`
    (unknown peer, venv creation or pip failure, timeout).
    """
    if name not in PEERS:
        raise PeerInstallError(name, "-", f"unknown peer {name!r}; known: {sorted(PEERS)}")
    spec = PEERS[name]
    py = peer_python(name, root)
    top_module = spec.module.split(".")[0]
    if _importable(py, top_module):
        return py
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"{name}.install.log"
    venv_dir = root / name
    try:
        with open(log, "ab") as out:
            if not py.exists():
                base = getattr(sys, "_base_executable", sys.executable)
                subprocess.run([base, "-m", "venv", str(venv_dir)], stdout=out, stderr=subprocess.STDOUT,
                               check=True, timeout=300)
            subprocess.run([str(py), "-m", "pip", "install", "-q", f"{spec.package}=={spec.version}"],
                           stdout=out, stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        raise PeerInstallError(name, str(log), str(e)) from e
    if not _importable(py, top_module):
        raise PeerInstallError(name, str(log), f"{spec.module} still not importable after install")
    return py


def peer_version(name: str, root: Path = PEERS_DIR) -> str:
    """Installed version of peer ``name``'s package, or ``"not installed"``."""
    py = peer_python(name, root)
    if not py.exists():
        return "not installed"
    r = subprocess.run([str(py), "-c", f"import importlib.metadata as m; print(m.version('{PEERS[name].package}'))"],
                       check=False, capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or "unknown"


def peer_command(name: str, policy: str, port: int, prometheus_port: int, worker_urls: list[str],
                 root: Path = PEERS_DIR) -> list[str]:
    """Command line that starts peer ``name`` with ``policy`` in front of ``worker_urls``.

    Loopback only (``--host``/``--prometheus-host 127.0.0.1``), warn-level logging, then the
    peer's own :attr:`PeerSpec.extra` flags. Raises ``KeyError`` for an unknown peer.
    """
    spec = PEERS[name]
    return [str(peer_python(name, root)), "-m", spec.module,
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls,
            "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--log-level", spec.warn_level,
            *spec.extra]
