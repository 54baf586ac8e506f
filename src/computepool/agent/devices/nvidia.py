"""NVIDIA GPUs through NVML (nvidia-ml-py).

`pynvml` is imported inside the backend, never at module import, so this module loads on any
machine; without the library or the driver the backend is simply unavailable and says why.
Everything here only reads: it never changes MIG mode, clocks or any other GPU setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.core.quantities import MILLI_PER_DEVICE

MIB = 1024 * 1024
T = TypeVar("T")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(fn: Callable[..., T], default: T, *args: Any) -> T:
    """NVML answers NotSupported for many queries on some boards; that is not an error to us."""
    try:
        return fn(*args)
    except Exception:
        return default


def normalize_model(name: str) -> str:
    """`NVIDIA A100-SXM4-80GB` → `A100-SXM4-80GB`: request model names cannot hold spaces (nor
    the `+` of a MIG profile such as `1g.10gb+me`, written `-me`)."""
    name = name.strip()
    if name.upper().startswith("NVIDIA "):
        name = name[len("NVIDIA ") :]
    return "-".join(name.replace("+", " ").split())


def normalize_bus_id(bus_id: str) -> str:
    """NVML's `00000000:3B:00.0` → sysfs's `0000:3b:00.0`."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if not sep:
        return bus_id
    return f"{domain[-4:].rjust(4, '0')}:{rest}"


def _numa_from_sysfs(bus_id: str) -> int:
    if not bus_id:
        return -1
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1
    return max(node, -1)


@dataclass(frozen=True)
class _Gpu:
    physical_index: int
    handle: Any
    uuid: str
    bus_id: str
    mig_enabled: bool


class NvidiaBackend:
    """GPUs and MIG instances as NVML sees them. A GPU in MIG mode is reported as its instances."""

    name = "nvidia"

    def __init__(self) -> None:
        self._nvml: ModuleType | None = None
        self._tried = False
        self._reason = ""

    @property
    def reason(self) -> str:
        self._init()
        return self._reason

    def _init(self) -> ModuleType | None:
        if self._tried:
            return self._nvml
        self._tried = True
        try:
            import pynvml
        except ImportError as e:
            self._reason = f"NVML not found: nvidia-ml-py is not installed ({e})"
            return None
        try:
            pynvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, _DriverNotLoaded, OSError, ...
            text = str(e) or type(e).__name__
            prefix = "NVML not found" if "not found" in text.lower() else "NVML unavailable"
            self._reason = f"{prefix}: {text}"
            return None
        count = _try(pynvml.nvmlDeviceGetCount, 0)
        if count == 0:
            self._reason = "NVML unavailable: the driver reports no NVIDIA GPU"
            _try(pynvml.nvmlShutdown, None)
            return None
        self._nvml = pynvml
        return pynvml

    def available(self) -> bool:
        return self._init() is not None

    def close(self) -> None:
        if self._nvml is not None:
            _try(self._nvml.nvmlShutdown, None)
        self._nvml = None
        self._tried = False

    def _gpus(self, nv: ModuleType) -> list[_Gpu]:
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mode = _try(nv.nvmlDeviceGetMigMode, (0, 0), h)[0]
            gpus.append(
                _Gpu(
                    physical_index=i,
                    handle=h,
                    uuid=_text(nv.nvmlDeviceGetUUID(h)),
                    bus_id=_try(_bus_id, "", nv, h),
                    mig_enabled=mode == nv.NVML_DEVICE_MIG_ENABLE,
                )
            )
        return gpus

    def _mig_handles(self, nv: ModuleType, gpu: _Gpu) -> list[Any]:
        handles = []
        for j in range(_try(nv.nvmlDeviceGetMaxMigDeviceCount, 0, gpu.handle)):
            with contextlib.suppress(Exception):  # NotFound: no instance in that slot
                handles.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, j))
        return handles

    def _enumerate(self, nv: ModuleType) -> list[tuple[DeviceInfo, Any]]:
        """Schedulable devices in a stable order, with their NVML handles (no link groups yet)."""
        out: list[tuple[DeviceInfo, Any]] = []
        for gpu in self._gpus(nv):
            h = gpu.handle
            cc = _try(_compute_capability, "", nv, h)
            numa = int(_try(nv.nvmlDeviceGetNumaNodeId, -1, h))
            if numa < 0:
                numa = _numa_from_sysfs(gpu.bus_id)
            if not gpu.mig_enabled:
                info = DeviceInfo(
                    index=len(out),
                    vendor="nvidia",
                    model=normalize_model(_text(nv.nvmlDeviceGetName(h))),
                    memory_mib=int(nv.nvmlDeviceGetMemoryInfo(h).total // MIB),
                    uuid=gpu.uuid,
                    physical_index=gpu.physical_index,
                    compute_capability=cc,
                    numa_node=numa,
                )
                out.append((info, h))
                continue
            total_slices = _total_slices(nv, h)
            for mh in self._mig_handles(nv, gpu):
                slices = _try(_instance_slices, 0, nv, mh)
                milli = round(MILLI_PER_DEVICE * slices / total_slices) if slices else 0
                info = DeviceInfo(
                    index=len(out),
                    vendor="nvidia",
                    model=normalize_model(_text(nv.nvmlDeviceGetName(mh))),
                    memory_mib=int(nv.nvmlDeviceGetMemoryInfo(mh).total // MIB),
                    uuid=_text(nv.nvmlDeviceGetUUID(mh)),
                    physical_index=gpu.physical_index,
                    compute_milli=milli,
                    compute_capability=cc,
                    numa_node=numa,
                    mig_parent_uuid=gpu.uuid,
                )
                out.append((info, mh))
        return out

    def discover(self) -> list[DeviceInfo]:
        nv = self._init()
        if nv is None:
            return []
        try:
            devices = self._enumerate(nv)
            groups = _link_groups(nv, self._gpus(nv))
        except Exception as e:
            self._reason = f"NVML discovery failed: {e}"
            return []
        return [replace(info, link_group=groups.get(info.physical_index, "")) for info, _ in devices]

    def mig_modes(self) -> dict[str, bool]:
        """GPU uuid → MIG mode enabled (read only)."""
        nv = self._init()
        if nv is None:
            return {}
        try:
            return {g.uuid: g.mig_enabled for g in self._gpus(nv)}
        except Exception:
            return {}

    def usage(self) -> list[DeviceUsage]:
        nv = self._init()
        if nv is None:
            return []
        try:
            devices = self._enumerate(nv)
        except Exception as e:
            self._reason = f"NVML usage failed: {e}"
            return []
        out = []
        for info, h in devices:
            util = None if info.is_mig else _utilization(nv, h)
            used = _try(_memory_used, 0, nv, h)
            out.append(DeviceUsage(info.index, info.uuid, util, used, _processes(nv, h)))
        return out


def _utilization(nv: ModuleType, handle: Any) -> float | None:
    return _try(lambda: float(nv.nvmlDeviceGetUtilizationRates(handle).gpu), None)


def _bus_id(nv: ModuleType, handle: Any) -> str:
    return normalize_bus_id(_text(nv.nvmlDeviceGetPciInfo(handle).busId))


def _compute_capability(nv: ModuleType, handle: Any) -> str:
    major, minor = nv.nvmlDeviceGetCudaComputeCapability(handle)
    return f"{major}.{minor}"


def _instance_slices(nv: ModuleType, mig_handle: Any) -> int:
    return int(nv.nvmlDeviceGetAttributes(mig_handle).gpuInstanceSliceCount)


def _memory_used(nv: ModuleType, handle: Any) -> int:
    return int(nv.nvmlDeviceGetMemoryInfo(handle).used // MIB)


def _remote_bus(nv: ModuleType, handle: Any, link: int) -> str:
    return normalize_bus_id(_text(nv.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))


def _total_slices(nv: ModuleType, handle: Any) -> int:
    """Slices of a whole GPU (7 on A100/H100, more on some boards): the largest profile's count."""
    best = 0
    for profile in range(getattr(nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)):
        info = _try(nv.nvmlDeviceGetGpuInstanceProfileInfo, None, handle, profile)
        if info is not None:
            best = max(best, int(info.sliceCount))
    return best or 7


def _processes(nv: ModuleType, handle: Any) -> dict[int, int]:
    """pid → MiB held on this device, compute and MPS clients together."""
    out: dict[int, int] = {}
    for names in (
        ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2"),
        ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2"),
    ):
        for name in names:
            fn = getattr(nv, name, None)
            if fn is None:
                continue
            try:
                procs = fn(handle)
            except Exception:
                continue
            for p in procs:
                mib = int(p.usedGpuMemory // MIB) if p.usedGpuMemory else 0
                out[int(p.pid)] = max(out.get(int(p.pid), 0), mib)
            break
    return out


def _link_groups(nv: ModuleType, gpus: list[_Gpu]) -> dict[int, str]:
    """physical index → `nvlink-<lowest index>` for GPUs joined by NVLink (directly or via NVSwitch).

    A link whose far end is not one of our GPUs is an NVSwitch: GPUs on the same switch join.
    """
    parent: dict[tuple[str, str], tuple[str, str]] = {}

    def find(k: tuple[str, str]) -> tuple[str, str]:
        parent.setdefault(k, k)
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    by_bus = {g.bus_id: g.physical_index for g in gpus if g.bus_id}
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    for g in gpus:
        me = ("gpu", str(g.physical_index))
        find(me)
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
            if _try(nv.nvmlDeviceGetNvLinkState, 0, g.handle, link) != enabled:
                continue
            far = _try(_remote_bus, "", nv, g.handle, link)
            if not far:
                continue
            other = ("gpu", str(by_bus[far])) if far in by_bus else ("pci", far)
            parent[find(me)] = find(other)
    members: dict[tuple[str, str], list[int]] = {}
    for g in gpus:
        members.setdefault(find(("gpu", str(g.physical_index))), []).append(g.physical_index)
    groups = {}
    for idx in members.values():
        if len(idx) > 1:
            for i in idx:
                groups[i] = f"nvlink-{min(idx)}"
    return groups
