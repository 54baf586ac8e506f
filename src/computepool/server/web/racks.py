"""The Nodes page's rows: per node, CPU and memory allocated against capacity; per device, memory
in GiB, power against the model's rated board power where known, health, the slices on it, and
an hour of utilization and memory as sparklines."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from markupsafe import Markup

from computepool.server.web.board import HOLDING
from computepool.server.web.charts import spark
from computepool.wire.allocation_out import AllocationOut
from computepool.wire.nodes import DeviceOut, NodeOut
from computepool.wire.usage import DeviceSampleOut

# Rated board power (W) of common models, by the start of the reported name; agents do not
# report a power limit, so an unknown model shows its draw alone.
RATED_W = {
    "H200": 700.0,
    "H100": 700.0,
    "A100": 400.0,
    "L40S": 350.0,
    "L40": 300.0,
    "A10": 150.0,
    "L4": 72.0,
    "T4": 70.0,
    "V100": 300.0,
}


def rated_w(model: str) -> float | None:
    name = model.upper().removeprefix("NVIDIA ").strip()
    best = max((k for k in RATED_W if name.startswith(k)), key=len, default=None)
    return RATED_W[best] if best else None


@dataclass(frozen=True)
class Slice:
    alloc: AllocationOut
    milli: int
    memory_mib: int
    isolation: str


@dataclass(frozen=True)
class Dev:
    d: DeviceOut
    rated_w: float | None
    slices: list[Slice]
    util_spark: Markup
    mem_spark: Markup


@dataclass(frozen=True)
class Rack:
    n: NodeOut
    cpu_allocated: float  # CPUs
    memory_allocated_mib: int
    flags: list[str]
    devices: list[Dev]


def build(
    nodes: list[NodeOut], allocs: list[AllocationOut], history: dict[str, list[DeviceSampleOut]]
) -> list[Rack]:
    cpu: dict[str, int] = defaultdict(int)
    mem: dict[str, int] = defaultdict(int)
    for a in allocs:
        if a.state in HOLDING:
            for name in a.nodes:
                cpu[name] += a.request.cpu_milli
                mem[name] += a.request.memory_mib
    slices: dict[tuple[str, int], list[Slice]] = defaultdict(list)
    for a in allocs:
        if a.state in HOLDING:
            for s in a.slices:
                slices[(s.node, s.device_index)].append(Slice(a, s.compute_milli, s.memory_mib, s.isolation))
    racks: list[Rack] = []
    for n in nodes:
        flags = []
        if n.cordoned:
            flags.append("draining" if n.draining else "cordoned")
        if n.dedicated:
            flags.append("dedicated" + (f" to {n.dedicated_to}" if n.dedicated_to else ""))
        samples: dict[int, list[DeviceSampleOut]] = defaultdict(list)
        for sample in history.get(n.name, []):
            samples[sample.device_index].append(sample)
        devs = []
        for d in n.devices:
            seen = sorted(samples[d.index], key=lambda x: x.at)
            util = [(x.at, x.utilization_pct) for x in seen if x.utilization_pct is not None]
            used = [(x.at, float(x.used_memory_mib)) for x in seen if x.used_memory_mib is not None]
            devs.append(
                Dev(
                    d,
                    rated_w(d.model),
                    slices[(n.name, d.index)],
                    spark(util, 100.0, "line-utilization_pct", "utilization, last hour"),
                    spark(used, float(d.memory_mib or 1), "line-used_memory_mib", "memory used, last hour"),
                )
            )
        racks.append(Rack(n, cpu[n.name] / 1000, mem[n.name], flags, devs))
    return racks
