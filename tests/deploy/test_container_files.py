"""The container files (issue 31): deploy/compose.yaml parses and says what a compose file must say
(docker compose is not installed here: PyYAML reads it, merge keys included), its commands parse
with the launcher's and the router's own command lines, and the Dockerfile keeps its promises
(multi-stage on ARG BASE, no compiler in the runtime stage, non-root, SIGINT, HEALTHCHECK, init).
The real build and run is ``make test-container`` (scripts/test_container.sh)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from launcher.cli import build_parser as launcher_parser
from launcher.cli import split_engine_args
from router.__main__ import build_parser as router_parser
from tests.helpers import ROOT

COMPOSE = Path(ROOT) / "deploy" / "compose.yaml"
DOCKERFILE = Path(ROOT) / "Dockerfile"
RUN_DIR = "/run/dplb"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _expand(argv: list[str]) -> list[str]:
    """``${VAR:-default}`` → default, as compose does when VAR is unset."""
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in argv]


def _gpu_request(svc: dict) -> None:
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


def test_services_and_profiles(compose):
    assert set(compose["services"]) == {"dplb", "agents", "router"}
    assert compose["services"]["dplb"]["profiles"] == ["one-box"]
    assert compose["services"]["agents"]["profiles"] == compose["services"]["router"]["profiles"] == ["split"]
    for name, svc in compose["services"].items():
        assert svc["build"]["context"] == ".." and svc["build"]["dockerfile"] == "Dockerfile", name
        assert (COMPOSE.parent / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert "BASE" in svc["build"]["args"], name
        assert svc["network_mode"] == "host", name
        assert svc["stop_signal"] == "SIGINT", name
        assert svc["healthcheck"]["test"][0] == "CMD", name


def test_one_box_has_shm_gpus_and_a_launch_command(compose):
    box = compose["services"]["dplb"]
    assert box["shm_size"] == "16gb"
    _gpu_request(box)
    assert box["environment"]["DPLB_ENGINE_PYTHON"] == "python3"
    args = launcher_parser().parse_args(split_engine_args(_expand(box["command"]))[0])
    assert args.num_workers == 4 and args.model and not args.no_router
    assert "/health" in " ".join(box["healthcheck"]["test"])


def test_split_shares_the_segment_and_the_run_dir(compose):
    agents, router = compose["services"]["agents"], compose["services"]["router"]
    assert agents["ipc"] == "shareable" and router["ipc"] == "service:agents"
    assert "shm_size" in agents and "shm_size" not in router   # the router uses the agents' /dev/shm
    _gpu_request(agents)
    assert "deploy" not in router
    vol = f"dplb-run:{RUN_DIR}"
    assert vol in agents["volumes"] and vol in router["volumes"] and "dplb-run" in compose["volumes"]
    a = launcher_parser().parse_args(split_engine_args(_expand(agents["command"]))[0])
    assert a.no_router and a.port == 30000
    assert router["entrypoint"][-1] == "dplb-router"
    r = router_parser().parse_args(router["command"])
    assert r.shm == f"dplb-{a.port}" and r.port == a.port        # the segment the agents' launch creates
    assert router["depends_on"] == {"agents": {"condition": "service_healthy"}}
    assert "dplb-30000" in " ".join(agents["healthcheck"]["test"])


def _stages(text: str) -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined), split into stages at each FROM."""
    lines = re.sub(r"\\\n", " ", text).splitlines()
    stages: list[list[str]] = [[]]
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM ") and stages[-1] and any(x.upper().startswith("FROM ") for x in stages[-1]):
            stages.append([])
        stages[-1].append(line)
    return stages


def test_dockerfile_stages_and_runtime_promises():
    stages = _stages(DOCKERFILE.read_text())
    assert len(stages) == 2
    build, runtime = stages
    assert build[0].startswith("ARG BASE=localhost/dplb-debian-base:")
    assert "FROM ${BASE} AS build" in build and runtime[0] == "FROM ${BASE} AS runtime"
    build_text, runtime_text = "\n".join(build), "\n".join(runtime)
    assert "gcc" in build_text and "Cython" in build_text and "pip install" in build_text
    assert "gcc" not in runtime_text and "Cython" not in runtime_text and "COPY . " not in runtime_text
    assert "COPY --from=build /opt/dplb /opt/dplb" in runtime
    assert "USER 10001:10001" in runtime and "--uid 10001" in runtime_text
    assert "STOPSIGNAL SIGINT" in runtime and "EXPOSE 30000" in runtime
    health = next(x for x in runtime if x.startswith("HEALTHCHECK"))
    assert "DPLB_HEALTH_URL" in health and "DPLB_HEALTH_URL=http://127.0.0.1:30000/health" in runtime_text
    entry = next(x for x in runtime if x.startswith("ENTRYPOINT"))
    assert entry == 'ENTRYPOINT ["tini", "--", "/opt/dplb/bin/python", "-m", "launcher"]'
    cmd = next(x for x in runtime if x.startswith("CMD"))
    assert launcher_parser().parse_args(yaml.safe_load(cmd[len("CMD"):])).num_workers == 2
    assert f"DPLB_RUN_DIR={RUN_DIR}" in runtime_text


def test_dockerignore_keeps_the_build_context_to_the_sources():
    ignored = {x.strip() for x in (Path(ROOT) / ".dockerignore").read_text().splitlines()
               if x.strip() and not x.startswith("#")}
    assert {".git", ".venv*", "tests", "**/*.so", "csrc/*.c"} <= ignored
    for needed in ("csrc", "dplb_shm", "router", "launcher", "setup.py", "setup.cfg", "README.md"):
        assert needed not in ignored
