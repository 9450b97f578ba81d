"""The repository stands on its own: nothing it ships reads from beside the checkout (issue 11)."""
from __future__ import annotations

import subprocess

import pytest

from dplb_trace.mooncake import DEFAULT_TRACE, load_trace
from tests.helpers import ROOT

# built from parts so that this file does not match itself
NEEDLE = ".." + "/" + "shared"


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (an sdist or installed tree): nothing to scan")
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_file_points_outside_the_repository():
    offenders = []
    for rel in _tracked_files():
        path = ROOT / rel
        if not path.is_file() or path.suffix in {".png", ".jsonl", ".so"}:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            if NEEDLE in line:
                offenders.append(f"{rel}:{lineno}: {line.strip()[:100]}")
    assert not offenders, "files that read from outside the repository:\n" + "\n".join(offenders)


def test_default_trace_lives_in_the_repository_and_is_whole():
    assert DEFAULT_TRACE.is_file()
    assert ROOT in DEFAULT_TRACE.resolve().parents
    assert (DEFAULT_TRACE.parent / "README.md").is_file()
    reqs = load_trace()
    # the published trace: 12,031 requests over 3,537 s, block 0 opening every prompt
    assert len(reqs) == 12031
    assert round(reqs[-1].timestamp_ms / 1000) == 3537
    assert all(r.hash_ids[0] == 0 for r in reqs)


def test_trace_is_tracked_by_git():
    assert "dplb_trace/data/mooncake/conversation_trace.jsonl" in _tracked_files()


def _imports(path) -> set[str]:
    import ast

    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.add(node.module)
    return mods


@pytest.mark.parametrize("package", ["bench", "launcher", "router", "worker_agent", "sim_engine", "dplb_shm", "dplb_prefix", "epp"])
def test_installed_packages_never_import_the_tests(package):
    # an installed DPLB has no tests/: bench.faults and bench.soak could not even import before
    offenders = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / package).rglob("*.py"))
                 for m in _imports(p) if m == "tests" or m.startswith("tests.")]
    assert not offenders, "\n".join(offenders)
