"""The house's package layering: the product packages stand in one order, bottom first, and a
package imports only packages below it (counting imports inside functions too), so no two packages
import each other and no arrow runs back up. Below everything, the ground: the native prompt
scanner, the segment, the traces with their statistics, and the wire format with the limits every
process shares. Prototypes that patch the product at run time live outside the installed packages.

The graph, bottom first (an arrow: "imports")::

    dplb_prefix  dplb_shm  dplb_trace  dplb_protocol ─▶ dplb_prefix
    sim_engine                                (a simulated engine: nothing of ours)
    worker_agent ─▶ dplb_shm, dplb_protocol
    router       ─▶ dplb_shm, dplb_protocol, dplb_prefix, worker_agent (engine metrics)
    epp          ─▶ router, dplb_shm, dplb_protocol, ...
    launcher     ─▶ epp, router, worker_agent, ...
    bench        ─▶ launcher, epp, router, sim_engine, dplb_trace, ...
    simulate     ─▶ bench (the live fidelity check only), router, worker_agent, sim_engine, dplb_trace, ...
"""
from __future__ import annotations

import configparser
from pathlib import Path

from tests.helpers import ROOT
from tests.router.test_import_graph import (
    MAX_FUNCTION_LINES,
    MAX_MODULE_LINES,
    PACKAGES,
    graph,
)
from tests.test_repository import _imports

#: the product packages, bottom first: each imports only packages before it in this order
LAYERS = (
    "dplb_prefix",     # native prompt scanning (csrc/dplb_prefix.h)
    "dplb_shm",        # the segment (csrc/dplb_shm.h)
    "dplb_trace",      # traces and their statistics (dplb-replay, dplb-simulate)
    "dplb_protocol",   # the wire (requests, error bodies) and the limits every process shares
    "sim_engine",      # the simulated engine
    "worker_agent",    # the agent: the slot's writer, engine adapters, engine metrics
    "router",          # the HTTP router
    "epp",             # the endpoint picker behind Envoy
    "launcher",        # the launch: router or Envoy + picker, agents, engines
    "bench",           # the benchmarks: live stacks of the above
    "simulate",        # the simulator (its live fidelity check runs bench's stacks)
)
#: the ground: imports no product package above it
GROUND = LAYERS[:4]


def _installed_packages() -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return [line.strip().rstrip("*") for line in cfg["options.packages.find"]["include"].split("\n") if line.strip()]


def package_arrows() -> dict[tuple[str, str], list[str]]:
    """``{(importer package, imported package): ["module -> module", ...]}`` between product packages."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for m, deps in graph().items():
        for d in deps:
            a, b = m.split(".")[0], d.split(".")[0]
            if a != b:
                arrows.setdefault((a, b), []).append(f"{m} -> {d}")
    return arrows


def test_every_installed_package_has_its_layer():
    assert sorted(_installed_packages()) == sorted(LAYERS)
    assert sorted(PACKAGES) == sorted(LAYERS)          # the module graph covers all of them


def test_no_package_imports_one_above_it_or_beside_it():
    up = [f"{a} -> {b}: {', '.join(sorted(why))}" for (a, b), why in sorted(package_arrows().items())
          if LAYERS.index(b) >= LAYERS.index(a)]
    assert up == []


def test_the_ground_imports_only_the_ground():
    out = [f"{a} -> {b}" for (a, b) in package_arrows() if a in GROUND and b not in GROUND]
    assert out == []


def test_the_layering_is_not_vacuous():
    """The graph this file judges is the real one: the arrows every layer is known to have."""
    arrows = set(package_arrows())
    assert {("router", "dplb_protocol"), ("worker_agent", "dplb_protocol"), ("router", "dplb_shm"),
            ("simulate", "dplb_trace"), ("bench", "dplb_trace"), ("epp", "router"), ("launcher", "epp"),
            ("bench", "launcher")} <= arrows


def _sources(pkg: str) -> list[Path]:
    """The Python files of package ``pkg``, sorted, without those under a hidden folder: the
    peer routers' virtualenvs the bench harnesses install into ``bench/.peers/`` (git-ignored) are
    not the house's code."""
    return [p for p in sorted((ROOT / pkg).rglob("*.py"))
            if not any(part.startswith(".") for part in p.relative_to(ROOT / pkg).parts)]


def test_prototypes_are_not_installed_and_nothing_installed_imports_them():
    assert (ROOT / "prototypes").is_dir()
    assert not any("prototypes".startswith(p) for p in _installed_packages())
    offenders = [f"{p.relative_to(ROOT)} imports {m}" for pkg in LAYERS for p in _sources(pkg)
                 for m in _imports(p) if m.split(".")[0] in ("prototypes", "tests")]
    assert offenders == []


#: the house's size limits are the router's (tests/router/test_import_graph.py: MAX_MODULE_LINES,
#: MAX_FUNCTION_LINES): a module longer is split by job, a function longer into steps

#: the justified exceptions, counted: ``path`` (a module) or ``path:function`` -> why
SIZE_EXCEPTIONS = {
    "sim_engine/api.py:build_router": "the simulated engine's FastAPI app: its routes are closures over one engine",
    "sim_engine/peers.py:build_peer_router": "the peer routers' stand-in app: its routes are closures over one state",
    "sim_engine/config.py:add_engine_args": "one add_argument per engine flag (the flags are the engine's config)",
    "simulate/cli.py:build_parser": "one add_argument per dplb-simulate flag",
}


def size_violations() -> list[str]:
    """Every product module over :data:`MAX_MODULE_LINES` and function over :data:`MAX_FUNCTION_LINES`."""
    import ast

    out = []
    for pkg in LAYERS:
        for p in _sources(pkg):
            rel = str(p.relative_to(ROOT))
            text = p.read_text()
            if text.count("\n") > MAX_MODULE_LINES:
                out.append(rel)
            for node in ast.walk(ast.parse(text)):
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and (node.end_lineno or node.lineno) - node.lineno + 1 > MAX_FUNCTION_LINES):
                    out.append(f"{rel}:{node.name}")
    return out


def test_no_product_module_or_function_is_too_long_but_the_counted_exceptions():
    new = [v for v in size_violations() if v not in SIZE_EXCEPTIONS]
    assert new == [], f"over {MAX_MODULE_LINES} lines (module) or {MAX_FUNCTION_LINES} (function): split it"
    assert len(SIZE_EXCEPTIONS) == 4


def test_every_size_exception_is_still_needed():
    """An exception whose module or function was split leaves the list (the count only goes down)."""
    found = set(size_violations())
    assert [k for k in SIZE_EXCEPTIONS if k not in found] == []


#: the justified explicit ``Any`` of the product packages, by module: each marked ``# Any: <why>``
#: right above its ``type: ignore[explicit-any]`` (mypy's ``disallow_any_explicit``, on for these
#: packages in setup.cfg, finds any other). router/: the ASGI scope and message (asgi), uvicorn's
#: cycle and protocol arguments (server) and uvicorn.run's keywords (__main__), asyncio's transport
#: and httptools' parser (connection), JSON read from a file or an agent (mirror), the YAML
#: document (config), a Segment held Optional until attached (state, policies/dplb); epp/: the
#: Kubernetes objects as the API server's JSON gives them (kube); launcher/: an HTTP answer's JSON
#: and a Segment held Optional until created (stack), the segment class and a dead agent's segment
#: a test may stand in for (supervisor, respawn); simulate/: the figures row (settings); dplb_shm/: a
#: remote agent's JSON before WorkerSnapshot's fields check it (types)
JUSTIFIED_ANY = {
    "router/__main__.py": 1, "router/asgi.py": 2, "router/config.py": 1, "router/connection.py": 3,
    "router/mirror.py": 5, "router/policies/dplb.py": 1, "router/server.py": 9, "router/state.py": 1,
    "epp/kube.py": 1,
    "launcher/respawn.py": 1, "launcher/stack.py": 2, "launcher/supervisor.py": 2,
    "simulate/settings.py": 1,
    "dplb_shm/types.py": 1,
}


def _any_reason(lines: list[str], i: int) -> str | None:
    """The ``# Any: <why>`` paragraph that ends the comment block right above line ``i`` (a
    ``# Any:`` line, then only plain ``# `` continuation lines), or None."""
    j = i - 1
    while j >= 0 and lines[j].strip().startswith("# ") and not lines[j].strip().startswith("# Any: "):
        j -= 1
    if j < 0 or not lines[j].strip().startswith("# Any: "):
        return None
    return " ".join(x.strip()[2:] for x in lines[j:i])


def test_every_explicit_any_is_marked_with_its_reason_and_counted():
    """Every ``type: ignore[explicit-any]`` in a product package has its reason right above it, and
    the packages hold exactly the counted ones."""
    found: dict[str, int] = {}
    unmarked = []
    for pkg in LAYERS:
        for p in _sources(pkg):
            rel = str(p.relative_to(ROOT))
            lines = p.read_text().splitlines()
            for i, line in enumerate(lines):
                if "type: ignore[explicit-any]" in line:
                    found[rel] = found.get(rel, 0) + 1
                    if _any_reason(lines, i) is None:
                        unmarked.append(f"{rel}:{i + 1}")
    assert unmarked == []
    assert found == JUSTIFIED_ANY


def test_the_packages_under_the_any_rule_are_those_setup_cfg_names():
    """mypy's ``disallow_any_explicit`` is on for every package the counted list speaks for, and
    no module of them is let off it."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    on = {sec[len("mypy-"):].removesuffix(".*") for sec in cfg.sections()
          if sec.startswith("mypy-") and cfg[sec].getboolean("disallow_any_explicit", fallback=False)}
    off = [sec for sec in cfg.sections() if sec.startswith("mypy-")
           and not cfg[sec].getboolean("disallow_any_explicit", fallback=True)]
    assert {"router", "epp", "launcher", "worker_agent", "simulate", "dplb_protocol", "dplb_trace", "dplb_shm",
            "dplb_prefix", "sim_engine"} <= on
    assert {f.split("/")[0] for f in JUSTIFIED_ANY} <= on
    assert off == []
