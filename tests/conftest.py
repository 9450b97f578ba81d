"""Fixtures shared by every test package: child processes and segments that are always cleaned up."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import Procs, unique_shm_name


@pytest.fixture
def procs():
    """A :class:`tests.helpers.Procs`; every process started through it is killed at teardown."""
    p = Procs()
    try:
        yield p
    finally:
        pids = [c.pid for c in p.children]
        p.close()
        # a dplb-epp started without --shm makes its own segment dplb-epp-<pid>-<hex> and unlinks it
        # when it stops; one killed (SIGKILL by a test, or at the end of the grace) cannot
        for pid in pids:
            for leftover in Path("/dev/shm").glob(f"dplb-epp-{pid}-*"):
                leftover.unlink(missing_ok=True)


@pytest.fixture
def shm_name():
    """A unique segment name; whatever segment of that name exists at teardown is unlinked."""
    name = unique_shm_name()
    try:
        yield name
    finally:
        path = f"/dev/shm/{name}"
        if os.path.exists(path):
            os.unlink(path)


@pytest.fixture
def segment(shm_name):
    """A fresh 16-slot segment, closed and unlinked at teardown even when the test fails."""
    from dplb_shm import Segment

    seg = Segment.create(shm_name, num_slots=16)
    try:
        yield seg
    finally:
        try:
            seg.close()
        finally:
            if os.path.exists(f"/dev/shm/{shm_name}"):
                os.unlink(f"/dev/shm/{shm_name}")


@pytest.fixture
def run_dir(tmp_path_factory):
    """A short private directory for Unix sockets (paths must stay under 108 bytes)."""
    import tempfile

    d = tempfile.mkdtemp(prefix="dplb-t-", dir="/tmp")
    os.chmod(d, 0o700)
    try:
        yield d
    finally:
        import shutil
        shutil.rmtree(d, ignore_errors=True)
