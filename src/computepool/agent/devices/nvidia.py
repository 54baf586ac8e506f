"""NVIDIA GPUs through NVML (nvidia-ml-py).

`pynvml` is imported inside the backend, never at module import, so this module loads on any
machine; without the library or the driver the backend is simply unavailable and says why.
Everything here only reads: it never changes MIG mode, clocks or any other GPU setting.

Usage carries each GPU's power (`nvmlDeviceGetPowerUsage`, mW) and total-energy counter
(`nvmlDeviceGetTotalEnergyConsumption`, mJ since the driver loaded; None on boards without
one), and its health: "" unless an NVML query for the device fails (NotSupported is not a
failure) or the driver reported a critical XID event for its GPU. XIDs are watched through one
NVML event set per GPU, polled without waiting at each usage; the XIDs that come from the
application rather than the board (13, 31, 43, 45, 68, 109: the set NVIDIA's Kubernetes device
plugin also skips) are ignored, and any other stays reported until the agent restarts, as the
GPU needs a reset then anyway. A MIG instance reports no power or energy: NVML gives them per
GPU, and the GPU draws for all its instances; its health is its GPU's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.core.quantities import MILLI_PER_DEVICE

MIB = 1024 * 1024
T = TypeVar("T")
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})  # a job's fault, not the board's
MAX_EVENTS_PER_POLL = 64
NVML_ERROR_NOT_SUPPORTED = 3  # nvml.h; nvidia-ml-py names it too


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
        self._known: list[DeviceInfo] = []  # as last enumerated: what a failed usage() reports on
        self._event_sets: dict[str, Any] = {}  # GPU uuid → its XID event set (None: not supported)
        self._xids: dict[str, list[int]] = {}  # GPU uuid → the critical XIDs seen on it
        self._events_lock = threading.Lock()  # usage() runs on the heartbeat and watchdog threads

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
            for es in self._event_sets.values():
                if es is not None:
                    _try(self._nvml.nvmlEventSetFree, None, es)
            _try(self._nvml.nvmlShutdown, None)
        self._event_sets = {}
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

    def _enumerate(self, nv: ModuleType, gpus: list[_Gpu] | None = None) -> list[tuple[DeviceInfo, Any]]:
        """Schedulable devices in a stable order, with their NVML handles (no link groups yet)."""
        out: list[tuple[DeviceInfo, Any]] = []
        for gpu in self._gpus(nv) if gpus is None else gpus:
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
        self._known = [info for info, _ in devices]
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
            gpus = self._gpus(nv)
            devices = self._enumerate(nv, gpus)
        except Exception as e:
            # a GPU fallen off the bus fails the enumeration: say so on every device we know of
            self._reason = f"NVML usage failed: {e}"
            why = f"NVML cannot enumerate the GPUs: {e}"
            return [DeviceUsage(d.index, d.uuid, None, 0, health=why) for d in self._known]
        self._known = [info for info, _ in devices]
        self._poll_xids(nv, gpus)
        gpu_of = {g.physical_index: g for g in gpus}
        out = []
        for info, h in devices:
            failed: list[str] = []
            util = None
            if not info.is_mig:
                util = _query(nv, failed, "nvmlDeviceGetUtilizationRates", _utilization, h)
            used = _query(nv, failed, "nvmlDeviceGetMemoryInfo", _memory_used, h)
            power = energy = None
            if not info.is_mig:
                power = _query(nv, failed, "nvmlDeviceGetPowerUsage", _power_w, h)
                energy = _query(nv, failed, "nvmlDeviceGetTotalEnergyConsumption", _energy_j, h)
            gpu = gpu_of.get(info.physical_index)
            if gpu is not None and self._xids.get(gpu.uuid):
                xids = ", ".join(str(x) for x in self._xids[gpu.uuid])
                failed.append(f"the driver reported critical XID {xids}")
            out.append(
                DeviceUsage(
                    info.index,
                    info.uuid,
                    util,
                    used or 0,
                    _processes(nv, h),
                    power_w=power,
                    energy_j=energy,
                    health="; ".join(failed)[:256],
                )
            )
        return out

    def _poll_xids(self, nv: ModuleType, gpus: list[_Gpu]) -> None:
        """Read, without waiting, the XID events each GPU's event set holds (registering the set
        the first time; a GPU or driver that cannot deliver them is skipped quietly)."""
        with self._events_lock:
            for g in gpus:
                self._poll_gpu_xids(nv, g)

    def _poll_gpu_xids(self, nv: ModuleType, g: _Gpu) -> None:
        if g.uuid not in self._event_sets:
            self._event_sets[g.uuid] = _xid_event_set(nv, g.handle)
        es = self._event_sets[g.uuid]
        if es is None:
            return
        for _ in range(MAX_EVENTS_PER_POLL):
            try:
                data = nv.nvmlEventSetWait(es, 0)
            except Exception:
                return  # NVML_ERROR_TIMEOUT: nothing (more) waiting
            xid = int(data.eventData)
            seen = self._xids.setdefault(g.uuid, [])
            if xid not in APPLICATION_XIDS and xid not in seen:
                seen.append(xid)


def _xid_event_set(nv: ModuleType, handle: Any) -> Any:
    """An event set that collects this GPU's critical XID events, or None where unsupported."""
    try:
        es = nv.nvmlEventSetCreate()
    except Exception:
        return None
    try:
        nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, es)
    except Exception:
        _try(nv.nvmlEventSetFree, None, es)
        return None
    return es


def _not_supported(nv: ModuleType, e: Exception) -> bool:
    """The board has no such query (or the bindings predate it): not a failure of the device."""
    if isinstance(e, AttributeError):
        return True
    return getattr(e, "value", None) == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED)


def _query(
    nv: ModuleType, failed: list[str], name: str, fn: Callable[[ModuleType, Any], T], h: Any
) -> T | None:
    """`fn(nv, h)`, or None; a failure other than NotSupported is added to `failed`, named."""
    try:
        return fn(nv, h)
    except Exception as e:
        if not _not_supported(nv, e):
            failed.append(f"{name} failed: {e or type(e).__name__}")
        return None


def _power_w(nv: ModuleType, handle: Any) -> float:
    return float(nv.nvmlDeviceGetPowerUsage(handle)) / 1000.0


def _energy_j(nv: ModuleType, handle: Any) -> float:
    return float(nv.nvmlDeviceGetTotalEnergyConsumption(handle)) / 1000.0


def _utilization(nv: ModuleType, handle: Any) -> float:
    return float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)


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
