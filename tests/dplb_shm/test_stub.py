"""The type stub ``dplb_shm/_native.pyi`` names everything the built extension exposes (issue 11)."""
from __future__ import annotations

import ast
import inspect
import types
from pathlib import Path

import dplb_shm._native as native

STUB = Path(native.__file__).with_name("_native.pyi")


def _stub_names() -> tuple[set[str], dict[str, dict[str, ast.AST]]]:
    tree = ast.parse(STUB.read_text())
    top: set[str] = set()
    classes: dict[str, dict[str, ast.AST]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            top.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.ClassDef):
            top.add(node.name)
            classes[node.name] = {b.name if isinstance(b, ast.FunctionDef) else b.target.id: b  # type: ignore[union-attr]
                                  for b in node.body if isinstance(b, ast.FunctionDef | ast.AnnAssign)}
    return top, classes


def test_every_public_name_of_the_extension_is_in_the_stub():
    top, classes = _stub_names()
    missing = []
    for name in dir(native):
        obj = getattr(native, name)
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        if name not in top:
            missing.append(name)
        elif inspect.isclass(obj) and obj.__module__ == native.__name__:
            missing += [f"{name}.{m}" for m in dir(obj) if not m.startswith("_") and m not in classes[name]]
    assert not missing, f"{STUB.name} lacks: {', '.join(missing)}"


def test_stub_keyword_parameters_exist_at_run_time():
    # Cython methods keep their signatures (binding): every keyword the stub promises is accepted
    _, classes = _stub_names()
    wrong = []
    for cname, members in classes.items():
        cls = getattr(native, cname)
        for mname, node in members.items():
            if not isinstance(node, ast.FunctionDef) or any(
                    isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list):
                continue
            try:
                sig = inspect.signature(getattr(cls, mname))
            except (TypeError, ValueError):
                continue  # no signature to compare against
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
                continue
            stub_params = [a.arg for a in node.args.args + node.args.kwonlyargs if a.arg != "self"]
            wrong += [f"{cname}.{mname}({p})" for p in stub_params if p not in sig.parameters]
    assert not wrong, "stub parameters the extension does not take: " + ", ".join(wrong)
