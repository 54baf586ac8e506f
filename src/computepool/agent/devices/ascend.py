"""Huawei Ascend NPUs through `npu-smi info`, the driver's own tool.

One `npu-smi info` prints every NPU: a row per NPU (id, chip name, health, power, temperature)
followed by a row per chip (chip id, on 310P cards its device id, PCI address, AI Core
utilization, memory used / total, and on 910-class chips HBM used / total), then a table of the
processes on each chip. Each chip is one device. Its index for ASCEND_RT_VISIBLE_DEVICES and
`/dev/davinciN` is the device id the table prints, else (910B prints none: one chip per NPU) the
chips' order. Memory is the HBM where the chip has it, else its DDR. The model is the chip name
with the SoC prefix (`910B3` → `Ascend910B3`). npu-smi prints no uuid: a device is named by its
PCI address (`ascend-0000:c1:00.0`). NPUs joined by HCCS (`npu-smi info -t topo`; a failure
there only leaves the groups out) share an `hccs-N` link group. Health is "" while npu-smi says
OK, else what it says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from computepool.agent.devices.base import DeviceInfo, DeviceUsage
from computepool.agent.devices.nodes import ascend_nodes
from computepool.agent.devices.tools import ToolError, link_groups, model_name, number, run_tool

TOOL = "npu-smi"
_BUS = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")


@dataclass
class NpuChip:
    npu_id: int
    chip_id: int
    device_id: int | None
    name: str
    health: str
    power_w: float | None
    bus_id: str
    aicore_pct: float | None
    memory_used_mib: int
    memory_total_mib: int
    processes: dict[int, int] = field(default_factory=dict)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_info(text: str) -> list[NpuChip]:
    """The chips `npu-smi info` prints, in order, with their processes' memory (MB)."""
    chips: list[NpuChip] = []
    npu: tuple[int, str, str, float | None] | None = None  # id, name, health, power
    hbm = False
    in_procs = False
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = _cells(line)
        head = cells[0].split()
        if len(cells) < 3:
            continue
        if cells[1] == "Bus-Id":  # the chip header says whether chips have HBM
            hbm = "HBM-Usage" in cells[2]
            continue
        if head[:1] == ["NPU"] and "Process id" in cells[1]:
            in_procs = True
            continue
        if not head or not head[0].isdigit():
            continue
        if in_procs:
            _process_row(chips, head, cells)
        elif _BUS.match(cells[1]):
            if npu is not None and all(t.isdigit() for t in head):
                chips.append(_chip(npu, head, cells, hbm))
        else:  # an NPU row: `| 0     910B3 | OK | 101.8   43   0 / 0 |`
            rest = cells[2].split()
            npu = (int(head[0]), " ".join(head[1:]), cells[1], number(rest[0]) if rest else None)
    return chips


def _chip(npu: tuple[int, str, str, float | None], head: list[str], cells: list[str], hbm: bool) -> NpuChip:
    npu_id, name, health, power = npu
    pairs = [(int(a), int(b)) for a, b in _PAIR.findall(cells[2])]
    used, total = (pairs[-1] if hbm else pairs[0]) if pairs else (0, 0)
    if hbm and pairs and total == 0:
        used, total = pairs[0]
    words = cells[2].split()
    return NpuChip(
        npu_id=npu_id,
        chip_id=int(head[0]),
        device_id=int(head[1]) if len(head) > 1 else None,
        name=name,
        health=health,
        power_w=power,
        bus_id=cells[1].lower(),
        aicore_pct=number(words[0]) if words else None,
        memory_used_mib=used,
        memory_total_mib=total,
    )


def _process_row(chips: list[NpuChip], head: list[str], cells: list[str]) -> None:
    """`| NPU Chip | Process id | Process name | Process memory(MB) | …`."""
    if len(head) < 2 or len(cells) < 4:
        return
    npu_id, chip_id = int(head[0]), int(head[1])
    pid, mem = number(cells[1]), number(cells[3])
    for c in chips:
        if (c.npu_id, c.chip_id) == (npu_id, chip_id) and pid is not None:
            c.processes[int(pid)] = int(mem or 0)


def parse_topo(text: str) -> list[tuple[int, int]]:
    """`npu-smi info -t topo`: the pairs of NPU ids its matrix says HCCS joins."""
    cols: list[int] = []
    pairs: list[tuple[int, int]] = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if not cols and words[0].startswith("NPU") and words[0] != "NPU" and line[0].isspace():
            cols = [int(w[3:]) for w in words if w.startswith("NPU") and w[3:].isdigit()]
            continue
        if cols and words[0].startswith("NPU") and words[0][3:].isdigit():
            me = int(words[0][3:])
            for other, cell in zip(cols, words[1:], strict=False):
                if cell == "HCCS" and other != me:
                    pairs.append((min(me, other), max(me, other)))
    return sorted(set(pairs))


def model_of(name: str) -> str:
    """`910B3` → `Ascend910B3` (the SoC name CANN uses); a name already prefixed is kept."""
    name = model_name(name.split(), "NPU")
    return name if name.lower().startswith("ascend") else f"Ascend{name}"


def npu_groups(chips: list[NpuChip], hccs: list[tuple[int, int]]) -> dict[int, str]:
    """chip position → `hccs-N` (N the lowest position in the group) for the chips of NPUs HCCS joins."""
    by_npu: dict[int, list[int]] = {}
    for i, c in enumerate(chips):
        by_npu.setdefault(c.npu_id, []).append(i)
    pairs = [(a, b) for x, y in hccs for a in by_npu.get(x, []) for b in by_npu.get(y, [])]
    return link_groups(range(len(chips)), pairs, "hccs")


def device_index(chip: NpuChip, order: int) -> int:
    return chip.device_id if chip.device_id is not None else order


class AscendBackend:
    """Ascend NPUs as npu-smi sees them. `tool` is the npu-smi to run (a name on PATH, or a path)."""

    name = "ascend"

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
            chips = parse_info(run_tool([self.tool, "info"]))
        except ToolError as e:
            self._reason = f"npu-smi unavailable: {e}"
            return
        if not chips:
            self._reason = "npu-smi unavailable: it lists no Ascend NPU"
        try:
            hccs = parse_topo(run_tool([self.tool, "info", "-t", "topo"]))
        except ToolError:
            hccs = []  # an older npu-smi or a card without HCCS: no groups
        groups = npu_groups(chips, hccs)
        self._devices = [
            DeviceInfo(
                index=i,
                vendor="ascend",
                model=model_of(c.name),
                memory_mib=c.memory_total_mib,
                uuid=f"ascend-{c.bus_id}" if c.bus_id else f"ascend-npu{c.npu_id}-chip{c.chip_id}",
                physical_index=device_index(c, i),
                link_group=groups.get(i, ""),
                dev_nodes=ascend_nodes(device_index(c, i)),
            )
            for i, c in enumerate(chips)
        ]

    def available(self) -> bool:
        self._init()
        return bool(self._devices)

    def discover(self) -> list[DeviceInfo]:
        self._init()
        return list(self._devices)

    def usage(self) -> list[DeviceUsage]:
        if not self._devices:
            return []
        try:
            chips = parse_info(run_tool([self.tool, "info"]))
        except ToolError as e:
            why = f"npu-smi info failed: {e}"[:256]
            return [DeviceUsage(d.index, d.uuid, None, 0, health=why) for d in self._devices]
        by_uuid = {f"ascend-{c.bus_id}" if c.bus_id else "": c for c in chips}
        out = []
        for d in self._devices:
            c = by_uuid.get(d.uuid)
            if c is None:
                out.append(DeviceUsage(d.index, d.uuid, None, 0, health="npu-smi no longer lists this NPU"))
                continue
            health = "" if c.health.upper() == "OK" else f"npu-smi reports health {c.health}"
            out.append(
                DeviceUsage(
                    d.index,
                    d.uuid,
                    c.aicore_pct,
                    c.memory_used_mib,
                    dict(c.processes),
                    power_w=c.power_w,
                    health=health,
                )
            )
        return out
