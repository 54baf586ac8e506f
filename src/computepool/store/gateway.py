"""The gateway's SQL: what it routes to (services and ready replicas), rate limits, usage.

Gateways read the routing view about twice a second as a whole (a few rows per service), never
per request; usage is added in batches, as increments, so several gateways can count at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import case, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session

from computepool.store.models import (
    Allocation,
    GatewayLimit,
    GatewayUsage,
    Node,
    Service,
    Tenant,
)
from computepool.store.services import KEY_ENV


@dataclass(frozen=True)
class ServiceRow:
    id: int
    tenant_id: int
    tenant: str
    name: str
    spec: dict[str, Any]
    created_at: datetime
    reason: str = ""  # the service controller's last word on it


@dataclass(frozen=True)
class ReplicaRow:
    allocation_id: int
    service_id: int
    endpoint: str
    key: str | None = field(default=None, repr=False)  # its CPOOL_SERVICE_KEY, sent as a bearer token


@dataclass(frozen=True)
class LimitRow:
    tenant: str
    requests_per_minute: int
    burst: int


def live_services(s: Session) -> list[ServiceRow]:
    rows = s.execute(
        select(Service, Tenant.name)
        .join(Tenant, Tenant.id == Service.tenant_id)
        .where(Service.deleted_at.is_(None))
        .order_by(Service.id)
    ).all()
    return [
        ServiceRow(sv.id, sv.tenant_id, tname, sv.name, sv.spec, sv.created_at, sv.reason)
        for sv, tname in rows
    ]


def ready_replicas(s: Session) -> list[ReplicaRow]:
    """Active allocations of a service whose replica answered its health path, with where they
    listen (their node's address and the replica's port) and the key their engine asks for."""
    rows = s.execute(
        select(
            Allocation.id, Allocation.service_id, Allocation.service_port, Allocation.nodes, Allocation.env
        ).where(
            Allocation.service_id.is_not(None),
            Allocation.state == "active",
            Allocation.replica_state == "ready",
        )
    ).all()
    names = {r.nodes[0] for r in rows if r.nodes}
    address: dict[str, str] = {}
    if names:
        address = dict(s.execute(select(Node.name, Node.address).where(Node.name.in_(names))).all())
    out: list[ReplicaRow] = []
    for r in rows:
        if not r.nodes or r.service_port is None or r.service_id is None:
            continue
        host = address.get(r.nodes[0]) or ""
        if not host:
            continue
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address in a URL
        key = (r.env or {}).get(KEY_ENV)
        out.append(ReplicaRow(r.id, r.service_id, f"http://{host}:{r.service_port}", key))
    return out


def limits(s: Session) -> list[LimitRow]:
    rows = s.execute(
        select(Tenant.name, GatewayLimit.requests_per_minute, GatewayLimit.burst).join(
            Tenant, Tenant.id == GatewayLimit.tenant_id
        )
    ).all()
    return [LimitRow(t, rpm, burst) for t, rpm, burst in rows]


def get_limit(s: Session, tenant_id: int) -> GatewayLimit | None:
    return s.get(GatewayLimit, tenant_id)


def set_limit(s: Session, tenant_id: int, rpm: int, burst: int) -> GatewayLimit:
    row = s.get(GatewayLimit, tenant_id)
    if row is None:
        row = GatewayLimit(tenant_id=tenant_id, requests_per_minute=rpm, burst=burst)
        s.add(row)
    else:
        row.requests_per_minute = rpm
        row.burst = burst
    s.flush()
    return row


def delete_limit(s: Session, tenant_id: int) -> bool:
    gl = GatewayLimit.__table__
    return bool(s.connection().execute(gl.delete().where(gl.c.tenant_id == tenant_id)).rowcount)


@dataclass
class UsageCount:
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


UsageKey = tuple[int, str, str, str, datetime]  # tenant id, user, token id, service, hour


USAGE_MAX = 10**15  # a stored count stops here: sums of capped counts never overflow 64 bits


def _capped(expr: Any) -> Any:
    return case((expr > USAGE_MAX, USAGE_MAX), else_=expr)


def add_usage(s: Session, counts: Mapping[UsageKey, UsageCount]) -> list[UsageKey]:
    """Add the counts to their rows (created at zero when missing), atomically per row; returns
    the keys of rows the database refused (a tenant deleted meanwhile, a value out of range),
    which are dropped: each row has its own savepoint, so one bad row never blocks the others."""
    dialect = postgresql if s.get_bind().dialect.name == "postgresql" else sqlite
    table = GatewayUsage.__table__
    refused: list[UsageKey] = []
    for key, c in counts.items():
        tenant_id, user, token_id, service, hour = key
        stmt = dialect.insert(table).values(
            tenant_id=tenant_id,
            user=user,
            token_id=token_id,
            service=service,
            hour=hour,
            requests=min(c.requests, USAGE_MAX),
            failed=min(c.failed, USAGE_MAX),
            prompt_tokens=min(c.prompt_tokens, USAGE_MAX),
            completion_tokens=min(c.completion_tokens, USAGE_MAX),
        )
        ex = stmt.excluded
        stmt = stmt.on_conflict_do_update(
            index_elements=["tenant_id", "user", "token_id", "service", "hour"],
            set_={
                "requests": _capped(table.c.requests + ex.requests),
                "failed": _capped(table.c.failed + ex.failed),
                "prompt_tokens": _capped(table.c.prompt_tokens + ex.prompt_tokens),
                "completion_tokens": _capped(table.c.completion_tokens + ex.completion_tokens),
            },
        )
        try:
            with s.begin_nested():
                s.execute(stmt)
        except (IntegrityError, DataError, OverflowError):
            refused.append(key)
    return refused


def delete_usage_before(s: Session, before: datetime) -> int:
    """Drop the usage rows of hours before `before` (the retention); returns how many."""
    table = GatewayUsage.__table__
    return int(s.connection().execute(table.delete().where(table.c.hour < before)).rowcount or 0)


def usage_rows(
    s: Session, since: datetime, tenant: str | None, service: str | None, limit: int
) -> list[tuple[GatewayUsage, str]]:
    q = (
        select(GatewayUsage, Tenant.name)
        .join(Tenant, Tenant.id == GatewayUsage.tenant_id)
        .where(GatewayUsage.hour >= since)
    )
    if tenant is not None:
        q = q.where(Tenant.name == tenant)
    if service is not None:
        q = q.where(GatewayUsage.service == service)
    q = q.order_by(
        GatewayUsage.hour, Tenant.name, GatewayUsage.service, GatewayUsage.user, GatewayUsage.token_id
    ).limit(limit)
    return [(u, t) for u, t in s.execute(q).all()]


def touch_services(s: Session, service_ids: Iterable[int], now: datetime) -> None:
    """Record that requests for these services arrived (the controller's idle clock)."""
    ids = list(service_ids)
    if ids:
        s.execute(update(Service).where(Service.id.in_(ids)).values(last_request_at=now))
