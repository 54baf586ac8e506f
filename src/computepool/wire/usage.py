"""Wire types of the usage ledger, prices, device history and the static equivalent (one
definition for the server, the client and the CLI)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from computepool.core.usage import ENERGY_ITEM
from computepool.wire.common import In, Out

MAX_PRICE = 1e9


class UsageItem(Out):
    """One group of the ledger. Which key fields are present follows `by`: tenant → tenant;
    user → tenant, user; job → tenant, user, job, allocation_id; model → model ("" = host share)."""

    tenant: str | None = None
    user: str | None = None
    job: str | None = None
    allocation_id: int | None = None
    model: str | None = None
    gpu_hours: float = Field(description="Device share × hours (a half slice for two hours: 1).")
    cpu_hours: float = Field(description="Cores × hours of the host share.")
    memory_gib_hours: float = Field(description="Host memory GiB × hours.")
    energy_kwh: float = Field(description="Energy of the devices held, split by compute share.")
    idle_waste_kwh: float = Field(description="Part of energy_kwh drawn by held devices doing nothing.")
    cost: float = Field(description="gpu_hours × the model's price + energy_kwh × the kWh price.")


class UsageOut(Out):
    items: list[UsageItem]
    unpriced: list[str] = Field(
        default_factory=list, description="Price items these rows used that have no price (counted as 0)."
    )
    truncated: bool = Field(
        default=False, description="by=job only: more jobs than one answer holds; the newest are listed."
    )


class PriceIn(In):
    amount: float = Field(ge=0, le=MAX_PRICE, allow_inf_nan=False, description="Per GPU-hour, or per kWh.")


class PriceOut(Out):
    item: str = Field(description=f"A device model (price per GPU-hour) or {ENERGY_ITEM!r} (per kWh).")
    amount: float
    updated_at: datetime
    warning: str = Field(
        default="", description="Set when no device of the pool, now or booked before, is this model."
    )


class DeviceSampleOut(Out):
    device_index: int
    at: datetime
    utilization_pct: float | None
    used_memory_mib: int | None
    power_w: float | None


class PartitionOut(Out):
    tenant: str
    model: str
    static_devices: int = Field(description="Whole devices its static partition would have needed.")
    peak_gpus: float = Field(description="Its largest concurrent device share in the window.")
    peak_at: datetime | None = Field(description="When that peak was first reached.")


class StaticEquivalentOut(Out):
    since: datetime
    until: datetime
    clipped: bool = Field(
        default=False,
        description="The window asked for began before the pool existed: `since` is the pool's start.",
    )
    pool_devices: int = Field(
        description="The most whole devices that held work at once in the window (for a non-admin: "
        "the most its own tenant held at once), summed over device models."
    )
    pool_size_devices: int = Field(description="Devices the pool lists now, beside pool_devices.")
    static_devices: int = Field(description="Sum of the tenants' static partitions.")
    devices_saved: int
    devices_saved_pct: float
    cost_pool: float = Field(
        description="pool_devices × hours of the window × each model's price, plus energy_pool_kwh's cost."
    )
    cost_static: float
    cost_saved: float
    energy_pool_kwh: float = Field(description="Energy the ledger booked on those models in the window.")
    energy_pool_includes_empty: bool = Field(
        description="Whether energy_pool_kwh includes devices holding nothing (the pool's own row: "
        "an admin's view) or only the caller's tenant's share."
    )
    energy_static_kwh: float = Field(description="The pool's, plus the extra devices idling.")
    energy_saved_kwh: float
    tenants: list[PartitionOut]
    models: dict[str, dict[str, int]] = Field(
        description="Per device model: pool_devices, static_devices and pool_size_devices.",
        default_factory=dict,
    )
    method: str
