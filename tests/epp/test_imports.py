"""The endpoint picker holds the router's state without the HTTP router's web framework: importing
:mod:`epp.server` (and through it :mod:`router.state`, the scheduler, request control) loads
neither FastAPI nor Starlette; nor, for the picker and its stream, the HTTP proxy or uvicorn
(a fresh interpreter's ``sys.modules``; tests/epp/test_picker_imports.py reads the same from the source)."""
from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

WEB = ("fastapi", "starlette")


def loaded_after(module: str, roots: tuple[str, ...] = WEB) -> list[str]:
    """The modules of ``roots`` (or under them) loaded by a fresh interpreter that imports ``module``."""
    code = (f"import sys, {module}\n"
            f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    return out.stdout.split()


def test_the_picker_does_not_import_the_web_framework():
    assert loaded_after("epp.server") == []
    assert loaded_after("router.state") == []


def test_the_picker_does_not_import_the_http_edge():
    # request control (router.director) is shared; the HTTP proxy and uvicorn are the router's own
    for module in ("epp.picker", "epp.stream"):
        loaded = loaded_after(module, ("uvicorn", "router"))
        assert [m for m in loaded if m.split(".")[0] == "uvicorn" or m in ("router.proxy", "router.relay",
                                                                         "router.server", "router.app")] == []
        assert "router.director" in loaded


def test_the_router_assembly_still_does():
    # the check above can see FastAPI: the HTTP router's assembly loads it
    assert "fastapi" in loaded_after("router.app")
