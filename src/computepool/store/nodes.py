"""Node inventory: nodes, their devices, heartbeats and scheduling flags."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from computepool.store.models import Device, Node, Tenant

# every node carries its own name as a label, so that an allocation can be pinned to it with a
# node selector (the coop controller's RPC servers and probes)
NODE_LABEL = "cpool.io/node"


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
    power_w: float | None = None
    energy_j: float | None = None  # the vendor's total-energy counter (J); None where it has none
    health: str = ""  # "" while healthy, else why not


def get(session: Session, name: str) -> Node | None:
    return session.execute(select(Node).where(Node.name == name)).scalar_one_or_none()


def list_all(session: Session) -> Sequence[Node]:
    return session.scalars(select(Node).order_by(Node.name)).all()


def heartbeats(session: Session) -> dict[str, datetime]:
    """Every node's last heartbeat, by name."""
    return {name: at for name, at in session.execute(select(Node.name, Node.last_heartbeat_at)).all()}


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
        labels=dict(sorted((dict(labels) | {NODE_LABEL: name}).items())),
        taints={},
        lending=True,
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
        dev.power_w = u.power_w
        dev.energy_j = u.energy_j
        dev.health = u.health
    session.flush()


_NODE = Node.__table__
_DEV = Device.__table__
_BEAT = (
    _NODE.update()
    .where(_NODE.c.name == bindparam("node_name"))
    .values(last_heartbeat_at=bindparam("now"))
    .returning(_NODE.c.id, _NODE.c.cordoned, _NODE.c.draining)
)
_DEV_INDEXES = select(_DEV.c.index).where(_DEV.c.node_id == bindparam("node_id"))
_DEV_USAGE = (
    _DEV.update()
    .where(_DEV.c.node_id == bindparam("b_node"), _DEV.c.index == bindparam("dev_index"))
    .values(
        used_memory_mib=bindparam("used"),
        utilization_pct=bindparam("util"),
        power_w=bindparam("power"),
        energy_j=bindparam("energy"),
        health=bindparam("health"),
    )
)


@dataclass(frozen=True)
class Beat:
    cordoned: bool
    draining: bool


def beat(session: Session, name: str, now: datetime, usage: Sequence[DeviceUsage]) -> Beat | None:
    """Record a heartbeat in one UPDATE (plus one per reported device); None for an unknown node.

    Raises KeyError naming the position of a device index the node does not have. A thousand
    agents send 200 of these a second, so they skip the ORM.
    """
    conn = session.connection()
    if conn.dialect.name == "postgresql":
        # A heartbeat lost in a crash is harmless (the next one follows in seconds): don't make
        # each of them wait for its own WAL flush.
        conn.exec_driver_sql("SET LOCAL synchronous_commit TO OFF")
    row = conn.execute(_BEAT, {"node_name": name, "now": now}).one_or_none()
    if row is None:
        return None
    node_id, cordoned, draining = row
    if usage:
        known = set(conn.execute(_DEV_INDEXES, {"node_id": node_id}).scalars())
        for i, u in enumerate(usage):
            if u.index not in known:
                raise KeyError(i)
        conn.execute(
            _DEV_USAGE,
            [
                {
                    "b_node": node_id,
                    "dev_index": u.index,
                    "used": u.used_memory_mib,
                    "util": u.utilization_pct,
                    "power": u.power_w,
                    "energy": u.energy_j,
                    "health": u.health,
                }
                for u in usage
            ],
        )
    return Beat(bool(cordoned), bool(draining))


def set_rules(
    session: Session,
    node: Node,
    *,
    labels: dict[str, str],
    taints: dict[str, str],
    dedicated_to: Tenant | None,
    lending: bool,
) -> None:
    """Replace the node's placement rules (labels, taints, dedication); the scheduler reads them."""
    node.labels = dict(sorted((dict(labels) | {NODE_LABEL: node.name}).items()))  # its name stays
    node.taints = dict(sorted(taints.items()))
    node.dedicated_tenant = dedicated_to
    node.dedicated_tenant_id = dedicated_to.id if dedicated_to is not None else None
    node.lending = lending
    session.flush()


def delete(session: Session, node: Node) -> None:
    session.delete(node)
    session.flush()
