"""Cooperative services' SQL: their plans, the models' measured speeds, the peers a node verified,
and the allocations (RPC servers, speed probes) the coop controller starts for a service.

Those allocations carry `coop_service_id` and `coop_role` and leave `service_id` NULL: the service
controller, which sizes replicas, never counts or ends them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE, RPC_PORT_ENV
from computepool.store import allocations as alloc_store
from computepool.store import logs
from computepool.store.models import Allocation, CoopMeasurement, CoopPlan, Node, NodePeer


@dataclass(frozen=True)
class PlanRow:
    service_id: int
    status: str
    plan: dict[str, Any]
    reason: str
    attempt: int
    updated_at: datetime


@dataclass(frozen=True)
class CoopAlloc:
    """An RPC server or probe of a cooperative service (live, or ended: `state`, `reason`)."""

    id: int
    service_id: int
    role: str
    state: str
    attempt: int
    node: str | None
    port: int | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    reason: str


@dataclass(frozen=True)
class NodeRow:
    name: str
    address: str
    cpu_milli: int
    memory_mib: int
    last_heartbeat_at: datetime
    schedulable: bool
    labels: dict[str, str] = field(default_factory=dict)
    taints: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerRow:
    observer: str
    node_id: str
    address: str
    rtt_ms: float | None
    bandwidth_mbps: float | None
    last_seen: datetime


@dataclass(frozen=True)
class Measurement:
    node: str
    device: str
    tokens_per_s: float
    memory_mib: int
    measured_at: datetime
    detail: dict[str, Any]


# --- plans ---------------------------------------------------------------------------------------
def plans(s: Session, service_ids: Sequence[int] | None = None) -> dict[int, PlanRow]:
    stmt = select(CoopPlan)
    if service_ids is not None:
        if not service_ids:
            return {}
        stmt = stmt.where(CoopPlan.service_id.in_(list(service_ids)))
    return {
        p.service_id: PlanRow(p.service_id, p.status, dict(p.plan or {}), p.reason, p.attempt, p.updated_at)
        for p in s.scalars(stmt)
    }


def put_plan(
    s: Session, sid: int, status: str, plan: dict[str, Any], reason: str, attempt: int, now: datetime
) -> None:
    row = s.get(CoopPlan, sid)
    if row is None:
        row = CoopPlan(service_id=sid)
        s.add(row)
    row.status, row.plan, row.reason, row.attempt, row.updated_at = status, plan, reason, attempt, now
    s.flush()


def delete_plan(s: Session, sid: int) -> None:
    s.execute(delete(CoopPlan).where(CoopPlan.service_id == sid))


# --- measurements --------------------------------------------------------------------------------
def measurements(s: Session, model_key: str) -> list[Measurement]:
    stmt = (
        select(CoopMeasurement).where(CoopMeasurement.model_key == model_key).order_by(CoopMeasurement.node)
    )
    return [
        Measurement(m.node, m.device, m.tokens_per_s, m.memory_mib, m.measured_at, dict(m.detail or {}))
        for m in s.scalars(stmt)
    ]


def put_measurement(s: Session, model_key: str, m: Measurement) -> None:
    """Insert or replace the measurement of (model, node, device)."""
    stmt = select(CoopMeasurement).where(
        CoopMeasurement.model_key == model_key,
        CoopMeasurement.node == m.node,
        CoopMeasurement.device == m.device,
    )
    row = s.scalars(stmt).first()
    if row is None:
        row = CoopMeasurement(model_key=model_key, node=m.node, device=m.device)
        s.add(row)
    row.tokens_per_s, row.memory_mib, row.measured_at, row.detail = (
        m.tokens_per_s,
        m.memory_mib,
        m.measured_at,
        m.detail,
    )
    s.flush()


# --- nodes and the peers they verified -----------------------------------------------------------
def nodes(s: Session) -> dict[str, NodeRow]:
    stmt = select(Node.name, Node.address, Node.cpu_milli, Node.memory_mib, Node.last_heartbeat_at,
                  Node.cordoned, Node.draining, Node.labels, Node.taints)  # fmt: skip
    return {
        r.name: NodeRow(
            r.name,
            r.address or "",
            int(r.cpu_milli),
            int(r.memory_mib),
            r.last_heartbeat_at,
            not (r.cordoned or r.draining),
            dict(r.labels or {}),
            dict(r.taints or {}),
        )  # fmt: skip
        for r in s.execute(stmt)
    }


def verified_peers(s: Session, observers: Sequence[str], since: datetime) -> list[PeerRow]:
    """Peers these nodes' discovery verified (status ok, with a node id) in a report received and a
    sighting made since `since`: only these may hold shards. An agent resends its view every 30 s
    even unchanged, so an older row is from an agent that stopped reporting, not a current proof."""
    if not observers:
        return []
    stmt = select(NodePeer).where(
        NodePeer.observer.in_(list(observers)), NodePeer.status == "ok", NodePeer.node_id.is_not(None),
        NodePeer.reported_at >= since, NodePeer.last_seen >= since,
    )  # fmt: skip
    return [
        PeerRow(p.observer, str(p.node_id), p.address, p.rtt_ms, p.bandwidth_mbps, p.last_seen)
        for p in s.scalars(stmt.order_by(NodePeer.observer, NodePeer.node_id))
    ]


# --- the controller's allocations ----------------------------------------------------------------
def _coop_alloc(a: Any) -> CoopAlloc:
    env = a.env or {}
    port = env.get(RPC_PORT_ENV)
    return CoopAlloc(
        id=int(a.id),
        service_id=int(a.coop_service_id),
        role=str(a.coop_role),
        state=str(a.state),
        attempt=int(a.attempt),
        node=a.nodes[0] if a.nodes else None,
        port=int(port) if port else None,
        created_at=a.created_at,
        started_at=a.started_at,
        ended_at=a.ended_at,
        reason=str(a.reason),
    )


_COOP_COLS = (Allocation.id, Allocation.coop_service_id, Allocation.coop_role, Allocation.state,
              Allocation.attempt, Allocation.nodes, Allocation.env, Allocation.created_at,
              Allocation.started_at, Allocation.ended_at, Allocation.reason)  # fmt: skip


def live_allocs(s: Session) -> list[CoopAlloc]:
    stmt = select(*_COOP_COLS).where(Allocation.coop_service_id.is_not(None), Allocation.state.in_(LIVE))
    return [_coop_alloc(a) for a in s.execute(stmt.order_by(Allocation.id))]


def allocs_by_id(s: Session, ids: Sequence[int]) -> dict[int, CoopAlloc]:
    """These allocations whatever their state (the controller follows the ones it started)."""
    if not ids:
        return {}
    stmt = select(*_COOP_COLS).where(Allocation.id.in_(list(ids)), Allocation.coop_service_id.is_not(None))
    return {int(a.id): _coop_alloc(a) for a in s.execute(stmt)}


def used_rpc_ports(s: Session, since: datetime) -> set[int]:
    """Ports of live RPC servers, and of those that ended after `since`: an ended allocation's
    process may still be stopping, and hold its port."""
    stmt = select(*_COOP_COLS).where(
        Allocation.coop_role == "rpc", Allocation.state.in_(LIVE) | (Allocation.ended_at >= since)
    )
    return {a.port for a in map(_coop_alloc, s.execute(stmt)) if a.port is not None}


def insert_alloc(
    s: Session,
    *,
    service_id: int,
    tenant_id: int,
    owner: str,
    name: str,
    role: str,
    request: dict[str, Any],
    env: dict[str, str] | None,
    now: datetime,
) -> int:
    return alloc_store.insert_pending(
        s,
        {
            "name": name[:63],
            "tenant_id": tenant_id,
            "owner": owner,
            "idempotency_key": None,
            "request": request,
            "priority": int(request.get("priority") or 0),
            "command": request.get("command"),
            "env": env,
            "restartable": False,
            "coop_service_id": service_id,
            "coop_role": role,
        },
        now,
    )


def stdout_of(s: Session, alloc_id: int, max_bytes: int = 65536) -> str:
    return logs.read_log(s, alloc_id, 0, "stdout", 0, max_bytes)[0]


def stderr_tail(s: Session, alloc_id: int, max_bytes: int = 65536) -> str:
    return logs.read_log(s, alloc_id, 0, "stderr", 0, max_bytes)[0]
