"""One table of engine kinds (issue 28, worker_agent/engines.py): the adapters, the agent's and the
launcher's ``--engine`` choices, the launcher's config section, start-up budgets and the simulator
all read it."""
from __future__ import annotations

import pytest

from worker_agent.adapters import ADAPTERS, build_adapter
from worker_agent.config import AgentConfig, build_parser
from worker_agent.engines import ENGINE_NAMES, ENGINES


def _choices(parser, flag: str) -> tuple[str, ...]:
    return next(tuple(a.choices) for a in parser._actions if flag in a.option_strings)


def test_every_list_of_engine_kinds_is_the_table():
    import launcher.cli as launcher_cli
    from launcher.config import LaunchWorker
    from launcher.gpus import ENGINES as LAUNCHER_ENGINES

    assert ENGINE_NAMES == ("sim", "vllm", "sglang", "openai")
    assert tuple(ADAPTERS) == ENGINE_NAMES
    assert _choices(build_parser(), "--engine") == ENGINE_NAMES
    assert _choices(launcher_cli.build_parser(), "--engine") == ENGINE_NAMES == LAUNCHER_ENGINES
    assert launcher_cli.START_TIMEOUTS == {k: e.start_timeout_s for k, e in ENGINES.items()}
    for name in ENGINE_NAMES:
        assert LaunchWorker.model_validate({"engine": name, "model": "m"}).engine == name
    with pytest.raises(ValueError, match="one of sim, vllm, sglang, openai"):
        LaunchWorker.model_validate({"engine": "tgi"})


@pytest.mark.parametrize("name", ENGINE_NAMES)
def test_each_adapter_is_its_row(tmp_path, name):
    kind = ENGINES[name]
    cfg = AgentConfig(worker_id=0, shm="x", uds=str(tmp_path / "a.sock"), engine=name, model="m",
                      run_dir=str(tmp_path), engine_url="http://127.0.0.1:9" if not kind.spawns else None)
    a = build_adapter(cfg)
    assert type(a) is ADAPTERS[name] and a.name == name
    assert a.metric_names is kind.metric_names
    argv = a.command()
    if kind.spawns:
        assert argv is not None and argv[1:3] == ["-m", kind.module]
    else:
        assert argv is None
    assert (a.address.uds is not None) == (kind.socket == "uds")
    assert (a.address.url is not None) == (kind.socket in ("tcp", "url"))


def test_the_simulator_runs_the_sim_kind():
    from simulate.virtual import SIM, _NoAdapter

    assert SIM is ENGINES["sim"] and _NoAdapter.name == "sim"
