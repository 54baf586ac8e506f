"""The SQL of the usage ledger: what is held and what devices report, booking (upserts that add
on SQLite and PostgreSQL alike), the ledger's clock, device history, prices, grouped usage, and
the allocation history the static equivalent is computed from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING
from computepool.store.models import (
    Allocation,
    AllocationEvent,
    Device,
    DeviceSample,
    LedgerClock,
    Node,
    Price,
    Service,
    Tenant,
    UsageEntry,
)

CLOCK_ID = 1
AMOUNTS = ("gpu_seconds", "cpu_seconds", "memory_mib_seconds", "energy_j", "idle_waste_j")
GROUP_COLUMNS = {
    "tenant": ("tenant",),
    "user": ("tenant", "user"),
    "job": ("tenant", "user", "job", "allocation_id"),
    "model": (),
}


# -- what the tick reads ----------------------------------------------------------------------


@dataclass(frozen=True)
class HeldRow:
    id: int
    tenant: str
    owner: str
    name: str
    service: str
    request: dict[str, Any]
    nodes: list[str]
    slices: list[dict[str, Any]]


def held(s: Session) -> list[HeldRow]:
    """Bound and active allocations with the names they are booked under."""
    stmt = (
        select(
            Allocation.id,
            Tenant.name,
            Allocation.owner,
            Allocation.name,
            Service.name,
            Allocation.request,
            Allocation.nodes,
            Allocation.slices,
        )
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .outerjoin(Service, Service.id == Allocation.service_id)
        .where(Allocation.state.in_(HOLDING))
        .order_by(Allocation.id)
    )
    return [
        HeldRow(r[0], r[1], r[2], r[3], r[4] or "", dict(r[5]), list(r[6]), list(r[7]))
        for r in s.execute(stmt).all()
    ]


@dataclass(frozen=True)
class DeviceRow:
    id: int
    node: str
    index: int
    model: str
    utilization_pct: float | None
    used_memory_mib: int | None
    power_w: float | None
    energy_j: float | None
    mark_j: float | None
    heartbeat_at: datetime
    compute_milli: int
    mig_parent_uuid: str | None


def devices(s: Session) -> list[DeviceRow]:
    stmt = (
        select(
            Device.id,
            Node.name,
            Device.index,
            Device.model,
            Device.utilization_pct,
            Device.used_memory_mib,
            Device.power_w,
            Device.energy_j,
            Device.energy_mark_j,
            Node.last_heartbeat_at,
            Device.compute_milli,
            Device.mig_parent_uuid,
        )
        .join(Node, Device.node_id == Node.id)
        .order_by(Node.name, Device.index)
    )
    return [DeviceRow(*tuple(r)) for r in s.execute(stmt).all()]


def set_marks(s: Session, marks: Mapping[int, float | None]) -> None:
    """Where the ledger booked each device's energy counter up to (by device id)."""
    for device_id, mark in marks.items():
        s.execute(update(Device).where(Device.id == device_id).values(energy_mark_j=mark))


# -- the clock ----------------------------------------------------------------------------------


def clock(s: Session) -> datetime | None:
    """Up to when the ledger has booked (None: never); locks the row on PostgreSQL."""
    stmt = select(LedgerClock.at).where(LedgerClock.id == CLOCK_ID)
    if s.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    return s.execute(stmt).scalar_one_or_none()


def set_clock(s: Session, at: datetime) -> None:
    row = s.get(LedgerClock, CLOCK_ID)
    if row is None:
        s.add(LedgerClock(id=CLOCK_ID, at=at))
    else:
        row.at = at
    s.flush()


# -- booking ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    hour: datetime
    allocation_id: int
    tenant: str
    user: str
    job: str
    service: str
    node: str
    model: str
    gpu_seconds: float
    cpu_seconds: float
    memory_mib_seconds: float
    energy_j: float
    idle_waste_j: float


def book(s: Session, entries: Sequence[Entry]) -> None:
    """Add the entries to their rows (hour, allocation, node, model), creating rows as needed."""
    if not entries:
        return
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    table = UsageEntry.__table__
    values = [e.__dict__ for e in entries]
    for i in range(0, len(values), 500):
        stmt = insert(table).values(values[i : i + 500])
        stmt = stmt.on_conflict_do_update(
            index_elements=["hour", "allocation_id", "node", "model"],
            set_={c: table.c[c] + stmt.excluded[c] for c in AMOUNTS},
        )
        s.execute(stmt)


# -- device history -----------------------------------------------------------------------------


def add_samples(s: Session, at: datetime, rows: Sequence[DeviceRow]) -> None:
    """One history point per device: what its node last reported, stamped with the tick's time."""
    if not rows:
        return
    s.execute(
        DeviceSample.__table__.insert(),
        [
            {
                "node": d.node,
                "device_index": d.index,
                "at": at,
                "utilization_pct": d.utilization_pct,
                "used_memory_mib": d.used_memory_mib,
                "power_w": d.power_w,
            }
            for d in rows
        ],
    )


def prune_samples(s: Session, before: datetime) -> int:
    result = s.execute(delete(DeviceSample).where(DeviceSample.at < before))
    return int(getattr(result, "rowcount", 0) or 0)


def history(s: Session, node: str, since: datetime, until: datetime) -> Sequence[DeviceSample]:
    stmt = (
        select(DeviceSample)
        .where(DeviceSample.node == node, DeviceSample.at >= since, DeviceSample.at < until)
        .order_by(DeviceSample.device_index, DeviceSample.at)
    )
    return s.scalars(stmt).all()


# -- prices -------------------------------------------------------------------------------------


def prices(s: Session) -> Sequence[Price]:
    return s.scalars(select(Price).order_by(Price.item)).all()


def set_price(s: Session, item: str, amount: float, now: datetime) -> Price:
    row = s.get(Price, item)
    if row is None:
        row = Price(item=item, amount=amount, updated_at=now)
        s.add(row)
    else:
        row.amount, row.updated_at = amount, now
    s.flush()
    return row


def delete_price(s: Session, item: str) -> bool:
    row = s.get(Price, item)
    if row is None:
        return False
    s.delete(row)
    s.flush()
    return True


# -- reading the ledger -------------------------------------------------------------------------


def grouped(
    s: Session, by: str, since: datetime, until: datetime, tenant: str | None
) -> list[dict[str, Any]]:
    """Sums per group key and model, over ledger hours in [since, until); `tenant` narrows to one."""
    keys = [UsageEntry.__table__.c[c] for c in GROUP_COLUMNS[by]]
    model = UsageEntry.model
    sums = [func.sum(UsageEntry.__table__.c[c]).label(c) for c in AMOUNTS]
    stmt = (
        select(*keys, model, *sums)
        .where(UsageEntry.hour >= since, UsageEntry.hour < until)
        .group_by(*keys, model)
    )
    if tenant is not None:
        stmt = stmt.where(UsageEntry.tenant == tenant)
    return [dict(r._mapping) for r in s.execute(stmt).all()]


def energy_by_model(s: Session, since: datetime, until: datetime, tenant: str | None) -> dict[str, float]:
    """Joules booked per device model over [since, until) (the pool's own rows included)."""
    stmt = (
        select(UsageEntry.model, func.sum(UsageEntry.energy_j))
        .where(UsageEntry.hour >= since, UsageEntry.hour < until, UsageEntry.model != "")
        .group_by(UsageEntry.model)
    )
    if tenant is not None:
        stmt = stmt.where(UsageEntry.tenant == tenant)
    return {m: float(j or 0.0) for m, j in s.execute(stmt).all()}


@dataclass(frozen=True)
class Past:
    """An allocation that may have held devices in a window, with its state changes."""

    id: int
    tenant: str
    state: str
    attempt: int
    request: dict[str, Any]
    slices: list[dict[str, Any]]
    events: list[tuple[datetime, str, int]]  # (at, state, attempt), oldest first


def history_of_allocations(s: Session, since: datetime, until: datetime, tenant: str | None) -> list[Past]:
    """Allocations bound at some time and not ended before `since`, created before `until`."""
    stmt = (
        select(
            Allocation.id,
            Tenant.name,
            Allocation.state,
            Allocation.attempt,
            Allocation.request,
            Allocation.slices,
        )
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .where(
            Allocation.created_at < until,
            (Allocation.ended_at.is_(None)) | (Allocation.ended_at >= since),
            Allocation.id.in_(select(AllocationEvent.allocation_id).where(AllocationEvent.state == "bound")),
        )
        .order_by(Allocation.id)
    )
    if tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    rows = s.execute(stmt).all()
    ids = [r[0] for r in rows]
    events: dict[int, list[tuple[datetime, str, int]]] = {i: [] for i in ids}
    for i in range(0, len(ids), 500):
        ev = (
            select(
                AllocationEvent.allocation_id,
                AllocationEvent.at,
                AllocationEvent.state,
                AllocationEvent.attempt,
            )
            .where(AllocationEvent.allocation_id.in_(ids[i : i + 500]))
            .order_by(AllocationEvent.id)
        )
        for alloc_id, at, state, attempt in s.execute(ev).all():
            events[alloc_id].append((at, state, attempt))
    return [Past(r[0], r[1], r[2], r[3], dict(r[4]), list(r[5]), events[r[0]]) for r in rows]


def device_models(s: Session) -> dict[tuple[str, int], str]:
    stmt = select(Node.name, Device.index, Device.model).join(Node, Device.node_id == Node.id)
    return {(n, i): m for n, i, m in s.execute(stmt).all()}


def node_exists(s: Session, name: str) -> bool:
    return s.execute(select(Node.id).where(Node.name == name)).first() is not None
