"""epp/ under the router's house rules (tests/router/test_import_graph.py): no module over 600
lines, no function over 80, and no explicit ``Any`` but the justified ones, each marked
``# Any: <why>`` on the line above its ``type: ignore[explicit-any]`` and counted here (mypy's
``disallow_any_explicit`` for ``epp.*`` in setup.cfg finds any other)."""
from __future__ import annotations

import ast

from tests.helpers import ROOT
from tests.router.test_import_graph import MAX_FUNCTION_LINES, MAX_MODULE_LINES

#: the justified explicit Any of epp/: the Kubernetes objects as the API server's JSON gives them
#: (epp/kube.py, one alias)
JUSTIFIED_ANY = {"epp/kube.py": 1}


def test_no_epp_module_or_function_is_too_long():
    too_long = []
    for p in sorted((ROOT / "epp").rglob("*.py")):
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


def _comment_above(lines: list[str], i: int) -> str:
    """The comment block (consecutive ``#`` lines) right above line ``i``, joined."""
    block: list[str] = []
    j = i - 1
    while j >= 0 and lines[j].strip().startswith("#"):
        block.insert(0, lines[j].strip())
        j -= 1
    return " ".join(block)


def test_every_explicit_any_in_epp_is_marked_and_counted():
    found: dict[str, int] = {}
    unmarked = []
    for p in sorted((ROOT / "epp").rglob("*.py")):
        lines = p.read_text().splitlines()
        rel = str(p.relative_to(ROOT))
        for i, line in enumerate(lines):
            if "type: ignore[explicit-any]" in line:
                found[rel] = found.get(rel, 0) + 1
                if not _comment_above(lines, i).startswith("# Any: "):
                    unmarked.append(f"{rel}:{i + 1}")
    assert unmarked == []
    assert found == JUSTIFIED_ANY
