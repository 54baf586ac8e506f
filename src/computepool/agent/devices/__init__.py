"""Device backends: every vendor (and the simulator) reports the same DeviceInfo and DeviceUsage."""

from __future__ import annotations

from dataclasses import dataclass, field

from computepool.agent.devices.base import DeviceBackend, DeviceInfo, DeviceUsage
from computepool.agent.devices.cpu import CpuInventory, CpuUsage, cpu_inventory, cpu_usage
from computepool.agent.devices.nvidia import NvidiaBackend
from computepool.agent.devices.simulated import SIM_MEMORY_FILE_ENV, SimulatedBackend, parse_spec

__all__ = [
    "SIM_MEMORY_FILE_ENV",
    "CpuInventory",
    "CpuUsage",
    "DeviceBackend",
    "DeviceInfo",
    "DeviceUsage",
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


def discover_all(simulate: str | None = None, seed: str | None = None) -> NodeInventory:
    """Simulated devices when a spec is given, else NVIDIA when NVML answers; plus the CPU.

    A bad spec raises InvalidInput (the operator asked for something wrong); a missing driver
    only adds a note, since a CPU-only node is a fine member of the pool.
    """
    cpu = cpu_inventory()
    if simulate:
        sim = SimulatedBackend(simulate, seed=seed)
        return NodeInventory(sim.discover(), cpu, sim, [f"simulated devices: {simulate}"])
    nvidia = NvidiaBackend()
    if nvidia.available():
        devices = nvidia.discover()
        notes = [] if devices else [nvidia.reason]
        return NodeInventory(devices, cpu, nvidia, notes)
    return NodeInventory([], cpu, None, [nvidia.reason])
