"""NVML: missing is graceful (unknown = -1, logged once); a fake pynvml's figures are summed."""
from __future__ import annotations

import logging
import sys
import types

from worker_agent.nvml import UNKNOWN, GpuMemoryProbe

GiB = 1 << 30


def fake_pynvml(mem: dict[int, tuple[int, int]], fail_init: bool = False) -> types.ModuleType:
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class Mem:
        def __init__(self, used, total):
            self.used, self.total, self.free = used, total, total - used

    m.NVMLError = NVMLError
    m.calls = []

    def nvmlInit():
        m.calls.append("init")
        if fail_init:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetHandleByIndex(i):
        if i not in mem:
            raise NVMLError("Invalid Argument")
        return i

    m.nvmlInit = nvmlInit
    m.nvmlDeviceGetHandleByIndex = nvmlDeviceGetHandleByIndex
    m.nvmlDeviceGetMemoryInfo = lambda h: Mem(*mem[h])
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    return m


def test_fake_nvml_figures_summed_over_gpus(monkeypatch):
    fake = fake_pynvml({0: (10 * GiB, 80 * GiB), 1: (20 * GiB, 80 * GiB), 2: (1, 2)})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    p = GpuMemoryProbe([0, 1])
    assert p.read() == (30 * GiB, 160 * GiB)
    assert p.available
    p.close()
    assert fake.calls == ["init", "shutdown"]


def test_missing_module_is_unknown_and_logged_once(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)   # import raises ImportError
    p = GpuMemoryProbe([0])
    with caplog.at_level(logging.WARNING, logger="worker_agent.nvml"):
        assert p.read() == (UNKNOWN, UNKNOWN)
        assert p.read() == (UNKNOWN, UNKNOWN)
    assert not p.available
    assert len([r for r in caplog.records if "NVML unavailable" in r.message]) == 1
    p.close()


def test_driver_failure_and_bad_index_are_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({0: (1, 2)}, fail_init=True))
    assert GpuMemoryProbe([0]).read() == (UNKNOWN, UNKNOWN)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml({0: (1, 2)}))
    p = GpuMemoryProbe([5])
    assert p.read() == (UNKNOWN, UNKNOWN) and "Invalid Argument" in (p.reason or "")


def test_no_gpus_never_touches_nvml(monkeypatch):
    fake = fake_pynvml({})
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    p = GpuMemoryProbe([])
    assert p.read() == (UNKNOWN, UNKNOWN) and fake.calls == []
