"""What the pool knows of each accelerator vendor: the one table the agent (which variable names a
job's devices) and the scheduler (which isolation tiers a device can enforce) both read.

A tier is offered on a vendor's devices only where something holds a slice to its share there:
`exclusive` everywhere (the job sees its device alone); `timeslice` where the framework shim caps
memory through the vendor's runtime (PyTorch's CUDA API is also ROCm's: `torch.cuda` on HIP); `mps`
and `mig` are NVIDIA's alone. A request for a tier a device cannot enforce is never placed there.
"""

from __future__ import annotations

from dataclasses import dataclass

from computepool.core.allocation import Isolation


@dataclass(frozen=True)
class Vendor:
    """One vendor's runtime facts. `visible_env` are the variables that name a job's devices (the
    first is the one users read); `by_uuid` says whether they take device uuids (else the vendor's
    device indices)."""

    name: str
    title: str
    visible_env: tuple[str, ...]
    by_uuid: bool
    tiers: frozenset[Isolation]
    stack_label: str  # the node label prefix naming the software stack (`cuda-12.4`)


_ALL = frozenset(Isolation)
_SHARED = frozenset({Isolation.EXCLUSIVE, Isolation.TIMESLICE})
_ALONE = frozenset({Isolation.EXCLUSIVE})

VENDORS: dict[str, Vendor] = {
    v.name: v
    for v in (
        Vendor("nvidia", "NVIDIA", ("CUDA_VISIBLE_DEVICES",), True, _ALL, "cuda"),
        Vendor("amd", "AMD", ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"), False, _SHARED, "rocm"),
        Vendor("intel", "Intel", ("ZE_AFFINITY_MASK",), False, _ALONE, "oneapi"),
        Vendor("ascend", "Huawei Ascend", ("ASCEND_RT_VISIBLE_DEVICES",), False, _ALONE, "cann"),
        Vendor("apple", "Apple", (), False, _ALONE, "metal"),
    )
}
# A device whose vendor the pool does not know (a newer agent's): exclusive use only.
UNKNOWN = Vendor("", "unknown", (), False, _ALONE, "")
# Devices registered as "simulated" (the pool's own tests and early agents) behave as NVIDIA's.
_ALIASES = {"simulated": "nvidia"}


def vendor(name: str) -> Vendor:
    """The vendor named (case-insensitively), else UNKNOWN."""
    key = name.lower()
    return VENDORS.get(_ALIASES.get(key, key), UNKNOWN)


def canonical(name: str) -> str:
    """The vendor's name as requests and the scheduler use it ("" when unknown)."""
    return vendor(name).name


def tiers_of(name: str) -> frozenset[Isolation]:
    """The isolation tiers a device of this vendor can enforce."""
    return vendor(name).tiers
