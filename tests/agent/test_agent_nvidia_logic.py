"""The NVIDIA backend's logic (MIG shares, NVLink groups, process memory) against a stand-in NVML.

Real NVML is checked by scripts/gpu-check.sh on a GPU machine; this stand-in only answers the
calls the backend makes, the way the nvidia-ml-py documentation describes them.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest

from computepool.agent.devices import NvidiaBackend

MIB = 1024 * 1024


class NVMLError(Exception):
    pass


@dataclass
class Dev:
    uuid: str
    name: str
    mem_mib: int
    bus: str
    mig: bool = False
    links: list[str] = field(default_factory=list)  # remote bus ids of active links
    children: list[Dev] = field(default_factory=list)
    slices: int = 0
    procs: dict[int, int] = field(default_factory=dict)
    used_mib: int = 0


def fake_nvml() -> types.ModuleType:
    gpus = [
        Dev(
            "GPU-0",
            "NVIDIA H100 80GB HBM3",
            81559,
            "00000000:1A:00.0",
            links=["00000000:2A:00.0", "00000000:F0:00.0"],
        ),
        Dev(
            "GPU-1",
            "NVIDIA H100 80GB HBM3",
            81559,
            "00000000:2A:00.0",
            links=["00000000:1A:00.0"],
            procs={11: 2048},
        ),
        Dev("GPU-2", "NVIDIA A100-SXM4-80GB", 81920, "00000000:3A:00.0", mig=True),
    ]
    gpus[2].children = [
        Dev("MIG-a", "NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40192, "", slices=3, procs={22: 1000}),
        Dev("MIG-b", "NVIDIA A100-SXM4-80GB MIG 1g.10gb", 9728, "", slices=1),
    ]
    m = types.ModuleType("pynvml")
    ns = types.SimpleNamespace
    m.NVMLError = NVMLError  # type: ignore[attr-defined]
    m.NVML_DEVICE_MIG_ENABLE = 1  # type: ignore[attr-defined]
    m.NVML_FEATURE_ENABLED = 1  # type: ignore[attr-defined]
    m.NVML_NVLINK_MAX_LINKS = 4  # type: ignore[attr-defined]
    m.NVML_GPU_INSTANCE_PROFILE_COUNT = 3  # type: ignore[attr-defined]
    funcs = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: len(gpus),
        "nvmlDeviceGetHandleByIndex": lambda i: gpus[i],
        "nvmlDeviceGetUUID": lambda d: d.uuid.encode(),
        "nvmlDeviceGetName": lambda d: d.name,
        "nvmlDeviceGetMemoryInfo": lambda d: ns(total=d.mem_mib * MIB, used=d.used_mib * MIB),
        "nvmlDeviceGetMigMode": lambda d: (int(d.mig), int(d.mig)),
        "nvmlDeviceGetPciInfo": lambda d: ns(busId=d.bus.encode()),
        "nvmlDeviceGetCudaComputeCapability": lambda d: (9, 0) if "H100" in d.name else (8, 0),
        "nvmlDeviceGetMaxMigDeviceCount": lambda d: 7,
        "nvmlDeviceGetAttributes": lambda d: ns(gpuInstanceSliceCount=d.slices),
        "nvmlDeviceGetGpuInstanceProfileInfo": lambda d, p: ns(sliceCount=[1, 3, 7][p]),
        "nvmlDeviceGetUtilizationRates": lambda d: ns(gpu=42),
        "nvmlDeviceGetComputeRunningProcesses": lambda d: [
            ns(pid=p, usedGpuMemory=v * MIB) for p, v in d.procs.items()
        ],
    }

    def numa(d: Dev) -> int:
        raise NVMLError("Not Supported")  # older drivers: the backend falls back to sysfs

    def mig_handle(d: Dev, j: int) -> Dev:
        if j >= len(d.children):
            raise NVMLError("Not Found")
        return d.children[j]

    def link_state(d: Dev, link: int) -> int:
        if link >= len(d.links):
            raise NVMLError("Invalid Argument")
        return 1

    funcs |= {
        "nvmlDeviceGetNumaNodeId": numa,
        "nvmlDeviceGetMigDeviceHandleByIndex": mig_handle,
        "nvmlDeviceGetNvLinkState": link_state,
        "nvmlDeviceGetNvLinkRemotePciInfo": lambda d, link: ns(busId=d.links[link].encode()),
    }
    for name, fn in funcs.items():
        setattr(m, name, fn)
    m.gpus = gpus  # type: ignore[attr-defined]
    return m


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    m = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return m


def test_discovery_reports_gpus_mig_instances_and_link_groups(nvml: types.ModuleType) -> None:
    backend = NvidiaBackend()
    assert backend.available() and backend.reason == ""
    devices = backend.discover()
    got = [
        (d.index, d.model, d.memory_mib, d.uuid, d.compute_milli, d.link_group, d.mig_parent_uuid)
        for d in devices
    ]
    assert got == [
        (0, "H100-80GB-HBM3", 81559, "GPU-0", 1000, "nvlink-0", None),
        (1, "H100-80GB-HBM3", 81559, "GPU-1", 1000, "nvlink-0", None),
        (2, "A100-SXM4-80GB-MIG-3g.40gb", 40192, "MIG-a", 429, "", "GPU-2"),
        (3, "A100-SXM4-80GB-MIG-1g.10gb", 9728, "MIG-b", 143, "", "GPU-2"),
    ]
    assert [d.compute_capability for d in devices] == ["9.0", "9.0", "8.0", "8.0"]
    assert [d.physical_index for d in devices] == [0, 1, 2, 2]
    assert backend.mig_modes() == {"GPU-0": False, "GPU-1": False, "GPU-2": True}


def test_usage_reports_per_process_memory(nvml: types.ModuleType) -> None:
    nvml.gpus[1].used_mib = 2600
    usage = NvidiaBackend().usage()
    assert [(u.index, u.utilization_pct, u.memory_used_mib, u.process_memory_mib) for u in usage] == [
        (0, 42.0, 0, {}),
        (1, 42.0, 2600, {11: 2048}),
        (2, None, 0, {22: 1000}),  # no utilisation per MIG instance
        (3, None, 0, {}),
    ]


def test_a_failing_driver_is_a_reason_not_an_exception(nvml: types.ModuleType) -> None:
    def broken() -> None:
        raise NVMLError("Driver Not Loaded")

    nvml.nvmlInit = broken  # type: ignore[attr-defined]
    backend = NvidiaBackend()
    assert not backend.available()
    assert backend.reason == "NVML unavailable: Driver Not Loaded"
    assert backend.discover() == [] and backend.usage() == []
