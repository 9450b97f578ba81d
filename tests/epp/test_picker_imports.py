"""The picker is request control's second edge, not a borrower of the first: the modules it is made
of (:mod:`epp.picker`, :mod:`epp.stream`, and everything of DPLB's they import, at top level, inside
functions or for type checking) never reach the HTTP edge (:mod:`router.proxy`, its relay, the
router's uvicorn protocol, the ASGI assembly), and none of them loads uvicorn, FastAPI or Starlette
when imported (a module-level import; a helper that imports uvicorn inside a function only the
HTTP router calls, such as :func:`router.logtext.uvicorn_log_config`, loads nothing into the
picker); what both edges share is :mod:`router.director`. Read from the source, as
tests/router/test_import_graph.py reads the router's graph."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT
from tests.router.test_import_graph import imports_of, module_name

#: DPLB's packages a picker module may reach
PACKAGES = ("epp", "router", "dplb_shm", "dplb_prefix", "dplb_protocol", "worker_agent")
#: the HTTP edge's modules
HTTP_EDGE = {"router.proxy", "router.relay", "router.server", "router.app", "router.control", "router.admin",
             "router.asgi", "router.__main__"}
#: third-party packages of the HTTP edge
WEB = {"uvicorn", "fastapi", "starlette"}


def _files() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES if (ROOT / pkg).is_dir() for p in (ROOT / pkg).rglob("*.py")}


def _external(path: Path) -> set[str]:
    """The top-level names of the packages ``path`` imports outside functions (absolute imports;
    ``if`` blocks and class bodies included: what importing the module loads)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def closure(start: str) -> set[str]:
    """``start`` and the DPLB modules it reaches through imports of any kind."""
    files = _files()
    known = set(files)
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        todo += sorted(imports_of(files[m], m, known) - seen)
    return seen


def test_the_picker_and_its_stream_never_reach_the_http_edge():
    files = _files()
    for start in ("epp.picker", "epp.stream"):
        reach = closure(start)
        assert "router.director" in reach, start
        assert sorted(reach & HTTP_EDGE) == [], start
        web = {m: sorted(_external(files[m]) & WEB) for m in reach if _external(files[m]) & WEB}
        assert web == {}, start


def test_the_check_sees_the_http_edge_where_it_is():
    # the walk above can find the edge: the HTTP assembly reaches the proxy and uvicorn
    reach = closure("router.app")
    assert {"router.proxy", "router.server"} <= reach
    assert any(_external(_files()[m]) & WEB for m in reach)
