"""Model services and their replicas (allocations with a `service_id`): the SQL of both.

A service row holds its validated spec; a replica is an ordinary allocation row carrying the
service, the spec generation it runs, its port and what the service controller found of it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE, AllocationState
from computepool.core.states import ReplicaState
from computepool.store import allocations as alloc_store
from computepool.store.models import Allocation, GatewayLoad, Node, Service, Tenant

KEY_ENV = "CPOOL_SERVICE_KEY"  # a replica's own key: only who shows it (the gateway) may use the engine


def endpoint_of(address: str | None, port: int | None) -> str | None:
    """`http://ADDRESS:PORT` of a replica, an IPv6 address in brackets; None without an address or
    port (a node's name is never looked up instead: DNS could send the key elsewhere)."""
    if not address or port is None:
        return None
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"http://{host}:{port}"


@dataclass(frozen=True)
class ServiceRow:
    id: int
    tenant_id: int
    tenant: str
    owner: str
    name: str
    spec: dict[str, Any]
    generation: int
    desired: int
    reason: str
    last_request_at: datetime | None
    created_at: datetime
    updated_at: datetime
    deleted_at: datetime | None


@dataclass(frozen=True)
class ReplicaRow:
    """A live replica as the controller and the API see it (`address`: its node's, once bound)."""

    id: int
    service_id: int
    state: AllocationState
    attempt: int
    replica_state: ReplicaState | None
    generation: int
    port: int | None
    node: str | None
    address: str | None
    since: datetime | None
    started_at: datetime | None
    reason: str
    key: str | None = field(default=None, repr=False)  # the replica's CPOOL_SERVICE_KEY
    listener: str | None = None  # who listens on its port, as its node's agent found it (own/other/none)

    @property
    def endpoint(self) -> str | None:
        if self.node is None or self.state not in ("bound", "active"):
            return None
        return endpoint_of(self.address, self.port)


_COLUMNS = (
    Service.id,
    Service.tenant_id,
    Tenant.name,
    Service.owner,
    Service.name,
    Service.spec,
    Service.generation,
    Service.desired,
    Service.reason,
    Service.last_request_at,
    Service.created_at,
    Service.updated_at,
    Service.deleted_at,
)


def _row(r: Any) -> ServiceRow:
    return ServiceRow(*r)


def _select() -> Any:
    return select(*_COLUMNS).join(Tenant, Tenant.id == Service.tenant_id)


def by_name(s: Session, tenant_id: int, name: str, *, lock: bool = False) -> ServiceRow | None:
    """The tenant's (not deleted) service called `name`; `lock` holds its row until commit."""
    stmt = _select().where(Service.tenant_id == tenant_id, Service.name == name, Service.deleted_at.is_(None))
    if lock:
        stmt = stmt.with_for_update(of=Service)
    r = s.execute(stmt).first()
    return None if r is None else _row(r)


def list_services(s: Session, tenant: str | None) -> list[ServiceRow]:
    """Services not deleted, of one tenant (None: all), by tenant and name."""
    stmt = _select().where(Service.deleted_at.is_(None))
    if tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    return [_row(r) for r in s.execute(stmt.order_by(Tenant.name, Service.name))]


def by_ids(s: Session, ids: Sequence[int]) -> dict[int, ServiceRow]:
    if not ids:
        return {}
    return {r[0]: _row(r) for r in s.execute(_select().where(Service.id.in_(list(ids))))}


def insert(s: Session, tenant_id: int, owner: str, name: str, spec: dict[str, Any], now: datetime) -> int:
    row = Service(
        tenant_id=tenant_id,
        owner=owner,
        name=name,
        spec=spec,
        generation=1,
        desired=0,
        reason="created",
        created_at=now,
        updated_at=now,
    )
    s.add(row)
    s.flush()
    return int(row.id)


def set_spec(s: Session, sid: int, spec: dict[str, Any], generation: int, now: datetime) -> None:
    s.execute(
        update(Service).where(Service.id == sid).values(spec=spec, generation=generation, updated_at=now)
    )


def mark_deleted(s: Session, sid: int, now: datetime) -> None:
    s.execute(
        update(Service)
        .where(Service.id == sid)
        .values(deleted_at=now, updated_at=now, desired=0, reason="deleted: replicas draining")
    )


def set_decision(s: Session, sid: int, desired: int, reason: str) -> None:
    s.execute(update(Service).where(Service.id == sid).values(desired=desired, reason=reason[:1024]))


def replicas(s: Session, service_ids: Sequence[int] | None = None) -> list[ReplicaRow]:
    """Live (pending, bound, active) replicas, of these services or of all, by id."""
    stmt = (
        select(
            Allocation.id,
            Allocation.service_id,
            Allocation.state,
            Allocation.attempt,
            Allocation.replica_state,
            Allocation.service_generation,
            Allocation.service_port,
            Allocation.nodes,
            Allocation.replica_since,
            Allocation.started_at,
            Allocation.reason,
            Allocation.env,
            Allocation.replica_listener,
        )
        .where(Allocation.service_id.is_not(None), Allocation.state.in_(LIVE))
        .order_by(Allocation.id)
    )
    if service_ids is not None:
        if not service_ids:
            return []
        stmt = stmt.where(Allocation.service_id.in_(list(service_ids)))
    rows = s.execute(stmt).all()
    names = {r.nodes[0] for r in rows if r.nodes}
    addresses: dict[str, str] = {}
    if names:
        addresses = {n: a for n, a in s.execute(select(Node.name, Node.address).where(Node.name.in_(names)))}
    out = []
    for r in rows:
        node = r.nodes[0] if r.nodes else None
        out.append(
            ReplicaRow(
                id=r.id,
                service_id=r.service_id,
                state=r.state,
                attempt=r.attempt,
                replica_state=r.replica_state,
                generation=r.service_generation or 0,
                port=r.service_port,
                node=node,
                address=addresses.get(node) if node else None,
                since=r.replica_since,
                started_at=r.started_at,
                reason=r.reason,
                key=(r.env or {}).get(KEY_ENV),
                listener=r.replica_listener,
            )
        )
    return out


def services_with_replicas(s: Session) -> list[int]:
    """Services, deleted ones included, that still have live replicas."""
    stmt = select(Allocation.service_id).where(Allocation.service_id.is_not(None), Allocation.state.in_(LIVE))
    return sorted({int(sid) for sid in s.execute(stmt.distinct()).scalars() if sid is not None})


def used_ports(s: Session, now: datetime, cooldown_s: float) -> set[int]:
    """Ports held by live replicas of any service, and by replicas that ended within `cooldown_s`:
    the row ends before the agent has stopped the engine, which may still hold the port."""
    recent = now - timedelta(seconds=cooldown_s)
    stmt = select(Allocation.service_port).where(
        Allocation.service_port.is_not(None),
        Allocation.state.in_(LIVE) | (Allocation.ended_at >= recent),
    )
    return {int(p) for p in s.execute(stmt).scalars() if p is not None}


def live_replicas_of_tenant(s: Session, tenant_id: int) -> int:
    """Live replicas of all the tenant's services."""
    stmt = select(func.count(Allocation.id)).where(
        Allocation.service_id.is_not(None), Allocation.tenant_id == tenant_id, Allocation.state.in_(LIVE)
    )
    return int(s.execute(stmt).scalar_one())


def min_replicas_of_tenant(s: Session, tenant_id: int, *, besides: int | None = None) -> int:
    """The sum of `min_replicas` over the tenant's services (not deleted), but the one `besides`."""
    live = (Service.tenant_id == tenant_id) & Service.deleted_at.is_(None)
    stmt = select(Service.id, Service.spec).where(live)
    return sum(int((spec or {}).get("min_replicas", 1)) for sid, spec in s.execute(stmt) if sid != besides)


def oldest_reports(s: Session, service_ids: Sequence[int], since: datetime) -> dict[int, datetime]:
    """Per service, the oldest of the gateways' load reports written after `since`."""
    if not service_ids:
        return {}
    stmt = (
        select(GatewayLoad.service_id, func.min(GatewayLoad.updated_at))
        .where(GatewayLoad.service_id.in_(list(service_ids)), GatewayLoad.updated_at >= since)
        .group_by(GatewayLoad.service_id)
    )
    return {int(sid): at for sid, at in s.execute(stmt) if at is not None}


def set_replica_state(s: Session, alloc_id: int, state: ReplicaState, now: datetime) -> None:
    s.execute(
        update(Allocation).where(Allocation.id == alloc_id).values(replica_state=state, replica_since=now),
        execution_options={"synchronize_session": False},
    )


def insert_replica(
    s: Session, svc: ServiceRow, request: dict[str, Any], port_env: str, port: int, now: datetime
) -> int:
    """A pending allocation running one replica of `svc` on `port` (given to it in `port_env`), with
    a fresh key of its own in CPOOL_SERVICE_KEY: on a shared network anyone can reach the port, so
    the engine answers only who shows the key — the gateway, and the controller's health checks.
    The key is in the allocation's env alone (not its request), hidden from the API and dropped
    when the replica ends."""
    env = dict(request.get("env") or {})
    env[port_env] = str(port)
    req = dict(request, env=dict(env))
    env[KEY_ENV] = secrets.token_urlsafe(32)
    if req.get("image"):  # podman publishes the port at the same number on the node
        req["ports"] = sorted({*(req.get("ports") or []), port})
    return alloc_store.insert_pending(
        s,
        {
            "name": f"svc-{svc.name}"[:63],
            "tenant_id": svc.tenant_id,
            "owner": svc.owner,
            "idempotency_key": None,
            "request": req,
            "priority": int(req.get("priority") or 0),
            "command": req.get("command"),
            "env": env,
            "restartable": True,
            "service_id": svc.id,
            "service_generation": svc.generation,
            "service_port": port,
            "replica_state": "starting",
            "replica_since": now,
        },
        now,
    )


def failed_since(s: Session, since: datetime) -> list[tuple[int, int, str, datetime]]:
    """Replicas that ended `failed` (their engine exited with an error …) since `since`:
    (allocation, service, reason, when)."""
    stmt = select(Allocation.id, Allocation.service_id, Allocation.reason, Allocation.ended_at).where(
        Allocation.service_id.is_not(None), Allocation.state == "failed", Allocation.ended_at >= since
    )
    return [(int(i), int(sid), str(why), at) for i, sid, why, at in s.execute(stmt) if sid is not None and at]
