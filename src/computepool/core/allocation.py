"""The wire vocabulary of allocations: states, isolation tiers and slices.

One definition, imported by the server (schemas, store, scheduling), the client, the CLI and the
agent, so the words a process sends are the words the next one checks. States and tiers are
Literal types (what pydantic validates and mypy checks) with their values as tuples derived from
them; `Isolation` is the same tiers as an enum for code that branches on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, get_args

AllocationState = Literal["pending", "bound", "active", "released", "preempted", "failed", "cancelled"]
STATES: tuple[AllocationState, ...] = get_args(AllocationState)
PENDING: AllocationState = "pending"
HOLDING: tuple[AllocationState, ...] = ("bound", "active")  # slices held on nodes
LIVE: tuple[AllocationState, ...] = (PENDING, *HOLDING)  # not ended: waiting or holding
ENDED: tuple[AllocationState, ...] = ("released", "preempted", "failed", "cancelled")  # final

# a cooperative RPC server's port, kept in its env: the pool picks it, and the node lets the job
# listen there alone (agent/port_guard.py)
RPC_PORT_ENV = "CPOOL_RPC_PORT"

IsolationName = Literal["timeslice", "mps", "mig", "exclusive"]
ISOLATIONS: tuple[IsolationName, ...] = get_args(IsolationName)


class Isolation(StrEnum):
    """How a slice is held to its share (docs/architecture.md, isolation tiers)."""

    EXCLUSIVE = "exclusive"
    MIG = "mig"
    MPS = "mps"
    TIMESLICE = "timeslice"


@dataclass(frozen=True)
class Slice:
    """The part of one device given to one allocation.

    On the wire (allocations, assignments) a slice is an object with these fields; `device_uuid`
    lets a node check that the device it has at `device_index` is the one the pool bound.
    """

    node: str
    device_index: int
    compute_milli: int
    memory_mib: int
    isolation: Isolation
    device_uuid: str = ""
    vendor: str = ""  # the device's (core/vendors.py); "" in slices bound before it was kept

    def to_wire(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "device_index": self.device_index,
            "device_uuid": self.device_uuid,
            "vendor": self.vendor,
            "compute_milli": self.compute_milli,
            "memory_mib": self.memory_mib,
            "isolation": str(self.isolation),
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any], *, default_isolation: str = Isolation.EXCLUSIVE) -> Slice:
        """A slice from its wire object (raises KeyError or ValueError on a malformed one)."""
        return cls(
            node=str(d.get("node") or ""),
            device_index=int(d["device_index"]),
            compute_milli=int(d.get("compute_milli") or 0),
            memory_mib=int(d.get("memory_mib") or 0),
            isolation=Isolation(d.get("isolation") or default_isolation),
            device_uuid=str(d.get("device_uuid") or ""),
            vendor=str(d.get("vendor") or ""),
        )
