"""Per-worker specs: several models (engines, GPU groups, engine arguments) on one box.

One box can serve several models side by side, e.g. two tensor-parallel workers of one model on
GPUs 0-3 and one worker of another on GPUs 4-7::

    launch_dplb.sh --worker "model=Qwen/Qwen2.5-7B-Instruct,gpus=0-3,count=2" \\
                   --worker "model=meta-llama/Llama-3.1-8B-Instruct,gpus=4-7,args=--max-model-len 8192"

or the config file's ``workers:`` section (:class:`launcher.config.LaunchWorker`, same keys). A spec
is ``key=value`` pairs separated by commas; a piece without ``=`` continues the previous value
(so ``gpus=0,1,2,3`` and ``args=--x a,b`` read as written). Keys: ``model``, ``engine``
(sim|vllm|sglang|openai; default: the launcher's ``--engine``, else vllm with GPUs and a model,
else sim), ``gpus`` (ids and ranges; split evenly among ``count`` workers, tensor parallel = GPUs
per worker), ``count`` (workers of this spec, default 1), ``url`` (``--engine openai``: the
server to attach to; count 1), ``args`` (engine arguments, shell-split, after the launcher's
``-- ...`` ones), ``weight`` (routing weight). The config file's names ``engine_url`` and
``engine_args`` are accepted for ``url`` and ``args``, here and there
(:data:`launcher.config.WORKER_KEY_ALIASES`).

Worker ids follow the order of the specs. Two specs may not share a GPU; a real engine (vllm,
sglang) needs ``gpus`` once there are several specs (the discovered GPUs serve a single spec).
The router needs nothing of this: every slot carries its model and the router routes each request
by its ``model`` (``GET /v1/models`` lists every model served).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from launcher.config import WORKER_KEY_ALIASES, LaunchWorker
from launcher.errors import UsageError
from launcher.gpus import (
    ENGINE_TABLE,
    ENGINES,
    choose_engine,
    parse_gpu_list,
    plan_gpus,
)

KEYS = ("model", "engine", "gpus", "count", "url", "args", "weight")
#: the config file's spellings, accepted on the flag too (``engine_args=`` is ``args=``)
LONG_KEYS = {long: short for short, long in WORKER_KEY_ALIASES.items()}


@dataclass(frozen=True)
class WorkerSpec:
    """One ``--worker`` flag or ``workers:`` entry (see the module docstring)."""

    model: str | None = None
    engine: str | None = None
    gpus: str | None = None
    count: int = 1
    engine_url: str | None = None
    engine_args: tuple[str, ...] = ()
    weight: float = 1.0


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker (agent + engine) is started with: ``gpus`` its physical GPU ids (``[]``:
    none), ``tp_size`` the engine's tensor-parallel size, ``engine_args`` all its engine
    arguments (the launcher's ``-- ...`` then the spec's)."""

    engine: str
    model: str | None = None
    gpus: list[int] = field(default_factory=list)
    tp_size: int = 1
    engine_url: str | None = None
    engine_args: list[str] = field(default_factory=list)
    weight: float = 1.0

    def cuda_visible_devices(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` for this worker (``"0,1"``), or None without GPUs."""
        return ",".join(str(g) for g in self.gpus) if self.gpus else None


def parse_worker_spec(text: str) -> WorkerSpec:
    """Parse one ``--worker`` value; raises :class:`UsageError` naming the bad piece."""
    pairs: list[list[str]] = []
    for piece in text.split(","):
        if "=" in piece:
            k, v = piece.split("=", 1)
            k = k.strip().lower()
            k = LONG_KEYS.get(k, k)
            if k not in KEYS:
                raise UsageError(f"--worker {text!r}: unknown key {k!r} (keys: {', '.join(KEYS)}; "
                                 f"{', '.join(f'{lo} = {sh}' for lo, sh in LONG_KEYS.items())})")
            if any(p[0] == k for p in pairs):
                raise UsageError(f"--worker {text!r}: {k} given twice")
            pairs.append([k, v])
        elif pairs:
            pairs[-1][1] += "," + piece
        elif piece.strip():
            raise UsageError(f"--worker {text!r}: expected key=value pairs, e.g. model=M,gpus=0-3")
    d = {k: v.strip() for k, v in pairs}
    if not d:
        raise UsageError("--worker needs key=value pairs, e.g. model=M,gpus=0-3")
    try:
        count = int(d.get("count", "1"))
        weight = float(d.get("weight", "1"))
    except ValueError:
        raise UsageError(f"--worker {text!r}: count must be an integer and weight a number") from None
    try:
        args = tuple(shlex.split(d.get("args", "")))
    except ValueError as e:
        raise UsageError(f"--worker {text!r}: args: {e}") from None
    return make_spec(model=d.get("model") or None, engine=d.get("engine") or None, gpus=d.get("gpus"),
                     count=count, engine_url=d.get("url") or None, engine_args=args, weight=weight, where=text)


def make_spec(*, model: str | None, engine: str | None, gpus: str | None, count: int, engine_url: str | None,
              engine_args: tuple[str, ...] | list[str], weight: float, where: str) -> WorkerSpec:
    """Validate the fields of one spec (``where`` names it in errors)."""
    if engine is not None and engine not in ENGINES:
        raise UsageError(f"worker spec {where!r}: engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    if count < 1:
        raise UsageError(f"worker spec {where!r}: count must be at least 1 (got {count})")
    if not weight > 0:
        raise UsageError(f"worker spec {where!r}: weight must be positive (got {weight})")
    if engine_url is not None and count != 1:
        raise UsageError(f"worker spec {where!r}: url attaches one engine: count must be 1")
    return WorkerSpec(model, engine, gpus, count, engine_url, tuple(engine_args), weight)


def spec_from_config(entry: LaunchWorker, index: int) -> WorkerSpec:
    """A :class:`WorkerSpec` from one ``workers:`` entry of the config (:class:`launcher.config.LaunchWorker`)."""
    return make_spec(model=entry.model, engine=entry.engine, gpus=entry.gpus, count=entry.count,
                     engine_url=entry.engine_url, engine_args=list(entry.engine_args), weight=entry.weight,
                     where=f"workers[{index}]")


def plan_workers(specs: list[WorkerSpec], *, default_engine: str | None = None, default_model: str | None = None,
                 discovered_gpus: list[int] | None = None, engine_args: list[str] | None = None) -> list[WorkerPlan]:
    """Every worker's plan, in spec order; raises :class:`UsageError` / ``GpuPlanError``.

    ``default_engine``/``default_model``: the launcher's ``--engine``/``--model`` for specs that
    name none; ``discovered_gpus``: the box's GPUs, used by a single spec without ``gpus``;
    ``engine_args``: the launcher's ``-- ...`` arguments, given to every worker first."""
    plans: list[WorkerPlan] = []
    owner: dict[int, int] = {}
    for i, sp in enumerate(specs):
        model = sp.model or default_model
        explicit = sp.gpus is not None
        if explicit:
            gpus = parse_gpu_list(sp.gpus or "")
        elif len(specs) == 1:
            gpus = list(discovered_gpus or [])
        else:
            gpus = []
        engine = choose_engine(sp.engine or default_engine, bool(gpus), model, gpus_explicit=explicit or len(specs) > 1)
        if engine == "sim" and not explicit:
            gpus = []
        if ENGINE_TABLE[engine].needs_gpus and not gpus:
            raise UsageError(f"worker spec {i + 1} ({model}): engine {engine} needs gpus=... when several specs "
                             f"share the box")
        if not ENGINE_TABLE[engine].spawns and not sp.engine_url:
            raise UsageError(f"worker spec {i + 1}: engine openai needs url=... (the server to attach to)")
        if ENGINE_TABLE[engine].spawns and sp.engine_url:
            raise UsageError(f"worker spec {i + 1}: url=... is only for engine openai")
        for g in gpus:
            if g in owner:
                raise UsageError(f"GPU {g} is given to worker spec {owner[g] + 1} and to worker spec {i + 1}")
            owner[g] = i
        plan = plan_gpus(gpus, sp.count)
        for k in range(sp.count):
            plans.append(WorkerPlan(engine=engine, model=model, gpus=list(plan.groups[k]),
                                    tp_size=plan.tp_size if plan.groups[k] else 1, engine_url=sp.engine_url,
                                    engine_args=[*(engine_args or []), *sp.engine_args], weight=sp.weight))
    return plans


__all__ = ["KEYS", "WorkerPlan", "WorkerSpec", "make_spec", "parse_worker_spec", "plan_workers", "spec_from_config"]
