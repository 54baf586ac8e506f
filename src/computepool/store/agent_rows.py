"""Plain-row reads and writes for the node agents' two hot calls: the assignments read (a node's
held jobs) and its reports' plain starts. Both run after every bind, start and end on a node, and
the ORM's identity map and unit of work cost several times the SQL there."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from computepool.core.allocation import AllocationState
from computepool.store.allocations import Head, event
from computepool.store.models import Allocation, AllocationNode, Tenant

_ALLOC = Allocation.__table__


@dataclass(frozen=True, slots=True)
class HeldJob:
    """A job a node holds (bound or active, with a command), as the node's assignments read needs it."""

    id: int
    attempt: int
    term: int
    tenant_id: int
    tenant_name: str
    max_pids: int | None
    command: list[str]
    env: dict[str, str] | None
    request: dict[str, Any]
    slices: list[dict[str, Any]]
    nodes: list[str]
    members: list[dict[str, Any]] | None
    master_port: int | None
    restartable: bool
    service_port: int | None
    coop_role: str | None


_TENANT_T = Tenant.__table__
_NODE_INDEX_T = AllocationNode.__table__
_HELD_JOBS = (
    select(
        *(_ALLOC.c[f] for f in HeldJob.__dataclass_fields__ if f not in ("tenant_name", "max_pids")),
        _TENANT_T.c.name.label("tenant_name"),
        _TENANT_T.c.max_pids,
    )
    .join(_NODE_INDEX_T, _NODE_INDEX_T.c.allocation_id == _ALLOC.c.id)
    .join(_TENANT_T, _TENANT_T.c.id == _ALLOC.c.tenant_id)
    .where(_NODE_INDEX_T.c.node == bindparam("node"))
    .order_by(_ALLOC.c.id)
)


def held_jobs(session: Session, node: str) -> list[HeldJob]:
    """`holding_on` less the jobs without a command, as plain rows: a node's assignments are read
    after every bind and end on it, and loading its held jobs as ORM objects cost several times
    the query."""
    rows = session.connection().execute(_HELD_JOBS, {"node": node}).mappings()
    return [HeldJob(**r) for r in rows if r["command"] is not None]  # JSON null or SQL NULL


@dataclass(frozen=True, slots=True)
class Reported:
    """What applying a node's report needs to know of an allocation, read under its row lock."""

    id: int
    state: AllocationState
    attempt: int
    term: int
    command: list[str] | None
    nodes: list[str]
    members: list[dict[str, Any]] | None
    request: dict[str, Any]
    service_id: int | None
    bound_at: datetime | None
    created_at: datetime

    def head(self) -> Head:
        return Head(self.id, self.state, "", list(self.nodes), self.attempt, self.term)


_LOCK_REPORTED = (
    select(*(_ALLOC.c[f] for f in Reported.__dataclass_fields__))
    .where(_ALLOC.c.id.in_(bindparam("ids", expanding=True)))
    .with_for_update(of=_ALLOC)
)
_START = (
    _ALLOC.update()
    .where(_ALLOC.c.id == bindparam("alloc_id"))
    .values(state="active", reason=bindparam("reason"), started_at=bindparam("started_at"))
)


def lock_reported(session: Session, ids: list[int]) -> dict[int, Reported]:
    """The allocations a node reports on, as plain rows, locked (PostgreSQL) until commit."""
    conn = session.connection()
    out: dict[int, Reported] = {}
    for i in range(0, len(ids), 500):
        for r in conn.execute(_LOCK_REPORTED, {"ids": ids[i : i + 500]}).mappings():
            out[r["id"]] = Reported(**r)
    return out


def start(session: Session, a: Reported, reason: str, started_at: datetime, now: datetime) -> None:
    """A bound allocation runs (bound → active, since `started_at`): the row and its event (at
    `now`), as `transition` writes them, in two statements."""
    conn = session.connection()
    conn.execute(_START, {"alloc_id": a.id, "reason": reason[:1024], "started_at": started_at})
    event(conn, a.id, "active", reason, now, a.attempt, a.term)
