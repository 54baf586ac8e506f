"""The scheduling cycle's SQL: what a snapshot reads and what a commit writes in bulk.

Statements are built once as plain Core (a busy pool runs many cycles a second). The decisions
themselves live in `server.scheduling`; this module only knows rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from computepool.store import audit
from computepool.store.models import (
    Allocation,
    AllocationEvent,
    AllocationNode,
    QuotaEntry,
    Tenant,
)
from computepool.store.models import Device as DeviceRow
from computepool.store.models import Node as NodeRow

CHUNK = 500  # ids per IN (...) list: well under every backend's parameter limit
Quotas = dict[tuple[str, str], tuple[int, int]]  # (model or "", resource) → (guaranteed, limit)

_NODE_T = NodeRow.__table__
_TENANT_T = Tenant.__table__
_OWNER_T = _TENANT_T.alias("owner")
_NODE_ROWS = (
    select(
        _NODE_T.c.id,
        _NODE_T.c.name,
        _NODE_T.c.cpu_milli,
        _NODE_T.c.memory_mib,
        _NODE_T.c.last_heartbeat_at,
        _NODE_T.c.cordoned,
        _NODE_T.c.joined_at,
        _NODE_T.c.draining,
        _NODE_T.c.labels,
        _NODE_T.c.taints,
        _OWNER_T.c.name,
        _NODE_T.c.lending,
    )
    .select_from(_NODE_T.outerjoin(_OWNER_T, _NODE_T.c.dedicated_tenant_id == _OWNER_T.c.id))
    .order_by(_NODE_T.c.name)
)
_WEIGHTS = select(_TENANT_T.c.name, _TENANT_T.c.weight)
_QUOTA_T = QuotaEntry.__table__
_QUOTAS = select(
    _TENANT_T.c.name, _QUOTA_T.c.model, _QUOTA_T.c.resource, _QUOTA_T.c.guaranteed, _QUOTA_T.c.limit_value
).join(_TENANT_T, _QUOTA_T.c.tenant_id == _TENANT_T.c.id)
_NODE_NAMES = select(_NODE_T.c.name)


# --- snapshot reads ----------------------------------------------------------------------------
def node_rows(s: Session) -> Sequence[Any]:
    """(id, name, cpu_milli, memory_mib, last_heartbeat_at, cordoned, joined_at, draining, labels,
    taints, dedicated tenant's name or None, lending), by name."""
    return s.connection().execute(_NODE_ROWS).all()


def device_rows(
    s: Session, node_ids: Sequence[int]
) -> dict[int, list[tuple[int, str, int, int, str, str | None, str, str]]]:
    """node id → its devices as (index, model, memory_mib, compute_milli, uuid, mig_parent_uuid,
    link_group, vendor), by index."""
    found: dict[int, list[tuple[int, str, int, int, str, str | None, str, str]]] = {i: [] for i in node_ids}
    for k in range(0, len(node_ids), CHUNK):
        stmt = (
            select(
                DeviceRow.node_id,
                DeviceRow.index,
                DeviceRow.model,
                DeviceRow.memory_mib,
                DeviceRow.compute_milli,
                DeviceRow.uuid,
                DeviceRow.mig_parent_uuid,
                DeviceRow.link_group,
                DeviceRow.vendor,
            )
            .where(DeviceRow.node_id.in_(node_ids[k : k + CHUNK]))
            .order_by(DeviceRow.node_id, DeviceRow.index)
        )
        for nid, index, model, mem, milli, dev_uuid, parent, link, vendor in s.execute(stmt):
            found[nid].append((index, model, mem, milli, dev_uuid, parent, link, vendor))
    return found


def tenants_and_quotas(s: Session) -> tuple[dict[str, float], dict[str, Quotas]]:
    """Tenant weights, and per tenant (model, resource) → (guaranteed, limit)."""
    conn = s.connection()
    weights = {name: w for name, w in conn.execute(_WEIGHTS).all()}
    quotas: dict[str, Quotas] = {t: {} for t in weights}
    for tenant, model, res, g, lim in conn.execute(_QUOTAS).all():
        quotas[tenant][(model, res)] = (int(g), int(lim))
    return weights, quotas


def node_names(s: Session) -> set[str]:
    return set(s.connection().execute(_NODE_NAMES).scalars().all())


# --- commit writes -----------------------------------------------------------------------------
class BindLike(Protocol):
    """What a bind decision carries into the store (the server's `Bind`)."""

    @property
    def id(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def nodes(self) -> list[str]: ...
    @property
    def slices(self) -> list[dict[str, Any]]: ...
    @property
    def note(self) -> str: ...  # appended to the reason, e.g. that it borrows a dedicated node
    @property
    def preempted(self) -> tuple[int, ...]: ...


B = TypeVar("B", bound=BindLike)


def lock_allocations(s: Session, ids: list[int]) -> dict[int, Allocation]:
    """The allocations as ORM rows, locked (PostgreSQL) until commit."""
    out: dict[int, Allocation] = {}
    for i in range(0, len(ids), CHUNK):
        chunk = ids[i : i + CHUNK]
        stmt = select(Allocation).where(Allocation.id.in_(chunk)).with_for_update(of=Allocation)
        out.update((a.id, a) for a in s.scalars(stmt).unique().all())
    return out


def bind_heads(s: Session, ids: list[int]) -> dict[int, tuple[str, int, str]]:
    """id → (state, attempt, tenant) of the allocations to bind, locked (PostgreSQL) until commit."""
    out: dict[int, tuple[str, int, str]] = {}
    for i in range(0, len(ids), CHUNK):
        stmt = (
            select(Allocation.id, Allocation.state, Allocation.attempt, Tenant.name)
            .join(Tenant, Allocation.tenant_id == Tenant.id)
            .where(Allocation.id.in_(ids[i : i + CHUNK]))
            .with_for_update(of=Allocation)
        )
        out.update((r[0], (r[1], r[2], r[3])) for r in s.execute(stmt))
    return out


def audit_scheduler(
    s: Session, now: datetime, action: str, a: Allocation, term: int, detail: dict[str, Any]
) -> None:
    """One audit record of a scheduler decision about `a`, stamped with the term that made it."""
    event = audit.AuditEvent(
        actor="scheduler",
        action=action,
        target=f"allocation:{a.id}",
        outcome="ok",
        request_id=f"term:{term}",
        tenant=a.tenant.name,
        detail={"term": term, "attempt": a.attempt, **detail},
    )
    audit.append(s, event, now)


def write_binds(
    s: Session,
    binds: list[B],
    rows: dict[int, tuple[str, int, str]],
    term: int,
    now: datetime,
    names: set[str],
) -> list[B]:
    """Bind every still-pending allocation in a few statements: rows, node index, events, audit.

    `rows` are `bind_heads`; a bind whose allocation changed since the snapshot (no longer
    pending, another attempt) or names a node that left is skipped. Returns the binds written.
    """
    done = [
        b
        for b in binds
        if (r := rows.get(b.id)) is not None
        and r[0] == "pending"
        and r[1] == b.attempt
        and set(b.nodes) <= names
    ]
    if not done:
        return done
    reasons = {
        b.id: ((f"bound on {', '.join(b.nodes)}" if b.nodes else "bound") + b.note)[:1024] for b in done
    }
    upd = (
        update(Allocation)
        .where(Allocation.id == bindparam("b_id"))
        .values(
            state="bound",
            reason=bindparam("b_reason"),
            term=term,
            bound_at=now,
            nodes=bindparam("b_nodes"),
            slices=bindparam("b_slices"),
        )
    )
    conn = s.connection()
    conn.execute(
        upd,
        [
            {"b_id": b.id, "b_reason": reasons[b.id], "b_nodes": list(b.nodes), "b_slices": list(b.slices)}
            for b in done
        ],
    )
    conn.execute(
        AllocationNode.__table__.insert(),
        [{"allocation_id": b.id, "node": n} for b in done for n in dict.fromkeys(b.nodes)],
    )
    conn.execute(
        AllocationEvent.__table__.insert(),
        [
            {
                "allocation_id": b.id,
                "at": now,
                "state": "bound",
                "reason": reasons[b.id],
                "attempt": b.attempt,
                "term": term,
            }
            for b in done
        ],
    )
    audit.append_many(
        s,
        [
            audit.AuditEvent(
                actor="scheduler",
                action="allocation.bind",
                target=f"allocation:{b.id}",
                outcome="ok",
                request_id=f"term:{term}",
                tenant=rows[b.id][2],
                detail={"term": term, "attempt": b.attempt, "nodes": b.nodes, "preempted": list(b.preempted)},
            )
            for b in done
        ],
        now,
    )
    return done
