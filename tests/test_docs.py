"""The user documentation (README.md, docs/*.md) against the code it describes.

- every ``--flag`` written after a DPLB command (``launch_dplb.sh``, ``dplb-router``, ``python -m
  bench.x`` ...) exists in that command's argument parser, and every flag written on its own exists in
  some DPLB command's parser or is another tool's (``FOREIGN_FLAGS``, each with its tool);
- every ``make X`` names a Makefile target;
- every relative link resolves to a file (and its ``#anchor`` to a heading of that page), and every
  repository path written in code (``deploy/prometheus/dplb.rules.yml``) exists;
- every config key written as ``section.field`` (``retries.retry_on_timeout``) is a field of the
  config model (``router/config.py``);
- every page of docs/ is linked from the README, the README stays a five-minute read (<= 10,000
  bytes), and no user-facing page speaks of the project's issue numbers.

The parsers are the real ones: each command's ``main`` is called with ``--help`` while
``ArgumentParser.parse_known_args`` is replaced by a function that captures the parser and stops,
so a flag removed from a parser fails here, wherever the parser is built.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import re
from collections.abc import Callable, Iterator
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
USER_DOCS = [README, *PAGES]
README_MAX_BYTES = 10_000

#: flags of other tools the pages mention (peers' routers, engines, container tools): never DPLB's.
FOREIGN_FLAGS = {
    # vLLM (``vllm serve``) and SGLang's engine
    "--uds", "--data-parallel-size", "--max-model-len", "--api-key", "--goodput", "--max-running-requests",
    # SGLang's router (sglang_router.launch_router) and vLLM's production-stack router
    "--worker-urls", "--static-backends", "--static-models", "--routing-logic", "--session-key",
    "--cache-threshold", "--balance-abs-threshold", "--balance-rel-threshold", "--max-payload-size",
    "--request-timeout-secs", "--retry-max-retries", "--cb-failure-threshold",
    "--health-check-interval-secs", "--prometheus-port", "--prometheus-host", "--dp-aware", "--policy",
    # SGLang's gateway (smg)
    "--shutdown-grace-period-secs", "--load-monitor-interval", "--balance-token-usage-threshold",
    "--overload-token-usage-threshold", "--worker-warmup", "--worker-stall-secs", "--worker-wedge-secs",
    # podman / docker / compose
    "--network", "--shm-size", "--format", "--gpus", "--ipc", "--device", "--init", "--pull",
    "--build-arg", "--rm", "--entrypoint", "--profile", "--name",
    # envoy, prometheus, curl
    "--disable-hot-restart", "--config.file",
}

#: the commands of ``setup.cfg``'s console_scripts, and the launch script (``python -m launcher``)
SCRIPT_RE = r"(?:\./)?(?:scripts/)?launch_dplb\.sh|python -m launcher\b"
# a DPLB console script, or ``python -m <a module of this repository>``; a word such as the segment
# name ``dplb-30000`` is no command (only the names of the console scripts count)
MODULE_RE = r"python3? -m ([a-z_]+(?:\.[a-z_]+)*)"
FLAG_RE = re.compile(r"(?<![\w=:/.-])--[a-z0-9][a-z0-9.-]*[a-z0-9]")
SEPARATORS = re.compile(r"\|\||&&|[|;]|\$\(|\)|`")


@cache
def _console_scripts() -> dict[str, str]:
    eps = entry_points(group="console_scripts")
    return {ep.name: ep.value for ep in eps if ep.name.startswith("dplb-")}


class _Captured(BaseException):
    """Raised by the stand-in ``parse_known_args`` to stop a command at its parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its sub-commands' parsers."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _options(sub)
    return out


def _parser_of(main: Callable[..., object], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> object:
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        try:
            main(["--help"])
        except _Captured as c:
            return _options(c.parser)
    raise AssertionError(f"{main} returned without parsing its arguments")


@cache
def _flags_of(command: str) -> frozenset[str]:
    """The flags of ``command``: a console script's name, ``launcher`` or a module of this repository."""
    scripts = _console_scripts()
    if command in scripts:
        mod, _, attr = scripts[command].partition(":")
    elif command == "launcher":
        mod, attr = "launcher.cli", "main"
    else:
        mod, attr = command, "main"
    main = getattr(importlib.import_module(mod), attr)
    mp = pytest.MonkeyPatch()
    try:
        return frozenset(_parser_of(main, mp))
    finally:
        mp.undo()


def _is_module(mod: str) -> bool:
    path = ROOT / Path(*mod.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def _all_dplb_flags() -> set[str]:
    """The flags of every console script, of the launcher and of each module of this repository
    that the pages run with ``python -m``."""
    modules = {m for p in USER_DOCS for m in re.findall(MODULE_RE, p.read_text()) if _is_module(m)}
    out: set[str] = set()
    for name in [*_console_scripts(), "launcher", *sorted(modules)]:
        out |= _flags_of(name)
    return out


def _code_contexts(text: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of each shell line of a fenced block (``\\`` continuations joined, a
    ``#`` comment apart) and of each inline code span and table cell outside the blocks."""
    lines = text.splitlines()
    in_block = False
    pending = ""
    start = 0
    for no, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            if not pending:
                start = no
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            full = pending + line
            pending = ""
            m = re.search(r"(^|\s)#\s", full)
            code, comment = (full[:m.start()], full[m.end():]) if m else (full, "")
            yield start, code
            if comment:
                yield start, comment
        else:
            for span in re.findall(r"`([^`]+)`", line):
                yield no, span


@cache
def _command_re() -> re.Pattern[str]:
    scripts = "|".join(map(re.escape, sorted(_console_scripts(), key=len, reverse=True)))
    return re.compile(rf"(?<![\w-])(?:{SCRIPT_RE}|{MODULE_RE}|(?:\.venv/bin/)?({scripts})(?![\w-]))")


def _commands_and_flags(context: str) -> Iterator[tuple[str | None, str]]:
    """(command, flag) for every flag of a code context; command None for a flag written alone.
    A piece of a shell line (split at ``|``, ``&&``, ``;``) belongs to the last DPLB command named
    before the flag; flags after a bare ``--`` are the engine's; a piece run by another tool is skipped."""
    cmd_re = _command_re()
    for piece in SEPARATORS.split(context):
        piece = re.split(r"\s--(?:\s|$)", piece)[0]
        words = piece.split()
        if words and words[0] in {"curl", "podman", "docker", "envoy", "kubectl", "promtool", "prometheus",
                                  "pip", "vllm", "nvidia-ctk"}:
            continue
        command: str | None = None
        pos = 0
        for m in cmd_re.finditer(piece):
            for flag in FLAG_RE.findall(piece[pos:m.start()]):
                yield command, flag
            if m.group(1):
                command = m.group(1) if _is_module(m.group(1)) else "foreign"
            elif m.group(2):
                command = m.group(2)
            else:
                command = "launcher"
            pos = m.end()
        for flag in FLAG_RE.findall(piece[pos:]):
            yield command, flag


def _where(path: Path, no: int) -> str:
    return f"{path.relative_to(ROOT)}:{no}"


def test_every_flag_named_for_a_command_exists_in_its_parser():
    known = _all_dplb_flags()
    wrong = []
    for page in USER_DOCS:
        for no, context in _code_contexts(page.read_text()):
            for command, flag in _commands_and_flags(context):
                if command == "foreign":
                    continue
                if command is None:
                    if flag not in known and flag not in FOREIGN_FLAGS:
                        wrong.append(f"{_where(page, no)}: {flag} is no DPLB command's flag (in `{context.strip()}`)")
                elif flag not in _flags_of(command):
                    wrong.append(f"{_where(page, no)}: {command} has no {flag} (in `{context.strip()}`)")
    assert not wrong, "\n".join(wrong)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def test_every_make_target_named_exists():
    targets = _make_targets()
    wrong = [f"{_where(p, no)}: make {t}" for p in USER_DOCS for no, ctx in _code_contexts(p.read_text())
             for t in re.findall(r"(?<![\w-])make ([a-z][\w-]*)", ctx) if t not in targets]
    assert not wrong, "targets missing from the Makefile:\n" + "\n".join(wrong)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def _links(page: Path) -> Iterator[tuple[int, str]]:
    for no, line in enumerate(page.read_text().splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            yield no, target


def test_every_link_resolves():
    wrong = []
    for page in USER_DOCS:
        for no, target in _links(page):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                wrong.append(f"{_where(page, no)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                wrong.append(f"{_where(page, no)}: {target} (no heading #{anchor} in {dest.name})")
    assert not wrong, "\n".join(wrong)


TOP_DIRS = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}


def test_every_repository_path_written_in_code_exists():
    wrong = []
    for page in USER_DOCS:
        for no, ctx in _code_contexts(page.read_text()):
            for path in re.findall(r"(?<![\w./${-])([a-z_]+/[\w./-]*\w\.(?:py|pyx|h|md|ya?ml|json|sh|cfg|toml))\b", ctx):
                if path.split("/")[0] in TOP_DIRS and not (ROOT / path).exists():
                    wrong.append(f"{_where(page, no)}: {path}")
    assert not wrong, "paths that do not exist:\n" + "\n".join(wrong)


def _config_sections() -> dict[str, set[str]]:
    """Each section of ``router.config.Config`` (a pydantic model field) and its fields."""
    from pydantic import BaseModel

    from router.config import Config

    out: dict[str, set[str]] = {}
    for name, field in Config.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out[name] = set(ann.model_fields)
    return out


def _unknown_config_keys(context: str) -> list[str]:
    """``section.field`` names in ``context`` that the config model lacks (``router.log``, a file,
    and ``router.policies.x``, a module, are not keys)."""
    fields = _config_sections()
    key_re = re.compile(rf"(?<![\w/.-])({'|'.join(fields)})\.([a-z_]+)(?![\w.(/-])")
    return [f"{s}.{f}" for s, f in key_re.findall(context)
            if f not in fields[s] and f not in {"log", "py", "yml", "yaml", "json", "md"}
            and not _is_module(f"{s}.{f}") and not (ROOT / s / f).is_dir()]   # router.kv_events: a module


def test_every_config_key_named_exists():
    wrong = [f"{_where(p, no)}: {key}" for p in USER_DOCS for no, ctx in _code_contexts(p.read_text())
             for key in _unknown_config_keys(ctx)]
    assert not wrong, "config keys that router/config.py does not have:\n" + "\n".join(wrong)


def _python_imports(text: str) -> Iterator[tuple[int, str]]:
    """(line number, statement) of each ``import``/``from ... import`` line of the ```python blocks."""
    in_python = False
    stmt, start = "", 0
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_python = line.strip() == "```python" and not in_python
            continue
        code = line.split("#")[0].strip()
        if in_python and (stmt or re.match(r"(from \S+ )?import ", code)):
            stmt, start = (stmt + " " + code if stmt else code), (start if stmt else no)
            if stmt.count("(") == stmt.count(")"):
                yield start, stmt
                stmt = ""


def test_every_import_in_a_python_block_works():
    """A name that moves (``simulate.cluster.SLO`` to ``simulate.settings``) fails here."""
    wrong = []
    for page in USER_DOCS:
        for no, stmt in _python_imports(page.read_text()):
            for node in ast.walk(ast.parse(stmt)):
                if isinstance(node, ast.Import):
                    mods = [(a.name, None) for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [(node.module or "", a.name) for a in node.names]
                else:
                    continue
                for mod, name in mods:
                    try:
                        obj = importlib.import_module(mod)
                    except ImportError as e:
                        wrong.append(f"{_where(page, no)}: {stmt}: {e}")
                        continue
                    if name is not None and not hasattr(obj, name):
                        wrong.append(f"{_where(page, no)}: {mod} has no {name}")
    assert not wrong, "\n".join(wrong)


def test_interfaces_has_a_row_for_every_package():
    """docs/INTERFACES.md is the contract between the packages: its table names every one."""
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    rows = set(re.findall(r"^\| `([a-z_]+)/`", (ROOT / "docs" / "INTERFACES.md").read_text(), re.MULTILINE))
    missing = [p for p in packages if p not in rows]
    assert not missing, f"packages docs/INTERFACES.md's table does not name: {missing}"


def test_every_page_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in _links(README)}
    assert PAGES, "docs/ has no page"
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_is_short_and_names_the_ci_command():
    assert README.stat().st_size <= README_MAX_BYTES, f"README.md is {README.stat().st_size} bytes"
    text = README.read_text()
    assert "./scripts/launch_dplb.sh --num-workers 4" in text
    assert "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()     # the README's test command is CI's


def test_no_issue_numbers_in_user_facing_docs():
    found = [f"{_where(p, no)}: {m.group(0)}" for p in USER_DOCS
             for no, line in enumerate(p.read_text().splitlines(), 1)
             for m in re.finditer(r"\bissues?\s*#?\d+", line, re.IGNORECASE)]
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_should():
    """The checks above can fail: a removed flag, a flag given to the wrong command, a missing target."""
    pairs = list(_commands_and_flags("./scripts/launch_dplb.sh --num-workers 2 --no-such-flag -- --max-model-len 8"))
    assert pairs == [("launcher", "--num-workers"), ("launcher", "--no-such-flag")]
    assert "--no-such-flag" not in _flags_of("launcher")
    assert "--num-workers" in _flags_of("launcher")
    assert "--num-workers" not in _flags_of("dplb-router")      # each command has its own parser
    assert list(_commands_and_flags("dplb-epp --shm x && curl --max-time 3")) == [("dplb-epp", "--shm")]
    assert "nope" not in _make_targets() and "test" in _make_targets()
    assert _slug("Scoring (csrc/dplb_kernel.h)") == "scoring-csrcdplb_kernelh"
    assert _unknown_config_keys("retries.retry_on_timeout, router.log, router.proxy, retries.no_such_key") == [
        "retries.no_such_key"]


def test_every_policy_is_on_the_routing_page():
    from router.policies import policy_names

    text = (ROOT / "docs" / "routing.md").read_text()
    missing = [name for name in policy_names() if f"`{name}`" not in text]
    assert not missing, f"policies docs/routing.md does not name: {missing}"
