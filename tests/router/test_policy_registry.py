"""One list of routing policies (issue 28): the registry (router/policies/registry.py) is what the
router's, the launcher's and the picker's ``--policy`` choices, config validation, the simulator,
the bench systems and the docs name; a policy registered once shows up in every one of them."""
from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from router.config import Config, RoutingPolicy, load_config
from router.errors import ConfigError
from router.policies import (
    REGISTRY,
    PolicyParams,
    PolicySpec,
    build_policy,
    policy_names,
    register,
)
from router.policies.round_robin import RoundRobinPolicy
from tests.helpers import ROOT


def _choices(parser: argparse.ArgumentParser, flag: str) -> tuple[str, ...]:
    for a in parser._actions:
        if flag in a.option_strings:
            return tuple(a.choices or ())
    raise AssertionError(f"{flag} not in {parser.prog}")


def _every_list() -> dict[str, tuple[str, ...]]:
    """Each place that lists policy names, as it lists them now."""
    import epp.__main__ as epp_cli
    import launcher.cli as launcher_cli
    import router.__main__ as router_cli
    from bench.systems import BENCH_LEFT_OUT, all_systems
    from simulate.cli import _policies, build_parser

    sim_ns = build_parser().parse_args(["--policy", ",".join(policy_names())])
    return {
        "launcher --policy": _choices(launcher_cli.build_parser(), "--policy"),
        "dplb-router --policy": _choices(router_cli.build_parser(), "--policy"),
        "dplb-epp --policy": _choices(epp_cli.build_parser(), "--policy"),
        "simulate --policy": tuple(_policies(sim_ns, Config())),
        "bench systems": tuple(s.policy for s in all_systems() if s.kind == "dplb") + BENCH_LEFT_OUT,
    }


def test_every_list_of_policy_names_is_the_registry():
    names = policy_names()
    assert names[0] == "dplb" and len(names) == len(set(names)) == 11
    for where, listed in _every_list().items():
        assert sorted(listed) == sorted(names), where
    for name in names:   # config validation accepts exactly these
        assert load_config(None, {"routing_policy.policy": name}).routing_policy.policy == name
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"routing_policy.policy": "fastest"})
    assert ei.value.field == "routing_policy.policy" and "one of dplb, weighted" in str(ei.value)


def test_the_config_section_holds_every_policys_parameters():
    """``routing_policy`` subclasses every registered parameter class, so each policy's factory
    reads its own fields from it; each field is declared once, by one parameter class."""
    for spec in REGISTRY.values():
        assert issubclass(RoutingPolicy, spec.params), spec.name
        assert set(spec.params.model_fields) <= set(RoutingPolicy.model_fields)
    rp = RoutingPolicy(policy="kv_cost", overlap_weight=2.0, kv_block_size=32)
    pol = build_policy("kv_cost", rp)
    assert (pol.overlap_weight, pol.block_size) == (2.0, 32)
    with pytest.raises(ValueError):                  # validated by the policy's own section
        RoutingPolicy(kv_block_size=0)


def test_the_docs_table_is_the_registry():
    import router.policies as pkg

    rows = re.findall(r"^\| (\w+)(?: \(default\))? +\| (\w+)\.py +\| (.+?) +\|$", pkg.__doc__ or "", re.MULTILINE)
    assert [(n, f) for n, f, _ in rows] == [(n, n) for n in policy_names()]
    assert {n: r for n, _, r in rows} == {n: s.reads for n, s in REGISTRY.items()}
    example = (ROOT / "dplb.example.yaml").read_text()
    design = (ROOT / "docs" / "DESIGN.md").read_text()
    for name in policy_names():
        assert f"`{name}`" in design, name
        assert re.search(rf"[#|] {name}\b", example), name


@pytest.fixture
def extra_policy() -> Iterator[str]:
    """A policy registered for the test only (removed at teardown)."""
    spec = register(PolicySpec("round_robin_too", PolicyParams, lambda p, ctx: RoundRobinPolicy(rng=ctx.rng),
                               reads="ids"))
    try:
        yield spec.name
    finally:
        REGISTRY.pop(spec.name, None)


def test_a_policy_registered_once_is_named_everywhere(extra_policy):
    for where, listed in _every_list().items():
        assert extra_policy in listed, where
    cfg = load_config(None, {"routing_policy.policy": extra_policy})
    assert build_policy(cfg.routing_policy.policy, cfg.routing_policy).name == "round_robin"


def test_a_name_registers_once():
    with pytest.raises(ValueError, match="registered twice"):
        register(PolicySpec("dplb", PolicyParams, lambda p, ctx: RoundRobinPolicy(), reads="ids"))
    assert REGISTRY["dplb"].needs_kernel
