"""Intel data-center and Arc GPUs through Intel's XPU System Management Interface (`xpu-smi`).

No maintained Python binding of Level Zero's sysman exists, so the backend reads the tool's JSON:
`xpu-smi discovery -j` lists the devices (id, name, uuid, PCI address), `xpu-smi discovery -d N -j`
gives each one's memory, and `xpu-smi stats -d N -j` its load (GPU utilization, power in W,
memory used in MiB), at device level or, on multi-tile GPUs, per tile (summed; utilization
averaged). The device id is what ZE_AFFINITY_MASK takes. GPUs joined by Xe Link (an `XL` cell
between two of their tiles in `xpu-smi topology -m`; a failure there only leaves the groups out)
share an `xelink-N` group. Without the tool the backend is unavailable and says why. Health is ""
unless a stats call fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.agent.devices.nodes import intel_nodes
from computepool.agent.devices.tools import ToolError, link_groups, model_name, number, run_tool

MIB = 1024 * 1024
TOOL = "xpu-smi"
_TILE = re.compile(r"GPU\s+(\d+)/(\d+)")


@dataclass(frozen=True)
class XpuDevice:
    device_id: int
    name: str
    uuid: str
    bus_id: str


@dataclass(frozen=True)
class XpuStats:
    utilization_pct: float | None
    memory_used_mib: int
    power_w: float | None


def normalize_model(name: str) -> str:
    """`Intel(R) Data Center GPU Max 1550` → `Max-1550`; `Intel(R) Arc(TM) A770 Graphics` → `Arc-A770`."""
    for junk in ("(R)", "(TM)", "[", "]"):
        name = name.replace(junk, " ")
    words = name.split()
    if words and words[0].lower() == "intel":
        words = words[1:]
    if words[:3] == ["Data", "Center", "GPU"]:
        words = words[3:]
    if len(words) > 1 and words[-1] == "Graphics":
        words = words[:-1]
    return model_name(words, "Intel-GPU")


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ToolError(f"{what} printed no JSON ({e})") from None


def parse_discovery(text: str) -> list[XpuDevice]:
    """`xpu-smi discovery -j`: its `device_list`."""
    data = _json(text, "xpu-smi discovery -j")
    items = data.get("device_list") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise ToolError("xpu-smi discovery -j printed no device_list")
    out = []
    for item in items:
        if isinstance(item, dict) and number(item.get("device_id")) is not None:
            out.append(
                XpuDevice(
                    int(number(item["device_id"]) or 0),
                    str(item.get("device_name", "")),
                    str(item.get("uuid", "")),
                    str(item.get("pci_bdf_address", "")).lower(),
                )
            )
    return out


def parse_detail(text: str) -> tuple[int, int]:
    """`xpu-smi discovery -d N -j`: (`memory_physical_size_byte` in MiB, `number_of_eus`); 0 where absent."""
    data = _json(text, "xpu-smi discovery -d N -j")
    if not isinstance(data, dict):
        return 0, 0
    size = number(data.get("memory_physical_size_byte"))
    return int((size or 0) // MIB), int(number(data.get("number_of_eus")) or 0)


def _metrics(entries: object) -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(entries, list):
        for e in entries:
            if isinstance(e, dict):
                v = number(e.get("value"))
                if v is not None:
                    out[str(e.get("metrics_type", ""))] = v
    return out


def parse_stats(text: str) -> XpuStats:
    """`xpu-smi stats -d N -j`: device-level metrics, else the tiles' (summed, utilization averaged)."""
    data = _json(text, "xpu-smi stats -d N -j")
    if not isinstance(data, dict):
        raise ToolError("xpu-smi stats -j printed no object")
    device = _metrics(data.get("device_level"))
    tiles = [_metrics(t.get("data_list")) for t in data.get("tile_level") or [] if isinstance(t, dict)]

    def pick(key: str, combine: Callable[[Sequence[float]], float]) -> float | None:
        if key in device:
            return device[key]
        values = [t[key] for t in tiles if key in t]
        return combine(values) if values else None

    util = pick("XPUM_STATS_GPU_UTILIZATION", lambda v: sum(v) / len(v))
    used = pick("XPUM_STATS_MEMORY_USED", sum)
    return XpuStats(util, int(used or 0), pick("XPUM_STATS_POWER", sum))


def parse_topology(text: str) -> list[tuple[int, int]]:
    """`xpu-smi topology -m`: the pairs of device ids with an Xe Link (`XL…`) between their tiles."""
    cols: list[int] = []
    pairs: list[tuple[int, int]] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if not cols:
            cols = [int(m[1]) for c in cells if (m := _TILE.search(c))]
            continue
        me = _TILE.fullmatch(cells[0]) if cells else None
        if me is None:
            continue
        for other, cell in zip(cols, cells[1:], strict=False):
            if cell.startswith("XL") and other != int(me[1]):
                pairs.append((min(int(me[1]), other), max(int(me[1]), other)))
    return sorted(set(pairs))


class IntelBackend:
    """Intel GPUs as xpu-smi sees them. `tool` is the xpu-smi to run (a name on PATH, or a path)."""

    name = "intel"

    def __init__(self, tool: str = TOOL) -> None:
        self.tool = tool
        self._tried = False
        self._reason = ""
        self._devices: list[DeviceInfo] = []

    @property
    def reason(self) -> str:
        self._init()
        return self._reason

    def _init(self) -> None:
        if self._tried:
            return
        self._tried = True
        try:
            found = parse_discovery(run_tool([self.tool, "discovery", "-j"]))
            devices = []
            for i, x in enumerate(found):
                mem, eus = parse_detail(run_tool([self.tool, "discovery", "-d", str(x.device_id), "-j"]))
                devices.append(
                    DeviceInfo(
                        index=i,
                        vendor="intel",
                        model=normalize_model(x.name),
                        memory_mib=mem,
                        uuid=x.uuid or f"intel-{x.bus_id}",
                        physical_index=x.device_id,
                        dev_nodes=intel_nodes(x.bus_id),
                        cores=eus,
                    )
                )
        except ToolError as e:
            self._reason = f"xpu-smi unavailable: {e}"
            return
        if not devices:
            self._reason = "xpu-smi unavailable: it lists no Intel GPU"
        try:
            xe = parse_topology(run_tool([self.tool, "topology", "-m"]))
        except ToolError:
            xe = []  # no Xe Link (Flex, Arc) or an older xpu-smi: no groups
        groups = link_groups([d.physical_index for d in devices], xe, "xelink")
        self._devices = [replace(d, link_group=groups.get(d.physical_index, "")) for d in devices]

    def available(self) -> bool:
        self._init()
        return bool(self._devices)

    def discover(self) -> list[DeviceInfo]:
        self._init()
        return list(self._devices)

    def usage(self) -> list[DeviceUsage]:
        out = []
        for d in self._devices:
            try:
                s = parse_stats(run_tool([self.tool, "stats", "-d", str(d.physical_index), "-j"]))
            except ToolError as e:
                out.append(DeviceUsage(d.index, d.uuid, None, 0, health=f"xpu-smi stats failed: {e}"[:256]))
                continue
            out.append(DeviceUsage(d.index, d.uuid, s.utilization_pct, s.memory_used_mib, power_w=s.power_w))
        return out
