"""Accelerator models a simulated spec may name without their memory (`2xMI300X,1xM2-Ultra`).

Each entry is the vendor and the memory the vendor's specification gives for that model. Apple's
unified memory is configurable: the entry is the largest configuration sold, and a spec that
wants another writes it (`apple/M2-Ultra-64GB`). NVIDIA boards are left out on purpose: most
come in several memory sizes (A100 40/80 GB), so their specs keep naming the memory.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB_MIB = 1024


@dataclass(frozen=True)
class KnownModel:
    name: str
    vendor: str
    memory_mib: int
    source: str


def _m(name: str, vendor: str, gib: int, source: str) -> KnownModel:
    return KnownModel(name, vendor, gib * GIB_MIB, source)


_AMD = "AMD Instinct datasheet"
_HW = "Huawei product specification"
_INTEL = "Intel product specification (ark)"
_APPLE = "Apple tech specs, largest configuration"
CATALOG: dict[str, KnownModel] = {
    m.name.lower(): m
    for m in (
        _m("MI325X", "amd", 256, _AMD + ": 256 GB HBM3E"),
        _m("MI300X", "amd", 192, _AMD + ": 192 GB HBM3"),
        _m("MI300A", "amd", 128, _AMD + ": 128 GB unified HBM3"),
        _m("MI250X", "amd", 128, _AMD + ": 128 GB HBM2e"),
        _m("MI250", "amd", 128, _AMD + ": 128 GB HBM2e"),
        _m("MI210", "amd", 64, _AMD + ": 64 GB HBM2e"),
        _m("MI100", "amd", 32, _AMD + ": 32 GB HBM2"),
        _m("Ascend910B", "ascend", 64, _HW + ": Ascend 910B, 64 GB HBM2e"),
        _m("Ascend910B4", "ascend", 32, _HW + ": Ascend 910B4, 32 GB HBM2e"),
        _m("Ascend310P", "ascend", 24, _HW + ": Atlas 300I Pro, 24 GB LPDDR4X"),
        _m("Max-1550", "intel", 128, _INTEL + ": Data Center GPU Max 1550, 128 GB HBM2e"),
        _m("Max-1100", "intel", 48, _INTEL + ": Data Center GPU Max 1100, 48 GB HBM2e"),
        _m("Flex-170", "intel", 16, _INTEL + ": Data Center GPU Flex 170, 16 GB GDDR6"),
        _m("Arc-A770", "intel", 16, _INTEL + ": Arc A770 16 GB GDDR6"),
        _m("M1-Max", "apple", 64, _APPLE + ": M1 Max, 64 GB unified"),
        _m("M1-Ultra", "apple", 128, _APPLE + ": M1 Ultra, 128 GB unified"),
        _m("M2-Max", "apple", 96, _APPLE + ": M2 Max, 96 GB unified"),
        _m("M2-Ultra", "apple", 192, _APPLE + ": M2 Ultra, 192 GB unified"),
        _m("M3-Max", "apple", 128, _APPLE + ": M3 Max, 128 GB unified"),
        _m("M4-Max", "apple", 128, _APPLE + ": M4 Max, 128 GB unified"),
    )
}


def known_model(name: str) -> KnownModel | None:
    """The catalog entry of a model name (case-insensitive), else None."""
    return CATALOG.get(name.lower())


def known_names() -> str:
    """The catalog's model names, for a message that lists them."""
    return ", ".join(m.name for m in CATALOG.values())
