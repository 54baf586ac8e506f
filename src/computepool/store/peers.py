"""The SQL of LAN discovery: each node's latest view of its peers (one row per observer × peer).

A report replaces the observer's rows as a whole, so a peer its discovery dropped goes with it.
The decisions (who may report, what is valid) live in `server.logic.peers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from computepool.store.models import Node, NodePeer


@dataclass(frozen=True)
class PeerRow:
    """One peer as one observer saw it (the fields of `NodePeer` but its id and observer)."""

    peer_key: str
    node_id: str | None
    instance: str
    address: str
    port: int | None
    devices: list[dict[str, Any]]
    status: str
    reason: str
    source: str
    rtt_ms: float | None
    bandwidth_mbps: float | None
    last_seen: datetime


def replace(s: Session, observer: str, rows: Sequence[PeerRow], now: datetime) -> None:
    """Make `rows` the whole of what `observer` reports (its earlier rows go)."""
    s.execute(delete(NodePeer).where(NodePeer.observer == observer))
    s.add_all(NodePeer(observer=observer, reported_at=now, **vars(r)) for r in rows)
    s.flush()


def forget_observer(s: Session, observer: str) -> None:
    """A deleted node's view goes with it (a node of the same name joining later starts afresh)."""
    s.execute(delete(NodePeer).where(NodePeer.observer == observer))


def list_all(s: Session, observer: str | None = None) -> Sequence[NodePeer]:
    """Rows of observers that are still nodes of the pool (a removed node's view goes unseen),
    ordered by peer, then observer."""
    stmt = select(NodePeer).join(Node, Node.name == NodePeer.observer)
    if observer is not None:
        stmt = stmt.where(NodePeer.observer == observer)
    return s.scalars(stmt.order_by(NodePeer.peer_key, NodePeer.observer)).all()
