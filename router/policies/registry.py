"""The one list of routing policies: each policy module registers its name, its parameters and its
factory here, and every other list of policy names reads this one (the router's, the launcher's
and the picker's ``--policy`` choices, config validation, the simulator's ``--policy``, the docs
table and the bench systems; ``tests/router/test_policy_registry.py`` ties them).

A policy module ends with::

    register(PolicySpec("round_robin", RoundRobinParams, _build, reads="ids"))

``RoundRobinParams`` (a :class:`PolicyParams`) declares the ``routing_policy`` fields the policy
reads, with their defaults and bounds (pydantic validates them); the config's
``routing_policy`` section (:class:`router.config.RoutingPolicy`) is every policy's parameters
together (it subclasses each registered ``params`` class, so one YAML section stays valid for
whichever policy ``policy:`` names). ``_build(params, ctx)`` returns the policy object from those
parameters and the :class:`PolicyContext` (the kernel, its parameters, the rng, the clock).

Parameter groups that several policies read are defined once below (:class:`RateParams`,
:class:`KvThresholdParams`, :class:`KvBarrierParams`, :class:`BalanceParams`) and in
:mod:`router.policies.prefix_index` (:class:`~router.policies.prefix_index.PrefixParams`).
"""
from __future__ import annotations

import random as _random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from dplb_shm.types import ScoringParams, TtftParams
from router.policies.base import Policy

if TYPE_CHECKING:
    from dplb_shm import Segment


class PolicyParams(BaseModel):
    """Base of every policy's parameters: unknown keys are refused (a typo never falls back to a
    default), assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RateParams(PolicyParams):
    """A worker's prefill speed until the router has learned its own, and how observed TTFTs teach
    it (:mod:`router.accounting`; read by ``dplb`` and ``least_load``). Defaults: the sim engine's
    model of Llama-3.1-8B on one H100 (sim_engine/config.py: 0.0325 ms per prefill token, 5 ms per
    step, 0.05 ms per decoding request, 39 ns per context token; vLLM's max_num_batched_tokens)."""

    prefill_tokens_per_s: float = Field(default=30_769.0, gt=0)
    step_tokens: int = Field(default=8192, ge=1)
    step_base_ms: float = Field(default=5.0, ge=0)
    decode_seq_ms: float = Field(default=0.05, ge=0)
    decode_ctx_ns: float = Field(default=39.0, ge=0)
    # learning each worker's prefill rate from observed TTFTs (router/accounting.py)
    rate_alpha: float = Field(default=0.1, gt=0, le=1)
    rate_clip: float = Field(default=4.0, ge=1)
    rate_min_tokens: int = Field(default=1024, ge=1)
    # the context length at which attention costs as much as the dense layers (router/accounting.py
    # prefill_work): P / (2·L·d) = 8.0e9 / (2·32·4096) = 30,500 for Llama-3.1-8B; 0 (the default:
    # the ablation in docs/DESIGN.md "Pricing attention") counts plain tokens
    attention_tokens: float = Field(default=0.0, ge=0)


class KvThresholdParams(PolicyParams):
    """The KV-cache use above which the native kernel rules a worker out (``dplb``, ``weighted``)."""

    kv_cache_threshold: float = Field(default=0.8, gt=0, le=1)


class KvBarrierParams(PolicyParams):
    """Convex barrier ``kv_barrier_s·k/(1−k)`` as the KV cache fills, seconds (SGLang gateway
    least_load's 0.15 s; ``dplb``, ``least_load``)."""

    kv_barrier_s: float = Field(default=0.15, ge=0)


class BalanceParams(PolicyParams):
    """SGLang router's imbalance rule (sglang-router 0.3.x launch_router defaults): a worker is
    overloaded when its pending exceeds the least loaded's by ``balance_abs_threshold`` and by a
    factor ``balance_rel_threshold`` (``cache_aware``, ``weighted``)."""

    balance_abs_threshold: int = Field(default=64, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1)


@dataclass(frozen=True)
class PolicyContext:
    """What a factory gets besides its parameters: ``kernel`` (a ``dplb_shm.Segment``; required by
    the policies registered with ``needs_kernel``), ``scoring`` (``ScoringParams``, ``weighted``),
    ``ttft`` (``TtftParams``, ``dplb``), ``rng`` (deterministic tests) and ``clock`` (``() -> ns``
    for the kernel's heartbeat check: the simulator's virtual time)."""

    kernel: Segment | None = None   # a dplb_shm.Segment (or a test's stand-in with the same pick methods)
    scoring: ScoringParams | None = None
    ttft: TtftParams | None = None
    rng: _random.Random | None = None
    clock: Callable[[], int] | None = None


P = TypeVar("P", bound=PolicyParams)


@dataclass(frozen=True)
class PolicySpec(Generic[P]):
    """One registered policy: ``name`` (its config and ``--policy`` name), ``params`` (the
    :class:`PolicyParams` subclass of the fields it reads), ``factory(params, ctx) -> Policy``,
    ``reads`` (one line for the docs table: what it reads), ``needs_kernel`` (it scores in the
    native kernel, so a segment must be given)."""

    name: str
    params: type[P]
    factory: Callable[[P, PolicyContext], Policy]
    reads: str
    needs_kernel: bool = False

    def build(self, params: PolicyParams, ctx: PolicyContext) -> Policy:
        """The policy from ``params`` (any :class:`PolicyParams` holding this policy's fields, e.g.
        the whole ``routing_policy`` section) and ``ctx``.

        Raises:
            ValueError: ``needs_kernel`` and no kernel in ``ctx``; pydantic's ``ValidationError``
                when ``params`` lacks one of the fields and its default does not validate.
        """
        if self.needs_kernel and ctx.kernel is None:
            raise ValueError(f"the {self.name} policy needs the segment's kernel")
        mine = params if isinstance(params, self.params) else \
            self.params.model_validate(params.model_dump(include=set(self.params.model_fields)))
        return self.factory(mine, ctx)


class RegisteredSpec(Protocol):
    """A :class:`PolicySpec` of any parameter class, as :data:`REGISTRY` holds it (read-only; its
    ``factory`` is reached through :meth:`build`, which accepts any :class:`PolicyParams`)."""

    @property
    def name(self) -> str: ...

    @property
    def params(self) -> type[PolicyParams]: ...

    @property
    def reads(self) -> str: ...

    @property
    def needs_kernel(self) -> bool: ...

    def build(self, params: PolicyParams, ctx: PolicyContext) -> Policy: ...


#: name -> spec, in registration order (the order the docs list them)
REGISTRY: dict[str, RegisteredSpec] = {}


def register(spec: PolicySpec[P]) -> PolicySpec[P]:
    """Add ``spec`` to :data:`REGISTRY` (at import of its module) and return it.

    Raises:
        ValueError: another policy already has that name.
    """
    if spec.name in REGISTRY and REGISTRY[spec.name] is not spec:
        raise ValueError(f"routing policy {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    return spec


def policy_names() -> tuple[str, ...]:
    """Every registered policy name, in registration order (read it when building a parser or
    validating, not once at import: a policy registered later shows up too)."""
    return tuple(REGISTRY)


def spec_of(name: str) -> RegisteredSpec:
    """The registered spec of ``name``.

    Raises:
        ValueError: no policy of that name (the message lists the names).
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; one of {', '.join(REGISTRY)}") from None
