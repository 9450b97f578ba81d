"""A missing or stale native extension is a clear ImportError, never a silent Python fallback; it
is raised at the first use of a native name (``dplb_shm.Segment``), while the pure-Python types
(``WorkerState``, ``WorkerSnapshot``) import without a build (issue 28: the router imports them at
module top)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT


def _tree(tmp: Path, with_so: bool) -> Path:
    shutil.copytree(ROOT / "dplb_shm", tmp / "dplb_shm",
                    ignore=shutil.ignore_patterns("__pycache__", *([] if with_so else ["*.so"])))
    (tmp / "csrc").mkdir()
    from dplb_shm._sources import SOURCES

    for f in SOURCES:
        shutil.copy(ROOT / "csrc" / f, tmp / "csrc" / f)
    return tmp


def _import(tmp: Path, use: str = "dplb_shm.Segment") -> subprocess.CompletedProcess:
    # drop the editable-install finder, which would map dplb_shm._native back to the source tree
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            f"import dplb_shm; {use}; print(dplb_shm.__file__)")
    return subprocess.run([sys.executable, "-c", code], cwd=str(tmp), capture_output=True, text=True, timeout=60,
                          check=False)


def test_fresh_build_imports(tmp_path):
    r = _import(_tree(tmp_path, with_so=True))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "dplb_shm" / "__init__.py")


def test_stale_build_refuses_to_import(tmp_path):
    t = _tree(tmp_path, with_so=True)
    with open(t / "csrc" / "dplb_shm.h", "a") as f:
        f.write("/* changed after the build */\n")
    r = _import(t)
    assert r.returncode != 0
    assert "NativeBuildError" in r.stderr and "stale" in r.stderr and "make build" in r.stderr


def test_missing_build_refuses_to_import(tmp_path):
    r = _import(_tree(tmp_path, with_so=False))
    assert r.returncode != 0
    assert "NativeBuildError" in r.stderr and "not built" in r.stderr and "make build" in r.stderr


def test_the_types_import_without_a_build(tmp_path):
    t = _tree(tmp_path, with_so=False)
    r = _import(t, "from dplb_shm import WorkerSnapshot, WorkerState, ScoringParams; "
                   "assert 'dplb_shm._native' not in sys.modules")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "dplb_shm" / "__init__.py")
