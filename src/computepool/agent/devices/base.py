"""What every device backend reports, whatever the vendor: one shape for discovery and usage."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.resources import Device, mig_profile_of


@dataclass(frozen=True)
class DeviceInfo:
    """One schedulable accelerator on this node: a whole GPU or one MIG instance.

    `index` numbers schedulable devices on the node (what a Slice's `device_index` names);
    `physical_index` is the vendor's index of the GPU that holds it (the same for a whole GPU):
    what the vendor's visible-devices variable takes where it takes indices (core/vendors.py).
    `dev_nodes` are the device files a container needs to open this device, as its backend found
    them (none for NVIDIA, whose nodes the container code finds through NVML, nor for simulated
    devices).
    """

    index: int
    vendor: str
    model: str
    memory_mib: int
    uuid: str
    physical_index: int = -1
    compute_milli: int = MILLI_PER_DEVICE
    compute_capability: str = ""
    numa_node: int = -1
    link_group: str = ""
    mig_parent_uuid: str | None = None
    dev_nodes: tuple[str, ...] = ()
    cores: int = 0  # compute units where the vendor says: Apple GPU cores, AMD CUs, Intel EUs

    @property
    def is_mig(self) -> bool:
        return self.mig_parent_uuid is not None

    def to_device(self) -> Device:
        """The scheduler's view of this device."""
        return Device(
            index=self.index,
            vendor=self.vendor,
            model=self.model,
            memory_mib=self.memory_mib,
            uuid=self.uuid,
            compute_milli=self.compute_milli,
            numa_node=self.numa_node,
            link_group=self.link_group,
            mig_parent_uuid=self.mig_parent_uuid,
            mig_profile=mig_profile_of(self.model) if self.is_mig else "",
        )


@dataclass(frozen=True)
class DeviceUsage:
    """A device's load right now. `utilization_pct` is None where the vendor cannot tell (MIG).

    `power_w` is the draw now and `energy_j` the vendor's total-energy counter (monotonic, reset
    only when the driver or agent restarts), so the pool can book energy between two heartbeats;
    both are None where the device cannot tell (a MIG instance: the GPU draws for all of them).
    `health` is "" while the device is healthy, else why it is not (which vendor call failed, or
    the XID event seen).
    """

    index: int
    uuid: str
    utilization_pct: float | None
    memory_used_mib: int
    process_memory_mib: dict[int, int] = field(default_factory=dict)
    power_w: float | None = None
    energy_j: float | None = None
    health: str = ""


@runtime_checkable
class DeviceBackend(Protocol):
    """A source of devices. Backends never raise for a missing driver: they say why instead."""

    name: str

    @property
    def reason(self) -> str:
        """Why the backend is unavailable ("" when it is available)."""
        ...

    def available(self) -> bool: ...

    def discover(self) -> list[DeviceInfo]: ...

    def usage(self) -> list[DeviceUsage]: ...
