"""The SQL of the usage ledger: what is held and what devices report, booking (upserts that add
on SQLite and PostgreSQL alike), the ledger's clock, device history, prices, grouped usage, and
the allocation history the static equivalent is computed from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, delete, func, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.sql.elements import ColumnElement

from computepool.core.allocation import HOLDING
from computepool.store.db import APPLICATION_NAME
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
    attempt: int = 1
    bound_at: datetime | None = None
    ended_at: datetime | None = None  # None while it still holds


def held(s: Session, since: datetime | None = None) -> list[HeldRow]:
    """Allocations that held devices at some time after `since` (default: now), with the names they
    are booked under: bound and active ones, and ones ended since then (an ended allocation keeps
    its slices)."""
    holding: ColumnElement[bool] = Allocation.state.in_(HOLDING)
    if since is not None:
        holding = holding | (
            Allocation.bound_at.is_not(None)
            & Allocation.ended_at.is_not(None)
            & (Allocation.ended_at >= since)
        )
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
            Allocation.attempt,
            Allocation.bound_at,
            Allocation.ended_at,
            Allocation.state,
        )
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .outerjoin(Service, Service.id == Allocation.service_id)
        .where(holding)
        .order_by(Allocation.id)
    )
    return [
        HeldRow(
            r[0], r[1], r[2], r[3], r[4] or "", dict(r[5]), list(r[6]), list(r[7]), r[8], r[9],
            None if r[11] in HOLDING else r[10],
        )
        for r in s.execute(stmt).all()
    ]  # fmt: skip


def requeued_at(s: Session, attempts: Mapping[int, int]) -> dict[int, datetime]:
    """When each allocation's given attempt was requeued (the event that opened the next attempt),
    for those that were (allocation id → attempt)."""
    out: dict[int, datetime] = {}
    ids = list(attempts)
    for i in range(0, len(ids), 500):
        stmt = (
            select(AllocationEvent.allocation_id, AllocationEvent.attempt, func.min(AllocationEvent.at))
            .where(AllocationEvent.allocation_id.in_(ids[i : i + 500]))
            .group_by(AllocationEvent.allocation_id, AllocationEvent.attempt)
        )
        for alloc_id, attempt, at in s.execute(stmt).all():
            if attempt == attempts[alloc_id] + 1:
                out[alloc_id] = at
    return out


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


_SET_MARK = (
    update(Device.__table__)
    .where(Device.__table__.c.id == bindparam("device_id"))
    .values(energy_mark_j=bindparam("mark"))
)


def set_marks(s: Session, marks: Mapping[int, float | None]) -> None:
    """Where the ledger booked each device's energy counter up to (by device id): one statement
    executed for all rows, so a large pool's pass stays short under the write lock."""
    if marks:
        s.connection().execute(_SET_MARK, [{"device_id": i, "mark": m} for i, m in marks.items()])


# -- the clock ----------------------------------------------------------------------------------


def clock(s: Session) -> datetime | None:
    """Up to when the ledger has booked (None: never); locks the row on PostgreSQL."""
    stmt = select(LedgerClock.at).where(LedgerClock.id == CLOCK_ID)
    if s.get_bind().dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    return s.execute(stmt).scalar_one_or_none()


_HORIZON = text(
    "SELECT min(xact_start) FROM pg_stat_activity "
    "WHERE datname = current_database() AND pid <> pg_backend_pid() AND state <> 'idle' "
    "AND xact_start IS NOT NULL AND backend_type = 'client backend' AND application_name = :app"
).bindparams(app=APPLICATION_NAME)


def open_since(s: Session) -> datetime | None:
    """When the oldest transaction of the pool's still open on the database (other than this one)
    began; None when there is none, and always on SQLite, whose writers take turns.

    A transaction stamps an allocation's end with the clock it read when it began its work, and
    commits later: booking up to a time after that start could book past an end not yet visible.
    The ledger books no further than this (nothing is lost: the next pass books the rest)."""
    if s.get_bind().dialect.name != "postgresql":
        return None
    at = s.execute(_HORIZON).scalar_one_or_none()
    return at.astimezone(UTC) if at is not None else None


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


def last_sample_at(s: Session) -> datetime | None:
    return s.execute(select(func.max(DeviceSample.at))).scalar_one_or_none()


def history(
    s: Session, node: str, since: datetime, until: datetime, points: int
) -> list[tuple[int, datetime, float | None, int | None, float | None]]:
    """A node's samples in [since, until), thinned in the database to about `points` evenly
    spaced ones per device (the latest always kept): a week of minutes stays a small answer.
    Rows: (device index, at, utilization %, used memory MiB, power W)."""
    t = DeviceSample.__table__.c
    window = (t.node == node) & (t.at >= since) & (t.at < until)
    n = func.row_number().over(partition_by=t.device_index, order_by=t.at).label("n")
    total = func.count().over(partition_by=t.device_index).label("total")
    inner = select(t.device_index, t.at, t.utilization_pct, t.used_memory_mib, t.power_w, n, total).where(
        window
    )
    sub = inner.subquery()
    step = (sub.c.total + points - 1) // points
    stmt = (
        select(sub.c.device_index, sub.c.at, sub.c.utilization_pct, sub.c.used_memory_mib, sub.c.power_w)
        .where(((sub.c.n - 1) % step == 0) | (sub.c.n == sub.c.total))
        .order_by(sub.c.device_index, sub.c.at)
    )
    return [(r[0], r[1], r[2], r[3], r[4]) for r in s.execute(stmt).all()]


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
    s: Session, by: str, since: datetime, until: datetime, tenant: str | None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Sums per group key and model, over ledger hours in [since, until); `tenant` narrows to one.
    With `limit`, at most limit + 1 rows (the extra one says more were left out), newest
    allocations first."""
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
    if limit is not None:
        stmt = stmt.order_by(*(k.desc() for k in reversed(keys)), model).limit(limit + 1)
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


def known_models(s: Session) -> set[str]:
    """Device models the pool has now or has booked use of: what a price can apply to."""
    now = set(s.execute(select(Device.model).distinct()).scalars())
    booked = s.execute(select(UsageEntry.model).where(UsageEntry.model != "").distinct()).scalars()
    return now | set(booked)


def node_exists(s: Session, name: str) -> bool:
    return s.execute(select(Node.id).where(Node.name == name)).first() is not None
