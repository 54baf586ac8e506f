"""GPU power from utilization: the model the simulated backend and the simulator share.

A device draws its idle power while it does nothing and rises linearly with utilization to its
peak: P(u) = idle + (peak − idle) × u / 100. Peak is the board power NVIDIA's datasheets give
(the TDP or "max thermal design power" of that form factor), and AMD's, Intel's and Huawei's
specifications for theirs. Idle is harder to source: boards
sitting in P0 with a context open, as a held-but-unused slice leaves them, draw about 15–25% of
their TDP in public nvidia-smi readings; we take the figures below (about 15% for the large
boards, more for the small ones, whose fans and memory weigh more) and say so wherever energy is
reported. Real NVIDIA devices report their own draw through NVML, and the ledger prefers that.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PowerModel:
    idle_w: float
    peak_w: float
    source: str

    def watts(self, utilization_pct: float | None) -> float:
        """Draw at this utilization (None: idle), clamped to [0, 100] %."""
        u = min(100.0, max(0.0, utilization_pct or 0.0))
        return self.idle_w + (self.peak_w - self.idle_w) * u / 100.0


_DS = "NVIDIA datasheet, max board power"
_AMD = "AMD Instinct datasheet, total board power"
_INTEL = "Intel product specification, total board power"
# Model names as the pool and the traces spell them (case-insensitive prefix match, longest first).
POWER: dict[str, PowerModel] = {
    "H200": PowerModel(100.0, 700.0, _DS + " (H200 SXM 700 W)"),
    "H100": PowerModel(90.0, 700.0, _DS + " (H100 SXM5 700 W)"),
    "A100-80GB": PowerModel(60.0, 400.0, _DS + " (A100 80GB SXM4 400 W)"),
    "A100-40GB": PowerModel(55.0, 400.0, _DS + " (A100 40GB SXM4 400 W)"),
    "A100": PowerModel(55.0, 400.0, _DS + " (A100 SXM4 400 W)"),
    "A10": PowerModel(30.0, 150.0, _DS + " (A10 150 W)"),
    "L40S": PowerModel(60.0, 350.0, _DS + " (L40S 350 W)"),
    "L4": PowerModel(16.0, 72.0, _DS + " (L4 72 W)"),
    "V100": PowerModel(40.0, 300.0, _DS + " (V100 SXM2 300 W)"),
    "V100M16": PowerModel(40.0, 300.0, _DS + " (V100 SXM2 16GB 300 W)"),
    "V100M32": PowerModel(40.0, 300.0, _DS + " (V100 SXM2 32GB 300 W)"),
    "P100": PowerModel(30.0, 250.0, _DS + " (Tesla P100 250 W)"),
    "T4": PowerModel(10.0, 70.0, _DS + " (Tesla T4 70 W)"),
    "G2": PowerModel(40.0, 300.0, "assumed V100-class (Alibaba's G2 model is not named publicly)"),
    "G3": PowerModel(40.0, 300.0, "assumed V100-class (Alibaba's G3 model is not named publicly)"),
    # Other vendors: peak is the board power their specifications give; idle as above (~15%).
    # Left out for want of a published board power: Apple's GPUs (Apple gives none) and Huawei's
    # Ascend 910 and 910B modules (none in Huawei's public specifications), which fall to DEFAULT.
    "MI325X": PowerModel(150.0, 1000.0, _AMD + " (MI325X 1000 W)"),
    "MI300X": PowerModel(110.0, 750.0, _AMD + " (MI300X 750 W)"),
    "MI300A": PowerModel(85.0, 550.0, _AMD + " (MI300A 550 W)"),
    "MI250X": PowerModel(75.0, 500.0, _AMD + " (MI250X 500 W)"),
    "MI250": PowerModel(75.0, 500.0, _AMD + " (MI250 500 W)"),
    "MI210": PowerModel(45.0, 300.0, _AMD + " (MI210 300 W)"),
    "MI100": PowerModel(45.0, 300.0, _AMD + " (MI100 300 W)"),
    "Max-1550": PowerModel(90.0, 600.0, _INTEL + " (Data Center GPU Max 1550 600 W)"),
    "Max-1100": PowerModel(45.0, 300.0, _INTEL + " (Data Center GPU Max 1100 300 W)"),
    "Flex-170": PowerModel(25.0, 150.0, _INTEL + " (Data Center GPU Flex 170 150 W)"),
    "Arc-A770": PowerModel(35.0, 225.0, _INTEL + " (Arc A770 225 W)"),
    "Ascend310P": PowerModel(12.0, 72.0, "Huawei Atlas 300I Pro specification, max power (72 W)"),
}
DEFAULT = PowerModel(50.0, 300.0, "assumed: a 300 W datacenter board (model unknown)")


def model_power(model: str) -> PowerModel:
    """The power model of a device model name (e.g. "A100-80GB", "nvidia/T4-16GB", "V100M32")."""
    name = model.rsplit("/", 1)[-1].upper().replace(" ", "-")
    for vendor in ("NVIDIA-", "TESLA-"):
        name = name.removeprefix(vendor)
    for key in sorted(POWER, key=len, reverse=True):
        if name == key.upper() or name.startswith(key.upper() + "-") or name.startswith(key.upper()):
            return POWER[key]
    return DEFAULT
