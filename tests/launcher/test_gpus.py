"""GPU discovery and planning (launcher.gpus) with fake GPU lists and a fake nvidia-smi."""
from __future__ import annotations

import os
import stat

import pytest

from launcher.errors import GpuPlanError, UsageError
from launcher.gpus import (
    choose_engine,
    discover_gpus,
    gpus_from_nvidia_smi,
    parse_gpu_list,
    plan_gpus,
)


@pytest.mark.parametrize("gpus,n,groups,tp", [
    (list(range(8)), 4, [[0, 1], [2, 3], [4, 5], [6, 7]], 2),
    (list(range(8)), 8, [[i] for i in range(8)], 1),
    (list(range(8)), 1, [list(range(8))], 8),
    (list(range(8)), 2, [[0, 1, 2, 3], [4, 5, 6, 7]], 4),
    ([0, 1, 2, 3], 2, [[0, 1], [2, 3]], 2),
    ([4, 5, 6, 7], 2, [[4, 5], [6, 7]], 2),
    ([3, 1], 2, [[3], [1]], 1),
    ([], 4, [[], [], [], []], 1),
])
def test_plan_splits_into_equal_consecutive_groups(gpus, n, groups, tp):
    plan = plan_gpus(gpus, n)
    assert plan.groups == groups and plan.tp_size == tp and plan.num_workers == n


@pytest.mark.parametrize("gpus,n,why", [
    ([0, 1, 2], 2, "not a multiple of 2"),
    (list(range(8)), 3, "not a multiple of 3"),
    ([0], 2, "fewer GPUs than workers"),
    (list(range(4)), 8, "fewer GPUs than workers"),
])
def test_impossible_splits_are_clear_errors(gpus, n, why):
    with pytest.raises(GpuPlanError) as ei:
        plan_gpus(gpus, n)
    assert why in str(ei.value) and ei.value.num_workers == n and ei.value.gpus == gpus
    assert ei.value.exit_code == 2


def test_plan_suggests_worker_counts_that_fit():
    with pytest.raises(GpuPlanError, match=r"\[1, 2, 3, 6\]"):
        plan_gpus(list(range(6)), 4)


def test_zero_workers_refused():
    with pytest.raises(UsageError):
        plan_gpus([0, 1], 0)


def test_cuda_visible_devices():
    plan = plan_gpus(list(range(8)), 4)
    assert [plan.cuda_visible_devices(k) for k in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert plan_gpus([], 2).cuda_visible_devices(1) is None


@pytest.mark.parametrize("text,ids", [("0,1,2,3", [0, 1, 2, 3]), ("0-3", [0, 1, 2, 3]), ("4-5,0", [4, 5, 0]),
                                      (" 2 , 3 ", [2, 3]), ("", []), ("none", [])])
def test_parse_gpu_list(text, ids):
    assert parse_gpu_list(text) == ids


@pytest.mark.parametrize("text,msg", [("a", "not a GPU id"), ("-1", "not a GPU id"), ("3-1", "backwards"),
                                      ("0,0", "more than once"), ("0-2,1", "more than once")])
def test_parse_gpu_list_errors(text, msg):
    with pytest.raises(UsageError, match=msg):
        parse_gpu_list(text)


@pytest.mark.parametrize("engine,gpus,model,want", [
    (None, True, "meta-llama/Llama-3.1-8B", "vllm"),
    (None, True, None, "sim"),
    (None, False, None, "sim"),
    ("sim", False, "meta-llama/Llama-3.1-8B", "sim"),
    ("sglang", True, "m", "sglang"),
    ("sim", True, "m", "sim"),
])
def test_choose_engine_defaults(engine, gpus, model, want):
    assert choose_engine(engine, gpus, model) == want


def test_choose_engine_errors():
    with pytest.raises(UsageError, match="needs --model"):
        choose_engine("vllm", True, None)
    with pytest.raises(UsageError, match="one of"):
        choose_engine("trt", True, "m")


@pytest.mark.parametrize("explicit,why", [(False, "no GPU was found by NVML"), (True, "--gpus none was given")])
def test_model_without_gpu_is_an_error_unless_sim_is_asked_for(explicit, why):
    # regression (issue 11): --model M on a GPU-less machine started sim engines answering as M
    with pytest.raises(UsageError, match="--engine sim") as e:
        choose_engine(None, False, "meta-llama/Llama-3.1-8B", gpus_explicit=explicit)
    assert why in str(e.value) and "meta-llama/Llama-3.1-8B" in str(e.value)


def _fake_smi(tmp_path, text: str, rc: int = 0) -> str:
    d = tmp_path / "bin"
    d.mkdir()
    p = d / "nvidia-smi"
    p.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 9\ncat <<'X'\n{text}X\nexit {rc}\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(d)


SMI_4 = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n"
         "GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-cccc)\nGPU 3: NVIDIA H100 80GB HBM3 (UUID: GPU-dddd)\n")


def test_nvidia_smi_listing_parsed(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, SMI_4) + os.pathsep + os.environ["PATH"])
    assert gpus_from_nvidia_smi() == [0, 1, 2, 3]


def test_nvidia_smi_failure_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, "NVIDIA-SMI has failed\n", rc=9))
    assert gpus_from_nvidia_smi() == []
    monkeypatch.setenv("PATH", str(tmp_path / "nothing-here"))
    assert gpus_from_nvidia_smi() == []


def test_discover_falls_back_to_nvidia_smi_without_nvml(tmp_path, monkeypatch):
    import pynvml

    def no_nvml() -> None:
        raise pynvml.NVMLError_LibraryNotFound()

    monkeypatch.setattr(pynvml, "nvmlInit", no_nvml)
    monkeypatch.setenv("PATH", _fake_smi(tmp_path, SMI_4) + os.pathsep + os.environ["PATH"])
    assert discover_gpus() == [0, 1, 2, 3]


def test_discover_prefers_nvml(monkeypatch):
    import pynvml

    monkeypatch.setattr(pynvml, "nvmlInit", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: None)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 8)
    assert discover_gpus() == list(range(8))
