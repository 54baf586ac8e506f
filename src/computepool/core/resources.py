"""What the pool is made of: devices (a GPU or a MIG instance) and the nodes that hold them."""

from __future__ import annotations

from dataclasses import dataclass, field

from computepool.core.quantities import MILLI_PER_DEVICE


@dataclass(frozen=True)
class Device:
    """One schedulable accelerator. `compute_milli` is 1000 for a whole device."""

    index: int
    vendor: str
    model: str
    memory_mib: int
    uuid: str = ""
    compute_milli: int = MILLI_PER_DEVICE
    numa_node: int = -1
    link_group: str = ""


@dataclass
class Node:
    """A server: host CPU and memory plus its devices. Labels are free-form key/values."""

    name: str
    cpu_milli: int
    memory_mib: int
    devices: list[Device] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    schedulable: bool = True

    @property
    def gpu_count(self) -> int:
        return len(self.devices)
