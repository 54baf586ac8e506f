"""Join tokens, node inventory, heartbeats."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from computepool.core.address import MAX_ADDRESS_LEN, check_address
from computepool.core.request import MAX_DEVICES_PER_NODE
from computepool.wire.common import (
    MAX_CPU_MILLI,
    MAX_EXPIRES_S,
    MAX_MEMORY_MIB,
    MAX_TAINTS,
    Id,
    In,
    ModelName,
    Name,
    Out,
)

MAX_DEVICE_MEMORY_MIB = 2**24  # 16 TiB on one device
MAX_DEVICE_POWER_W = 100_000.0
MAX_ENERGY_J = 1e18
MAX_LABELS = 64
NodeState = Literal["ready", "suspect", "lost"]
Uuid = Annotated[str, StringConstraints(pattern=r"^([A-Za-z0-9][A-Za-z0-9_.:/-]{0,127})?$")]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/@ -]{0,63}$")]
PythonVersion = Annotated[
    str,
    StringConstraints(pattern=r"^3\.[0-9]{1,2}$"),
    Field(description="A CPython minor version, e.g. 3.11."),
]
Address = Annotated[
    str,
    StringConstraints(max_length=MAX_ADDRESS_LEN + 2),
    AfterValidator(lambda v: check_address(v, "address") if v else v),
    Field(description="An IP address or host name the node's peers reach it at."),
]


class JoinTokenCreate(In):
    expires_in_s: int = Field(
        default=3600, strict=True, ge=1, le=MAX_EXPIRES_S, description="Lifetime in seconds."
    )
    single_use: bool = Field(default=True, strict=True, description="Refuse the token after one join.")


class JoinTokenCreated(Out):
    id: str
    token: str = Field(description="Give this to `cpool agent`; shown only in this answer.")
    expires_at: datetime
    single_use: bool


class DeviceIn(In):
    index: int = Field(strict=True, ge=0, lt=MAX_DEVICES_PER_NODE, description="Index on the node (0-based).")
    vendor: ModelName = Field(description="e.g. nvidia, amd, simulated.")
    model: ModelName
    memory_mib: int = Field(strict=True, ge=1, le=MAX_DEVICE_MEMORY_MIB, description="Device memory in MiB.")
    uuid: Uuid = Field(default="", description="Vendor uuid (GPU-… or MIG-…).")
    compute_milli: int = Field(default=1000, strict=True, ge=1, le=1000, description="1000 = a whole device.")
    link_group: str = Field(
        default="", max_length=63, pattern=r"^[A-Za-z0-9_.:-]*$", description="NVLink peers."
    )
    mig_parent_uuid: Uuid | None = Field(default=None, description="For a MIG instance: its GPU's uuid.")


class NodeJoin(In):
    join_token: str = Field(max_length=200, description="A join token from POST /api/v1/join-tokens.")
    name: Name = Field(description="The node's name, unique in the pool.")
    cpu_milli: int = Field(strict=True, ge=0, le=MAX_CPU_MILLI, description="Schedulable host CPU.")
    memory_mib: int = Field(strict=True, ge=0, le=MAX_MEMORY_MIB, description="Schedulable host memory.")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    devices: list[DeviceIn] = Field(default_factory=list, max_length=MAX_DEVICES_PER_NODE)
    address: Address | None = Field(
        default=None, description="Where a gang's peers reach this node; default: where the join came from."
    )
    pythons: list[PythonVersion] | None = Field(
        default=None, max_length=32, description="Python versions a tenant's job can run here, e.g. 3.11."
    )

    @model_validator(mode="after")
    def _unique_indexes(self) -> NodeJoin:
        seen: set[int] = set()
        for d in self.devices:
            if d.index in seen:
                raise ValueError(f"devices: index {d.index} appears twice")
            seen.add(d.index)
        return self


class DeviceUsageIn(In):
    index: int = Field(strict=True, ge=0, lt=MAX_DEVICES_PER_NODE, description="Device index on this node.")
    used_memory_mib: int | None = Field(default=None, strict=True, ge=0, le=MAX_DEVICE_MEMORY_MIB)
    utilization_pct: float | None = Field(default=None, ge=0, le=100, allow_inf_nan=False)
    power_w: float | None = Field(
        default=None, ge=0, le=MAX_DEVICE_POWER_W, allow_inf_nan=False, description="Power draw now (W)."
    )
    energy_j: float | None = Field(
        default=None,
        ge=0,
        le=MAX_ENERGY_J,
        allow_inf_nan=False,
        description="The device's total-energy counter (J; NVML's counts from driver load).",
    )
    health: str = Field(
        default="", max_length=256, description="Empty while healthy, else why not (NVML error, XID event)."
    )


class ProgressIn(In):
    """A running job's speed since the last heartbeat, from the steps it reported (sdk/progress.py)."""

    allocation_id: Id
    attempt: int = Field(strict=True, ge=1)
    steps_per_s: float = Field(gt=0, le=1e9, allow_inf_nan=False, description="Steps per second.")


class Heartbeat(In):
    devices_usage: list[DeviceUsageIn] = Field(default_factory=list, max_length=MAX_DEVICES_PER_NODE)
    progress: list[ProgressIn] | None = Field(
        default=None, max_length=1024, description="Running jobs that advanced since the last heartbeat."
    )
    address: Address | None = Field(
        default=None,
        description="Set the node's address (an agent sends it once after it starts); empty: the "
        "address this heartbeat comes from; absent: unchanged.",
    )
    pythons: list[PythonVersion] | None = Field(
        default=None, max_length=32, description="Set the Python versions the node provides (absent: same)."
    )


class DeviceOut(Out):
    index: int
    vendor: str
    model: str
    memory_mib: int
    uuid: str
    compute_milli: int
    link_group: str
    mig_parent_uuid: str | None
    used_memory_mib: int | None
    utilization_pct: float | None
    power_w: float | None
    health: str = Field(description="Empty while healthy, else why not.")


class NodeOut(Out):
    name: str
    cpu_milli: int
    memory_mib: int
    labels: dict[str, str]
    devices: list[DeviceOut]
    state: NodeState = Field(description="From the heartbeat age on the database clock.")
    heartbeat_age_s: float
    cordoned: bool = Field(description="No new work is placed here.")
    draining: bool = Field(
        description="Cordoned; restartable work is requeued elsewhere, the rest finishes here."
    )
    taints: dict[str, str] = Field(description="Work that does not tolerate each of these stays off.")
    dedicated: bool = Field(description="Set aside for one tenant.")
    dedicated_to: str | None = Field(
        description="The tenant it is set aside for (shown to admins and to that tenant's users)."
    )
    lending: bool = Field(description="A dedicated node's idle capacity may be borrowed, preemptibly.")
    address: str = Field(default="", description="Where a gang's peers reach this node.")
    pythons: list[str] = Field(default_factory=list, description="Python versions jobs can run here.")
    joined_at: datetime
    last_heartbeat_at: datetime


class NodeSettings(In):
    """PUT /nodes/{name}: the admin-set placement rules, replaced whole."""

    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=MAX_LABELS)
    taints: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, max_length=MAX_TAINTS, description="key → value; NoSchedule."
    )
    dedicated_to: Name | None = Field(default=None, description="A tenant; null: shared by all.")
    lending: bool = Field(
        default=True, strict=True, description="Others may borrow it as preemptible work (when dedicated)."
    )


class NodePatch(In):
    """PATCH /nodes/{name}: change only what is given; a label or taint set to null is removed."""

    labels: dict[LabelKey, LabelValue | None] | None = Field(default=None, max_length=MAX_LABELS)
    taints: dict[LabelKey, LabelValue | None] | None = Field(default=None, max_length=MAX_TAINTS)
    dedicated_to: Name | None = Field(default=None, description="A tenant; null (given) undedicates.")
    lending: bool | None = Field(default=None, strict=True)


class NodeJoined(Out):
    node: NodeOut
    credential: str = Field(description="The node's bearer token; shown only in this answer.")
    heartbeat_interval_s: float
    lost_after_s: float = Field(description="Heartbeat age → lost; restartable work is fenced before.")
    servers: list[str] = Field(
        default_factory=list,
        description="The control plane's live replicas (their advertised URLs): agents move among them.",
    )


class PortRangeOut(Out):
    """A range of ports the pool hands out one at a time (see agent/port_guard.py)."""

    name: str = Field(description="What the pool gives its ports to: service, rpc or publish.")
    min: int
    max: int


class HeartbeatOut(Out):
    node: str
    state: NodeState
    cordoned: bool
    draining: bool
    heartbeat_interval_s: float
    lost_after_s: float = Field(description="Heartbeat age → lost; restartable work is fenced before.")
    address: str | None = Field(
        default=None,
        description="The node's address as this heartbeat set it (absent when it set none): where "
        "replicas' endpoints dial and containers publish their ports.",
    )
    reserved_ports: list[PortRangeOut] = Field(
        default_factory=list,
        description="The pool's port ranges: a job on the node may listen there only on a port it was given.",
    )
    log_max_mib: int | None = Field(
        default=None,
        description="Output the pool keeps of an attempt's stream: the node skips what is unsent past it.",
    )
    servers: list[str] = Field(
        default_factory=list,
        description="The control plane's live replicas (their advertised URLs): agents move among them.",
    )
