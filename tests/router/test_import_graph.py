"""The product's modules import each other without a circle (a typed spine whose graph stays
without circles), counting imports inside functions too; and the wire module is the bottom of the
request path's graph."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

#: every product package (tests/test_architecture.py layers them)
PACKAGES = ("dplb_prefix", "dplb_shm", "dplb_trace", "dplb_protocol", "sim_engine", "worker_agent", "router", "epp",
            "launcher", "bench", "simulate")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path, mod: str, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere (top level or inside functions)."""
    tree = ast.parse(path.read_text())
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for n in names:
            # the deepest known module named (``from router.x import y`` is router.x, or router.x.y)
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != mod:
                out.add(n)
    return out


def graph() -> dict[str, set[str]]:
    # not what lives in hidden folders: git-ignored installs (bench/.peers/<peer>: the peers' venvs)
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
             if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)}
    known = set(files)
    g = {m: imports_of(p, m, known) for m, p in files.items()}
    # a package's __init__ importing its own submodules is how packages re-export; not an edge back
    for m, deps in g.items():
        g[m] = {d for d in deps if not (d.startswith(m + ".") and ROOT.joinpath(*m.split("."), "__init__.py").exists())}
    return g


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for d in sorted(g.get(n, ())):
            if color.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if color.get(d) is None:
                c = visit(d)
                if c:
                    return c
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(g):
        if n not in color:
            c = visit(n)
            if c:
                return c
    return None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_protocol_is_the_bottom_and_the_proxy_has_typed_collaborators():
    g = graph()
    # the wire imports nothing of DPLB's but the native word count beneath it
    assert {d for d in g["dplb_protocol.wire"] if d.startswith(PACKAGES)} == {"dplb_prefix"}
    assert {"router.scheduling", "router.transport", "router.metrics", "dplb_protocol.wire"} <= g["router.proxy"]
    assert "router.app" not in g["router.proxy"]         # the proxy no longer takes the whole router state
    import inspect

    from router.proxy import Proxy

    ann = inspect.signature(Proxy.__init__).parameters
    assert [ann[k].annotation for k in ("scheduler", "transport", "metrics", "settings")] == [
        "Scheduler", "Transport", "Metrics", "ProxySettings"]


#: issue 28: the router's rooms and functions stay small enough to read
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_no_router_module_or_function_is_too_long():
    too_long = []
    for p in sorted((ROOT / "router").rglob("*.py")):
        text = p.read_text()
        rel = p.relative_to(ROOT)
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert too_long == []


def test_request_control_sits_below_both_edges():
    # router.director: one request-control room that the HTTP edge (router.proxy) and the picker
    # (epp, through router.state) call; it knows neither edge, and the state holds no HTTP edge
    g = graph()
    assert "router.director" in g["router.proxy"] and "router.director" in g["router.state"]
    assert not {"router.proxy", "router.relay", "router.server", "router.app"} & g["router.director"]
    assert not {"router.proxy", "router.relay", "router.server"} & g["router.state"]


def test_the_router_state_sits_below_its_control_api_and_above_the_metrics():
    g = graph()
    assert "router.app" not in g["router.state"] and "router.control" not in g["router.state"]
    assert "router.admin" not in g["router.state"]       # the store only (router.admin_store)
    assert "router.state" not in g["router.metrics"]     # typed collaborators, no read of the state from below
