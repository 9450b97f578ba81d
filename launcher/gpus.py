"""GPU discovery and planning: which GPUs each worker (one engine each) gets.

The plan follows the data-parallel × tensor-parallel layout of vLLM and SGLang deployments:
M GPUs for N workers give N groups of M/N consecutive GPUs, and every engine is started with
tensor-parallel size M/N (e.g. 8 GPUs, 4 workers → [0,1] [2,3] [4,5] [6,7], tp 2). An uneven
split (M % N != 0) or fewer GPUs than workers is refused with :class:`GpuPlanError` instead of
leaving GPUs idle or doubling engines up on one GPU.

Discovery order: NVML (``nvidia-ml-py``: ``nvmlDeviceGetCount``), then ``nvidia-smi -L`` (lines
``GPU <i>: <name> (UUID: ...)``); none → no GPU (the simulated engine runs on the CPU).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from launcher.errors import GpuPlanError, UsageError
from worker_agent.engines import ENGINE_NAMES
from worker_agent.engines import ENGINES as ENGINE_TABLE

ENGINES = ENGINE_NAMES  # the engine table's (worker_agent/engines.py)
_SMI_LINE = re.compile(r"^GPU (\d+):", re.MULTILINE)


def discover_gpus() -> list[int]:
    """Return the ids (0..M-1) of every GPU the NVIDIA driver sees; ``[]`` when there is none.

    Tries NVML first, then ``nvidia-smi -L`` on ``PATH``; any failure of either (no driver, no
    binary, timeout) counts as "no GPU from that source". Never raises.
    """
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no library / no driver / no device: ask nvidia-smi
        count = 0
    return list(range(count)) if count > 0 else gpus_from_nvidia_smi()


def gpus_from_nvidia_smi(binary: str = "nvidia-smi", timeout_s: float = 10.0) -> list[int]:
    """Parse ``nvidia-smi -L``; ``[]`` when the binary is missing, fails or lists nothing."""
    exe = shutil.which(binary)
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return sorted({int(m) for m in _SMI_LINE.findall(out.stdout)})


def parse_gpu_list(text: str) -> list[int]:
    """Parse ``--gpus``: comma-separated ids and inclusive ranges, e.g. ``"0,1,4-7"``.

    Returns the ids in the order given. ``""`` or ``"none"`` → ``[]`` (run without GPUs).
    Raises :class:`UsageError` on a non-integer, a negative id, a reversed range or a duplicate.
    """
    text = text.strip()
    if text.lower() in ("", "none"):
        return []
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise UsageError(f"--gpus: {part!r} is not a GPU id or range (expected e.g. 0,1,4-7)")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise UsageError(f"--gpus: range {part!r} runs backwards")
        ids.extend(range(lo, hi + 1))
    dup = sorted({g for g in ids if ids.count(g) > 1})
    if dup:
        raise UsageError(f"--gpus: GPU {dup[0]} is listed more than once")
    return ids


@dataclass(frozen=True)
class GpuPlan:
    """GPU groups for ``num_workers`` workers.

    ``groups[k]`` is worker k's GPU ids (``[]`` when running without GPUs); ``tp_size`` is the
    tensor-parallel size every engine is started with (len of each group, 1 without GPUs).
    """

    num_workers: int
    groups: list[list[int]] = field(default_factory=list)
    tp_size: int = 1

    def cuda_visible_devices(self, worker: int) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` for worker ``worker`` (``"0,1"``), or None without GPUs."""
        g = self.groups[worker]
        return ",".join(str(i) for i in g) if g else None


def plan_gpus(gpus: list[int], num_workers: int) -> GpuPlan:
    """Split ``gpus`` into ``num_workers`` equal groups of consecutive entries.

    ``gpus=[]`` → every worker gets no GPU, tp 1. Raises :class:`UsageError` when
    ``num_workers < 1`` and :class:`GpuPlanError` when ``len(gpus) < num_workers`` or
    ``len(gpus) % num_workers != 0`` (the message suggests worker counts that divide evenly).
    """
    if num_workers < 1:
        raise UsageError(f"--num-workers must be at least 1 (got {num_workers})")
    m = len(gpus)
    if m == 0:
        return GpuPlan(num_workers=num_workers, groups=[[] for _ in range(num_workers)], tp_size=1)
    if m < num_workers or m % num_workers:
        fits = [n for n in range(1, m + 1) if m % n == 0]
        why = ("fewer GPUs than workers" if m < num_workers
               else f"{m} is not a multiple of {num_workers}, so the groups would be uneven")
        raise GpuPlanError(
            f"cannot split {m} GPU(s) {gpus} into {num_workers} worker(s): {why}. "
            f"Use --num-workers in {fits} or pass --gpus with a multiple of {num_workers} GPUs.",
            gpus, num_workers)
    tp = m // num_workers
    return GpuPlan(num_workers=num_workers, groups=[list(gpus[k * tp:(k + 1) * tp]) for k in range(num_workers)],
                   tp_size=tp)


def choose_engine(engine: str | None, have_gpus: bool, model: str | None, gpus_explicit: bool = False) -> str:
    """Resolve ``--engine``: ``vllm`` when GPUs and ``--model`` are given, ``sim`` when neither is.

    Raises :class:`UsageError` for an unknown engine, for ``vllm``/``sglang`` without ``--model``,
    and for ``--model`` on a machine without GPUs (none found by NVML or ``nvidia-smi``, or
    ``--gpus none``) unless ``--engine`` is given: simulated engines answering under a real model's
    name would pass for the real thing, so that takes an explicit ``--engine sim``.
    """
    if engine is None:
        if model and not have_gpus:
            where = ("--gpus none was given" if gpus_explicit
                     else "no GPU was found by NVML (nvidia-ml-py) or `nvidia-smi -L`")
            raise UsageError(
                f"--model {model} needs GPUs for a real engine, but {where}. Pass --engine sim to serve "
                f"simulated engines under that name on purpose, or --engine vllm/sglang with --gpus on a "
                f"machine that has them.")
        return "vllm" if (have_gpus and model) else "sim"
    if engine not in ENGINES:
        raise UsageError(f"--engine must be one of {', '.join(ENGINES)} (got {engine!r})")
    if ENGINE_TABLE[engine].needs_model and not model:
        raise UsageError(f"--engine {engine} needs --model (a Hugging Face id or a local model folder)")
    return engine
