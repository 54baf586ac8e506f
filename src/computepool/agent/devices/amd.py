"""AMD GPUs through AMD SMI's Python library (`amdsmi`, shipped with ROCm).

`amdsmi` is imported inside the backend, never at module import: without the library or the
driver the backend is unavailable and says why. Everything here only reads.

Each GPU is reported with its HIP index (`amdsmi_get_gpu_enumeration_info`'s `hip_id`, what
HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES take; the library's own order where the library is
older than that call), its market name without the `AMD Instinct` prefix (`MI300X`), VRAM, uuid,
PCI address, NUMA node, and an `xgmi-N` link group for GPUs joined by XGMI. Usage carries GFX
activity, VRAM used, socket power, the energy counter (accumulator × resolution, µJ) and each
process's VRAM; health is "" unless one of those queries fails for another reason than "not
supported".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any, TypeVar

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.agent.devices.nodes import amd_nodes
from computepool.agent.devices.tools import link_groups, model_name, number

MIB = 1024 * 1024
T = TypeVar("T")
XGMI = 2  # AmdSmiIoLinkType.XGMI in amdsmi's enum
NOT_SUPPORTED = 2  # AMDSMI_STATUS_NOT_SUPPORTED


def normalize_model(market_name: str) -> str:
    """`AMD Instinct MI300X` → `MI300X`; `AMD Radeon PRO W7900` → `Radeon-PRO-W7900`."""
    words = market_name.replace("(TM)", " ").replace("(R)", " ").split()
    while words and words[0].upper() in ("AMD", "INSTINCT"):
        words = words[1:]
    return model_name(words, "AMD-GPU")


def _try(fn: Callable[..., T], default: T, *args: Any) -> T:
    try:
        return fn(*args)
    except Exception:
        return default


def _not_supported(e: Exception) -> bool:
    return isinstance(e, AttributeError) or getattr(e, "err_code", None) == NOT_SUPPORTED


class AmdBackend:
    """AMD GPUs as AMD SMI sees them."""

    name = "amd"

    def __init__(self) -> None:
        self._smi: ModuleType | None = None
        self._tried = False
        self._reason = ""
        self._known: list[DeviceInfo] = []

    @property
    def reason(self) -> str:
        self._init()
        return self._reason

    def _init(self) -> ModuleType | None:
        if self._tried:
            return self._smi
        self._tried = True
        try:
            import amdsmi  # type: ignore[import-not-found, unused-ignore]
        except ImportError as e:
            self._reason = f"AMD SMI not found: the amdsmi Python library is not installed ({e})"
            return None
        except Exception as e:  # the binding loads libamd_smi.so at import: OSError without ROCm
            self._reason = f"AMD SMI not found: the amdsmi library does not load ({e})"
            return None
        try:
            amdsmi.amdsmi_init()
        except Exception as e:  # AmdSmiLibraryException: no driver, no libamd_smi.so
            self._reason = f"AMD SMI unavailable: {str(e) or type(e).__name__}"
            return None
        if not _try(amdsmi.amdsmi_get_processor_handles, []):
            self._reason = "AMD SMI unavailable: the driver reports no AMD GPU"
            _try(amdsmi.amdsmi_shut_down, None)
            return None
        self._smi = amdsmi
        return amdsmi

    def available(self) -> bool:
        return self._init() is not None

    def close(self) -> None:
        if self._smi is not None:
            _try(self._smi.amdsmi_shut_down, None)
        self._smi = None
        self._tried = False

    def discover(self) -> list[DeviceInfo]:
        smi = self._init()
        if smi is None:
            return []
        try:
            handles = list(smi.amdsmi_get_processor_handles())
            devices = [_device(smi, i, h) for i, h in enumerate(handles)]
        except Exception as e:
            self._reason = f"AMD SMI discovery failed: {e}"
            return []
        xgmi = int(getattr(getattr(smi, "AmdSmiIoLinkType", None), "XGMI", XGMI))
        pairs = [
            (i, j)
            for i in range(len(handles))
            for j in range(i + 1, len(handles))
            if _link_type(smi, handles[i], handles[j]) == xgmi
        ]
        groups = link_groups([d.physical_index for d in devices], _by_hip(devices, pairs), "xgmi")
        self._known = [replace(d, link_group=groups.get(d.physical_index, "")) for d in devices]
        return list(self._known)

    def usage(self) -> list[DeviceUsage]:
        smi = self._init()
        if smi is None:
            return []
        try:
            handles = list(smi.amdsmi_get_processor_handles())
        except Exception as e:
            why = f"AMD SMI cannot enumerate the GPUs: {e}"
            return [DeviceUsage(d.index, d.uuid, None, 0, health=why) for d in self._known]
        out = []
        for d, h in zip(self._known, handles, strict=False):
            failed: list[str] = []
            activity = _query(failed, "amdsmi_get_gpu_activity", smi.amdsmi_get_gpu_activity, h) or {}
            vram = _query(failed, "amdsmi_get_gpu_vram_usage", smi.amdsmi_get_gpu_vram_usage, h) or {}
            power = _query(failed, "amdsmi_get_power_info", smi.amdsmi_get_power_info, h) or {}
            energy = _query(failed, "amdsmi_get_energy_count", smi.amdsmi_get_energy_count, h) or {}
            procs = _query(failed, "amdsmi_get_gpu_process_list", smi.amdsmi_get_gpu_process_list, h) or []
            out.append(
                DeviceUsage(
                    d.index,
                    d.uuid,
                    number(activity.get("gfx_activity")),
                    int(number(vram.get("vram_used")) or 0),
                    process_vram(procs),
                    power_w=socket_power(power),
                    energy_j=energy_joules(energy),
                    health="; ".join(failed)[:256],
                )
            )
        return out


def _device(smi: ModuleType, i: int, h: Any) -> DeviceInfo:
    asic = smi.amdsmi_get_gpu_asic_info(h)
    vram = smi.amdsmi_get_gpu_vram_info(h)
    bus = str(_try(smi.amdsmi_get_gpu_device_bdf, "", h)).lower()
    enum: dict[str, Any] = _optional(smi, "amdsmi_get_gpu_enumeration_info", h) or {}  # ROCm 6.4+
    hip = number(enum.get("hip_id"))
    render = number(enum.get("drm_render"))
    numa = number(_optional(smi, "amdsmi_topo_get_numa_node_number", h))
    return DeviceInfo(
        index=i,
        vendor="amd",
        model=normalize_model(str(asic.get("market_name", ""))),
        memory_mib=int(number(vram.get("vram_size")) or 0),
        uuid=str(smi.amdsmi_get_gpu_device_uuid(h)),
        physical_index=int(hip) if hip is not None else i,
        compute_capability=str(asic.get("target_graphics_version", "")),
        numa_node=int(numa) if numa is not None and numa >= 0 else -1,
        dev_nodes=amd_nodes(bus, int(render) if render is not None else None),
        cores=int(number(asic.get("num_compute_units")) or 0),
    )


def _optional(smi: ModuleType, name: str, h: Any) -> Any:
    """`smi.name(h)`, or None where the library lacks the call or the board the answer."""
    fn = getattr(smi, name, None)
    return None if fn is None else _try(fn, None, h)


def _by_hip(devices: list[DeviceInfo], pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(devices[a].physical_index, devices[b].physical_index) for a, b in pairs]


def _link_type(smi: ModuleType, a: Any, b: Any) -> int | None:
    with contextlib.suppress(Exception):
        got = smi.amdsmi_topo_get_link_type(a, b)
        kind = got.get("type") if isinstance(got, dict) else None
        return int(kind) if kind is not None else None
    return None


def _query(failed: list[str], name: str, fn: Callable[[Any], T], h: Any) -> T | None:
    try:
        return fn(h)
    except Exception as e:
        if not _not_supported(e):
            failed.append(f"{name} failed: {e or type(e).__name__}")
        return None


def socket_power(info: dict[str, Any]) -> float | None:
    """Watts now (`current_socket_power`; MI300 and later), else the average the board reports;
    amdsmi writes "N/A" where the board has neither."""
    for key in ("current_socket_power", "average_socket_power"):
        w = number(info.get(key))
        if w is not None:
            return w
    return None


def energy_joules(info: dict[str, Any]) -> float | None:
    """The energy counter in joules: accumulator ticks × `counter_resolution` (µJ per tick)."""
    ticks = number(info.get("energy_accumulator", info.get("power")))
    resolution = number(info.get("counter_resolution"))
    if ticks is None or resolution is None:
        return None
    return ticks * resolution / 1e6


def process_vram(procs: object) -> dict[int, int]:
    """pid → MiB of VRAM, from `amdsmi_get_gpu_process_list`'s dicts (bytes in `memory_usage`)."""
    out: dict[int, int] = {}
    if not isinstance(procs, list):
        return out
    for p in procs:
        if not isinstance(p, dict):
            continue
        pid = number(p.get("pid"))
        mem = p.get("memory_usage")
        vram = number(mem.get("vram_mem")) if isinstance(mem, dict) else number(p.get("mem"))
        if pid is not None:
            out[int(pid)] = int((vram or 0) // MIB)
    return out
