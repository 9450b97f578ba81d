"""DPLB launcher: GPU planning and the supervisor behind ``scripts/launch_dplb.sh``.

``python -m launcher --num-workers N ...`` plans GPUs (:mod:`launcher.gpus`), creates the
segment, starts the router and N worker agents and supervises them
(:mod:`launcher.supervisor`); :mod:`launcher.cli` holds the command line.
"""
from launcher.errors import (
           ChildStartError,
           GpuPlanError,
           LaunchError,
           StartTimeoutError,
           UsageError,
)
from launcher.gpus import (
           GpuPlan,
           choose_engine,
           discover_gpus,
           parse_gpu_list,
           plan_gpus,
)

__all__ = ["ChildStartError", "GpuPlan", "GpuPlanError", "LaunchError", "StartTimeoutError", "UsageError",
           "choose_engine", "discover_gpus", "parse_gpu_list", "plan_gpus"]
