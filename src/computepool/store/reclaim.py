"""The SQL of time limits and idle reclaim: tenants' policies, held allocations with what their
devices last reported, warning events, and ending an allocation under the scheduler's lease."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.store import allocations
from computepool.store.models import Allocation, AllocationEvent, Device, Node, ReclaimPolicy, Tenant


@dataclass(frozen=True)
class Policy:
    idle_s: int
    warn_s: int
    updated_at: datetime


def get_policy(s: Session, tenant: Tenant) -> Policy | None:
    row = s.get(ReclaimPolicy, tenant.id)
    return None if row is None else Policy(row.idle_s, row.warn_s, row.updated_at)


def set_policy(s: Session, tenant: Tenant, idle_s: int, warn_s: int, now: datetime) -> Policy:
    row = s.get(ReclaimPolicy, tenant.id)
    if row is None:
        row = ReclaimPolicy(tenant_id=tenant.id, idle_s=idle_s, warn_s=warn_s, updated_at=now)
        s.add(row)
    else:
        row.idle_s, row.warn_s, row.updated_at = idle_s, warn_s, now
    s.flush()
    return Policy(idle_s, warn_s, now)


def delete_policy(s: Session, tenant: Tenant) -> bool:
    """Whether there was a policy to remove."""
    row = s.get(ReclaimPolicy, tenant.id)
    if row is None:
        return False
    s.delete(row)
    s.flush()
    return True


def policies(s: Session) -> dict[str, Policy]:
    """Every tenant's policy, by tenant name (tenants without one are not reclaimed)."""
    stmt = select(Tenant.name, ReclaimPolicy.idle_s, ReclaimPolicy.warn_s, ReclaimPolicy.updated_at).join(
        ReclaimPolicy, ReclaimPolicy.tenant_id == Tenant.id
    )
    return {name: Policy(idle, warn, at) for name, idle, warn, at in s.execute(stmt).all()}


@dataclass(frozen=True)
class Held:
    """A bound or active allocation, as the reclaim controller needs it."""

    id: int
    tenant: str
    state: str
    attempt: int
    request: dict[str, Any]
    slices: list[dict[str, Any]]
    bound_at: datetime | None


def held(s: Session) -> list[Held]:
    stmt = (
        select(
            Allocation.id,
            Tenant.name,
            Allocation.state,
            Allocation.attempt,
            Allocation.request,
            Allocation.slices,
            Allocation.bound_at,
        )
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .where(Allocation.state.in_(allocations.HOLDING))
        .order_by(Allocation.id)
    )
    return [Held(r[0], r[1], r[2], r[3], dict(r[4]), list(r[5]), r[6]) for r in s.execute(stmt).all()]


@dataclass(frozen=True)
class DeviceSeen:
    """What a device's node last said of it, and when (the node's last heartbeat)."""

    utilization_pct: float | None
    used_memory_mib: int | None
    heartbeat_at: datetime


def device_usage(s: Session) -> dict[tuple[str, int], DeviceSeen]:
    stmt = select(
        Node.name, Device.index, Device.utilization_pct, Device.used_memory_mib, Node.last_heartbeat_at
    ).join(Node, Device.node_id == Node.id)
    return {(n, i): DeviceSeen(u, m, at) for n, i, u, m, at in s.execute(stmt).all()}


def warnings_of(s: Session, ids: Sequence[int], prefix: str) -> dict[tuple[int, int], datetime]:
    """(allocation, attempt) → when its first event whose reason starts with `prefix` was written."""
    if not ids:
        return {}
    out: dict[tuple[int, int], datetime] = {}
    for i in range(0, len(ids), 500):
        stmt = (
            select(AllocationEvent.allocation_id, AllocationEvent.attempt, AllocationEvent.at)
            .where(
                AllocationEvent.allocation_id.in_(ids[i : i + 500]),
                AllocationEvent.reason.startswith(prefix),
            )
            .order_by(AllocationEvent.id)
        )
        for alloc_id, attempt, at in s.execute(stmt).all():
            out.setdefault((alloc_id, attempt), at)
    return out


def add_note(s: Session, a: Allocation, reason: str, now: datetime) -> None:
    """An event that changes nothing but says something (a warning), in the allocation's history."""
    s.add(
        AllocationEvent(
            allocation_id=a.id, at=now, state=a.state, reason=reason[:1024], attempt=a.attempt, term=a.term
        )
    )
