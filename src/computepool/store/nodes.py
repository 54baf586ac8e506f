"""Node inventory: nodes, their devices, heartbeats and scheduling flags."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.store.models import Device, Node


@dataclass(frozen=True)
class DeviceSpec:
    index: int
    vendor: str
    model: str
    memory_mib: int
    uuid: str
    compute_milli: int
    link_group: str
    mig_parent_uuid: str | None = None


@dataclass(frozen=True)
class DeviceUsage:
    index: int
    used_memory_mib: int | None
    utilization_pct: float | None


def get(session: Session, name: str) -> Node | None:
    return session.execute(select(Node).where(Node.name == name)).scalar_one_or_none()


def list_all(session: Session) -> Sequence[Node]:
    return session.scalars(select(Node).order_by(Node.name)).all()


def create(
    session: Session,
    *,
    name: str,
    cpu_milli: int,
    memory_mib: int,
    labels: dict[str, str],
    devices: Sequence[DeviceSpec],
    now: datetime,
) -> Node:
    node = Node(
        name=name,
        cpu_milli=cpu_milli,
        memory_mib=memory_mib,
        labels=dict(labels),
        cordoned=False,
        draining=False,
        joined_at=now,
        last_heartbeat_at=now,
        devices=[Device(**vars(d)) for d in devices],
    )
    session.add(node)
    session.flush()
    return node


def heartbeat(session: Session, node: Node, now: datetime, usage: Sequence[DeviceUsage]) -> None:
    node.last_heartbeat_at = now
    by_index = {d.index: d for d in node.devices}
    for u in usage:
        dev = by_index[u.index]
        dev.used_memory_mib = u.used_memory_mib
        dev.utilization_pct = u.utilization_pct
    session.flush()


def delete(session: Session, node: Node) -> None:
    session.delete(node)
    session.flush()
