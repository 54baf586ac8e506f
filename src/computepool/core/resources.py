"""What the pool is made of: devices (a GPU or a MIG instance) and the nodes that hold them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from computepool.core.quantities import MILLI_PER_DEVICE

# A MIG profile as NVIDIA names it: GPU-instance slices, then memory in GB (`3g.40gb`, `1g.10gb+me`).
MIG_PROFILE = re.compile(r"^(?P<slices>[1-9][0-9]?)g\.(?P<gb>[1-9][0-9]{0,3})gb(?P<me>\+me)?$")
# NVML names an instance `<GPU model> MIG <profile>`; model names cannot hold `+`, so `-me` stands for it.
_MIG_IN_MODEL = re.compile(r"(?:^|[-_ ])MIG[-_ ](?P<profile>[1-9][0-9]?g\.[1-9][0-9]{0,3}gb)(?P<me>[-+]me)?$")


class DeviceKind(StrEnum):
    """What a schedulable unit is: a whole GPU, one MIG instance of a GPU, or host CPU (per node)."""

    GPU = "gpu"
    MIG = "mig"
    CPU = "cpu"


def mig_profile_of(model: str) -> str:
    """The MIG profile in a device model name (`A100-SXM4-80GB-MIG-3g.40gb` → `3g.40gb`), else ""."""
    m = _MIG_IN_MODEL.search(model)
    if m is None:
        return ""
    return m["profile"] + ("+me" if m["me"] else "")


def mig_base_model(model: str) -> str:
    """The GPU model a MIG instance's model name is cut from (the name itself for a whole GPU)."""
    m = _MIG_IN_MODEL.search(model)
    return model if m is None else model[: m.start()]


@dataclass(frozen=True)
class Device:
    """One schedulable accelerator. `compute_milli` is 1000 for a whole device.

    A MIG instance names its GPU in `mig_parent_uuid` and its profile in `mig_profile`; it is
    scheduled as a device of its own that holds one allocation at a time.
    """

    index: int
    vendor: str
    model: str
    memory_mib: int
    uuid: str = ""
    compute_milli: int = MILLI_PER_DEVICE
    numa_node: int = -1
    link_group: str = ""
    mig_parent_uuid: str | None = None
    mig_profile: str = ""

    @property
    def kind(self) -> DeviceKind:
        return DeviceKind.MIG if self.mig_parent_uuid is not None else DeviceKind.GPU


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
