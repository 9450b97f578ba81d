"""The launcher's part of ``dplb.yaml``: the ``workers:`` section (what the launcher starts; the
router does not read it) and :class:`LaunchConfig`, the router's :class:`router.config.Config`
with that section validated, which the launcher loads (``load_config(path, overrides,
model=LaunchConfig)``): the same file, the same errors naming the dotted field.
"""
from __future__ import annotations

import shlex

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.config import Config
from worker_agent.engines import ENGINE_NAMES, ENGINES

#: one worker spec, two spellings: the ``--worker`` flag's short keys name the config file's
#: fields; both are accepted in both places (``launcher.specs.parse_worker_spec`` reads this too)
WORKER_KEY_ALIASES = {"args": "engine_args", "url": "engine_url"}


class LaunchWorker(BaseModel):
    """One entry of ``workers``: ``count`` workers the launcher starts, all serving ``model`` with
    ``engine`` (default: the launcher's ``--engine`` rule) on ``gpus`` (``"0-3"``, ``"4,5"`` or a
    list; split evenly among the ``count`` workers, tensor parallel = GPUs per worker), with
    ``engine_args`` added after the launcher's own; ``engine_url`` attaches ``--engine openai`` to a
    running server (``count`` 1); ``weight`` is the routing weight. The router does not read this
    section (it routes by each request's ``model``); ``launch_dplb.sh --worker`` says the same on
    the command line, with the same keys: ``args`` and ``url`` are accepted for ``engine_args`` and
    ``engine_url`` (:data:`WORKER_KEY_ALIASES`), and ``engine_args`` may be one string
    (shell-split, as ``args=`` is on the flag)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    model: str | None = None
    engine: str | None = None
    gpus: str | None = None
    count: int = Field(default=1, ge=1, le=64)
    engine_url: str | None = None
    engine_args: list[str] = Field(default_factory=list)
    weight: float = Field(default=1.0, gt=0, le=100)

    @model_validator(mode="before")
    @classmethod
    def _short_keys(cls, d: object) -> object:
        if not isinstance(d, dict):
            return d
        d = dict(d)
        for short, long in WORKER_KEY_ALIASES.items():
            if short in d:
                if long in d:
                    raise ValueError(f"give {long} or {short} (the same field), not both")
                d[long] = d.pop(short)
        if isinstance(d.get("engine_args"), str):
            try:
                d["engine_args"] = shlex.split(d["engine_args"])
            except ValueError as e:
                raise ValueError(f"engine_args: {e}") from None
        return d

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str | None) -> str | None:
        if v is not None and v not in ENGINES:
            raise ValueError(f"one of {', '.join(ENGINE_NAMES)}")
        return v

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, v: object) -> object:
        if isinstance(v, list):
            return ",".join(str(x) for x in v)
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v)
        return v


class LaunchConfig(Config):
    """The whole ``dplb.yaml`` as the launcher reads it: :class:`router.config.Config` with each
    ``workers:`` entry a :class:`LaunchWorker`."""

    workers: list[LaunchWorker] = Field(default_factory=list)  # type: ignore[assignment]  # narrows the router's
