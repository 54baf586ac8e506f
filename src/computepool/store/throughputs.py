"""The SQL of measured speeds: which running allocations a node's progress reports are about, the
exponentially weighted update of a (tenant, job type, device model, device count) row, and reading
the rows back (for the API, scoped to a tenant, and for the scheduler's snapshot)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from computepool.store.models import Allocation, AllocationNode, Device, Node, Tenant, Throughput

_T = Throughput.__table__


@dataclass(frozen=True)
class Running:
    """What a progress report needs of the allocation it names, on the reporting node."""

    id: int
    attempt: int
    tenant_id: int
    request: dict[str, Any]
    nodes: list[str]
    models: list[str]  # the models of its devices on the reporting node, one per slice


def running_on(s: Session, node: str, ids: Iterable[int]) -> dict[int, Running]:
    """The allocations among `ids` that are active on `node`, with their device models there."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    rows = s.execute(
        select(Allocation)
        .join(AllocationNode, AllocationNode.allocation_id == Allocation.id)
        .where(AllocationNode.node == node, Allocation.id.in_(wanted), Allocation.state == "active")
    ).scalars()
    found = list(rows)
    if not found:
        return {}
    by_index = dict(
        s.execute(
            select(Device.index, Device.model).join(Node, Node.id == Device.node_id).where(Node.name == node)
        ).all()
    )
    out: dict[int, Running] = {}
    for a in found:
        mine = [sl for sl in a.slices or [] if sl.get("node") == node]
        models = [by_index.get(int(sl["device_index"]), "") for sl in mine]
        out[a.id] = Running(a.id, a.attempt, a.tenant_id, dict(a.request), list(a.nodes), models)
    return out


def record(
    s: Session,
    tenant_id: int,
    job_type: str,
    model: str,
    devices: int,
    rate: float,
    now: datetime,
    alpha: float,
) -> None:
    """Fold one steps/s report into its row: the first sets the mean, each later one moves it by
    `alpha` of the difference (one statement: two nodes reporting at once never collide)."""
    insert = postgresql.insert if s.get_bind().dialect.name == "postgresql" else sqlite.insert
    stmt = insert(_T).values(
        tenant_id=tenant_id,
        job_type=job_type,
        model=model,
        devices=devices,
        steps_per_s=rate,
        samples=1,
        updated_at=now,
    )
    ex = stmt.excluded
    s.execute(
        stmt.on_conflict_do_update(
            index_elements=["tenant_id", "job_type", "model", "devices"],
            set_={
                "steps_per_s": _T.c.steps_per_s + alpha * (ex.steps_per_s - _T.c.steps_per_s),
                "samples": _T.c.samples + 1,
                "updated_at": ex.updated_at,
            },
        )
    )


@dataclass(frozen=True)
class Row:
    tenant: str
    job_type: str
    model: str
    devices: int
    steps_per_s: float
    samples: int
    updated_at: datetime


def rows(s: Session, tenant: str | None = None, job_type: str | None = None) -> list[Row]:
    """Every row (`tenant` None) or one tenant's, maybe of one job type; by tenant, type, model, count."""
    stmt = select(
        Tenant.name, _T.c.job_type, _T.c.model, _T.c.devices, _T.c.steps_per_s, _T.c.samples, _T.c.updated_at
    ).join(Tenant, Tenant.id == _T.c.tenant_id)
    if tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    if job_type is not None:
        stmt = stmt.where(_T.c.job_type == job_type)
    stmt = stmt.order_by(Tenant.name, _T.c.job_type, _T.c.model, _T.c.devices)
    return [Row(*r) for r in s.execute(stmt).all()]


def speeds(s: Session, tenants: Sequence[str]) -> dict[str, dict[tuple[str, int], dict[str, float]]]:
    """For the scheduler: per tenant, (job type, devices) → model → steps/s."""
    out: dict[str, dict[tuple[str, int], dict[str, float]]] = {}
    if not tenants:
        return out
    stmt = (
        select(Tenant.name, _T.c.job_type, _T.c.devices, _T.c.model, _T.c.steps_per_s)
        .join(Tenant, Tenant.id == _T.c.tenant_id)
        .where(Tenant.name.in_(sorted(set(tenants))))
    )
    for tenant, job_type, devices, model, rate in s.execute(stmt).all():
        out.setdefault(tenant, {}).setdefault((job_type, devices), {})[model] = float(rate)
    return out
