"""Device backends: every vendor (and the simulator) reports the same DeviceInfo and DeviceUsage."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from computepool.agent.devices.amd import AmdBackend
from computepool.agent.devices.apple import AppleBackend
from computepool.agent.devices.ascend import AscendBackend
from computepool.agent.devices.base import DeviceBackend, DeviceInfo, DeviceUsage
from computepool.agent.devices.composite import CompositeBackend
from computepool.agent.devices.cpu import CpuInventory, CpuUsage, cpu_inventory, cpu_usage
from computepool.agent.devices.intel import IntelBackend
from computepool.agent.devices.nvidia import NvidiaBackend
from computepool.agent.devices.simulated import SIM_MEMORY_FILE_ENV, SimulatedBackend, parse_spec

__all__ = [
    "SIM_MEMORY_FILE_ENV",
    "AmdBackend",
    "AppleBackend",
    "AscendBackend",
    "CompositeBackend",
    "CpuInventory",
    "CpuUsage",
    "DeviceBackend",
    "DeviceInfo",
    "DeviceUsage",
    "IntelBackend",
    "NodeInventory",
    "NvidiaBackend",
    "SimulatedBackend",
    "cpu_inventory",
    "cpu_usage",
    "discover_all",
    "parse_spec",
]


@dataclass
class NodeInventory:
    """What this node offers, and the backend to ask for usage later (None: CPU only)."""

    devices: list[DeviceInfo]
    cpu: CpuInventory
    backend: DeviceBackend | None
    notes: list[str] = field(default_factory=list)


def real_backends() -> list[DeviceBackend]:
    """The vendors' backends, in the order discovery asks them."""
    return [NvidiaBackend(), AmdBackend(), IntelBackend(), AscendBackend(), AppleBackend()]


def discover_all(
    simulate: str | None = None, seed: str | None = None, backends: Sequence[DeviceBackend] | None = None
) -> NodeInventory:
    """Simulated devices when a spec is given; else every vendor's devices that answer (NVIDIA,
    AMD, Intel, Ascend, Apple, numbered one after the other); plus the CPU.

    A bad spec raises InvalidInput (the operator asked for something wrong); a missing driver
    or tool only adds a note, since a CPU-only node is a fine member of the pool. `backends`
    replaces the vendors' (tests).
    """
    cpu = cpu_inventory()
    if simulate:
        sim = SimulatedBackend(simulate, seed=seed)
        return NodeInventory(sim.discover(), cpu, sim, [f"simulated devices: {simulate}"])
    found: list[DeviceBackend] = []
    notes: list[str] = []
    for b in real_backends() if backends is None else backends:
        if b.available() and b.discover():
            found.append(b)
        else:
            notes.append(b.reason or f"{b.name}: no device")
    if not found:
        return NodeInventory([], cpu, None, notes)
    backend = found[0] if len(found) == 1 else CompositeBackend(found)
    return NodeInventory(backend.discover(), cpu, backend, notes)
