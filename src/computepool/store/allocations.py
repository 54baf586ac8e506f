"""Allocations, their history (events), which nodes hold them, job logs, and the scheduler lease.

Transitions go through `transition`, which stamps the time, writes the event and keeps
`allocation_nodes` equal to the nodes of bound and active allocations — the index the agents'
long-polls and node-loss handling read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, select, update
from sqlalchemy.orm import Session

from computepool.core.allocation import (  # also read as store.HOLDING etc.
    ENDED,
    HOLDING,
    LIVE,
    AllocationState,
)
from computepool.store.models import (
    Allocation,
    AllocationEvent,
    AllocationNode,
    Node,
    Tenant,
)

# Secrets a job needs while it holds and nobody after: dropped from the stored env (and the
# request's copy of it) when its allocation ends — a function worker's bearer token, a service
# replica's key (what the gateway must show it), a cooperative plan's secret (COOP_PLAN_SECRET in
# its service's spec, renamed by the head's launching shell: requests may not name CPOOL_ ones).
SECRET_ENV = frozenset({"CPOOL_WORKER_TOKEN", "CPOOL_SERVICE_KEY", "CPOOL_COOP_SECRET", "COOP_PLAN_SECRET"})


def _has_secret(env: dict[str, str] | None) -> bool:
    return bool(env) and not SECRET_ENV.isdisjoint(env or {})


def _without_secrets(env: dict[str, str] | None) -> dict[str, str] | None:
    return None if env is None else {k: v for k, v in env.items() if k not in SECRET_ENV}


def get(session: Session, alloc_id: int, *, for_update: bool = False) -> Allocation | None:
    stmt = select(Allocation).where(Allocation.id == alloc_id)
    if for_update:
        stmt = stmt.with_for_update(of=Allocation)
    return session.execute(stmt).scalar_one_or_none()


def by_key(session: Session, owner: str, key: str) -> Allocation | None:
    stmt = select(Allocation).where(Allocation.owner == owner, Allocation.idempotency_key == key)
    return session.execute(stmt).scalar_one_or_none()


def add(session: Session, alloc: Allocation, now: datetime) -> AllocationEvent:
    """Insert a new allocation and its first event; returns that event."""
    session.add(alloc)
    session.flush()
    event = AllocationEvent(
        allocation_id=alloc.id, at=now, state=alloc.state, reason=alloc.reason, attempt=1, term=0
    )
    session.add(event)
    session.flush()
    return event


_ALLOC = Allocation.__table__
_EVENTS = AllocationEvent.__table__
_NODES = AllocationNode.__table__
# Plain Core statements on the tables, built once: the API's hot path runs them per request, and
# the ORM's unit of work (or an ORM-enabled insert) costs several times more than the SQL itself.
_INSERT_ALLOC = _ALLOC.insert().returning(_ALLOC.c.id)
_INSERT_EVENT = _EVENTS.insert()
_LOCK_HEAD = (
    select(
        _ALLOC.c.id, _ALLOC.c.state, Tenant.__table__.c.name, _ALLOC.c.nodes, _ALLOC.c.attempt, _ALLOC.c.term
    )
    .join(Tenant.__table__, _ALLOC.c.tenant_id == Tenant.__table__.c.id)
    .where(_ALLOC.c.id == bindparam("alloc_id"))
    .with_for_update(of=_ALLOC)
)
_END = (
    _ALLOC.update()
    .where(_ALLOC.c.id == bindparam("alloc_id"))
    .values(state=bindparam("state"), reason=bindparam("reason"), ended_at=bindparam("ended_at"))
    .returning(_ALLOC.c.env)
)
_END_EXITED = (
    _ALLOC.update()
    .where(_ALLOC.c.id == bindparam("alloc_id"))
    .values(
        state=bindparam("state"),
        reason=bindparam("reason"),
        ended_at=bindparam("ended_at"),
        exit_code=bindparam("exit_code"),
    )
    .returning(_ALLOC.c.env)
)
_UNINDEX = _NODES.delete().where(_NODES.c.allocation_id == bindparam("alloc_id"))


def insert_pending(session: Session, values: dict[str, Any], now: datetime) -> int:
    """Insert a new pending allocation and its first event in two statements; returns its id."""
    conn = session.connection()
    row = dict(
        values, state="pending", reason="submitted", attempt=1, term=0, nodes=[], slices=[], created_at=now
    )
    alloc_id = int(conn.execute(_INSERT_ALLOC, row).scalar_one())
    conn.execute(
        _INSERT_EVENT,
        {
            "allocation_id": alloc_id,
            "at": now,
            "state": "pending",
            "reason": "submitted",
            "attempt": 1,
            "term": 0,
        },
    )
    return alloc_id


_READ_ONE = (
    select(*_ALLOC.c, Tenant.__table__.c.name.label("tenant_name"))
    .join(Tenant.__table__, _ALLOC.c.tenant_id == Tenant.__table__.c.id)
    .where(_ALLOC.c.id == bindparam("alloc_id"))
)
_READ_EVENTS = (
    select(_EVENTS.c.at, _EVENTS.c.state, _EVENTS.c.reason)
    .where(_EVENTS.c.allocation_id == bindparam("alloc_id"))
    .order_by(_EVENTS.c.id)
)


def read_one(session: Session, alloc_id: int) -> tuple[Any, Sequence[Any]] | None:
    """One allocation as a plain row (with `tenant_name`) and its events, in two Core queries."""
    conn = session.connection()
    row = conn.execute(_READ_ONE, {"alloc_id": alloc_id}).one_or_none()
    if row is None:
        return None
    return row, conn.execute(_READ_EVENTS, {"alloc_id": alloc_id}).all()


@dataclass(frozen=True)
class Head:
    """What ending an allocation needs to know of it, read under its row lock."""

    id: int
    state: AllocationState
    tenant: str
    nodes: list[str]
    attempt: int
    term: int


def lock_head(session: Session, alloc_id: int) -> Head | None:
    row = session.connection().execute(_LOCK_HEAD, {"alloc_id": alloc_id}).one_or_none()
    return None if row is None else Head(row[0], row[1], row[2], list(row[3]), row[4], row[5])


def end(
    session: Session,
    head: Head,
    state: AllocationState,
    reason: str,
    now: datetime,
    *,
    exit_code: int | None = None,
) -> None:
    """End a live allocation (released, cancelled …): row, node index and event, in three statements;
    `exit_code`, when given, is stored with it."""
    conn = session.connection()
    values = {"alloc_id": head.id, "state": state, "reason": reason[:1024], "ended_at": now}
    if exit_code is None:
        env = conn.execute(_END, values).scalar_one_or_none()
    else:
        env = conn.execute(_END_EXITED, values | {"exit_code": exit_code}).scalar_one_or_none()
    if _has_secret(env):
        req = conn.execute(select(_ALLOC.c.request).where(_ALLOC.c.id == head.id)).scalar_one()
        conn.execute(
            _ALLOC.update()
            .where(_ALLOC.c.id == head.id)
            .values(env=_without_secrets(env), request=dict(req, env=_without_secrets(req.get("env"))))
        )
    if head.state in HOLDING:
        conn.execute(_UNINDEX, {"alloc_id": head.id})
    event(conn, head.id, state, reason, now, head.attempt, head.term)


def event(
    conn: Connection,
    alloc_id: int,
    state: AllocationState,
    reason: str,
    at: datetime,
    attempt: int,
    term: int,
) -> None:
    conn.execute(
        _INSERT_EVENT,
        {
            "allocation_id": alloc_id,
            "at": at,
            "state": state,
            "reason": reason[:1024],
            "attempt": attempt,
            "term": term,
        },
    )


def query(
    session: Session, *, tenant: str | None, state: str | None, limit: int, array: int | None = None
) -> Sequence[Any]:
    """Allocations newest first, as plain rows with `tenant_name` (one Core query, no ORM objects);
    with `array`, the members of that job array (its members' ids start at the array's)."""
    t = Tenant.__table__
    stmt = select(*_ALLOC.c, t.c.name.label("tenant_name")).join(t, _ALLOC.c.tenant_id == t.c.id)
    if array is not None:
        member_of = _ALLOC.c.request[("array", "id")].as_integer()
        stmt = stmt.where(_ALLOC.c.id >= array, member_of == array)
    if tenant is not None:
        stmt = stmt.where(t.c.name == tenant)
    if state is not None:
        stmt = stmt.where(_ALLOC.c.state == state)
    return session.connection().execute(stmt.order_by(_ALLOC.c.id.desc()).limit(limit)).all()


def events_of(session: Session, ids: Iterable[int]) -> dict[int, list[Any]]:
    """Each allocation's events (at, state, reason) in order, as plain rows."""
    wanted = list(ids)
    out: dict[int, list[Any]] = {i: [] for i in wanted}
    conn = session.connection()
    for i in range(0, len(wanted), 500):
        stmt = select(_EVENTS.c.allocation_id, _EVENTS.c.at, _EVENTS.c.state, _EVENTS.c.reason).where(
            _EVENTS.c.allocation_id.in_(wanted[i : i + 500])
        )
        for ev in conn.execute(stmt.order_by(_EVENTS.c.id)):
            out[ev.allocation_id].append(ev)
    return out


def transition(
    session: Session,
    alloc: Allocation,
    state: AllocationState,
    reason: str,
    now: datetime,
    *,
    term: int | None = None,
) -> None:
    """Move to `state` with its reason; stamp the time; keep `allocation_nodes` in step."""
    was_holding = alloc.state in HOLDING
    alloc.state = state
    alloc.reason = reason[:1024]
    if term is not None:
        alloc.term = term
    if state == "bound":
        alloc.bound_at = now
        session.add_all(AllocationNode(allocation_id=alloc.id, node=n) for n in dict.fromkeys(alloc.nodes))
    elif state == "active":
        alloc.started_at = alloc.started_at or now
    elif state in ENDED:
        alloc.ended_at = now
        if _has_secret(alloc.env):
            alloc.env = _without_secrets(alloc.env)
            alloc.request = dict(alloc.request, env=_without_secrets(alloc.request.get("env")))
    if was_holding and state not in HOLDING:
        session.execute(
            delete(AllocationNode).where(AllocationNode.allocation_id == alloc.id),
            execution_options={"synchronize_session": False},
        )
    session.add(
        AllocationEvent(
            allocation_id=alloc.id,
            at=now,
            state=state,
            reason=reason[:1024],
            attempt=alloc.attempt,
            term=alloc.term,
        )
    )


def requeue(session: Session, alloc: Allocation, reason: str, now: datetime) -> None:
    """Back to pending as the next attempt: slices dropped, bind times cleared."""
    alloc.attempt += 1
    alloc.nodes, alloc.slices = [], []
    alloc.bound_at = alloc.started_at = alloc.ended_at = None
    alloc.exit_code = None
    alloc.master_port, alloc.members = None, None  # a gang's next attempt gets a fresh port
    transition(session, alloc, "pending", reason, now)


def holding_on(session: Session, node: str) -> Sequence[Allocation]:
    """Bound and active allocations with a part on `node`, oldest first."""
    stmt = (
        select(Allocation)
        .join(AllocationNode, AllocationNode.allocation_id == Allocation.id)
        .where(AllocationNode.node == node)
        .order_by(Allocation.id)
    )
    return session.scalars(stmt).unique().all()


def needs_cycle(session: Session, lost_before: datetime) -> bool:
    """Whether a scheduling cycle has anything to do: a pending request, held work on a node that
    is lost (no heartbeat since `lost_before`) or gone, or restartable work on a draining node.
    A few indexed queries instead of a snapshot of every node, so an idle pool of many nodes
    costs the server next to nothing."""
    conn = session.connection()
    if conn.execute(_ANY_PENDING).first() is not None:
        return True
    if conn.execute(_ANY_TO_MOVE).first() is not None:
        return True
    return conn.execute(_ANY_STRANDED, {"lost_before": lost_before}).first() is not None


_ANY_PENDING = select(_ALLOC.c.id).where(_ALLOC.c.state == "pending").limit(1)
_NODE_T = Node.__table__
_ANY_TO_MOVE = (
    select(_NODES.c.allocation_id)
    .join(_NODE_T, _NODE_T.c.name == _NODES.c.node)
    .join(_ALLOC, _ALLOC.c.id == _NODES.c.allocation_id)
    .where(_NODE_T.c.draining.is_(True), _ALLOC.c.restartable.is_(True))
    .limit(1)
)
_ANY_STRANDED = (
    select(_NODES.c.allocation_id)
    .outerjoin(_NODE_T, _NODE_T.c.name == _NODES.c.node)
    .where((_NODE_T.c.id.is_(None)) | (_NODE_T.c.last_heartbeat_at < bindparam("lost_before")))
    .limit(1)
)


def live_rows(session: Session, ids: Sequence[int] | None = None) -> Sequence[Any]:
    """Pending, bound and active allocations as plain rows (the scheduler's snapshot), by id;
    with `ids`, only those of them."""
    if ids is not None:
        out: list[Any] = []
        for i in range(0, len(ids), 500):
            out.extend(_live_rows(session, ids[i : i + 500]))
        return out
    return _live_rows(session, None)


def _live_rows(session: Session, ids: Sequence[int] | None) -> Sequence[Any]:
    if ids is not None:
        return session.connection().execute(_LIVE_BY_ID, {"ids": list(ids)}).all()
    stmt = (
        select(
            Allocation.id,
            Tenant.name.label("tenant"),
            Allocation.state,
            Allocation.request,
            Allocation.priority,
            Allocation.attempt,
            Allocation.restartable,
            Allocation.command,
            Allocation.nodes,
            Allocation.slices,
            Allocation.reason,
            Allocation.bound_at,
        )
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .where(Allocation.state.in_(LIVE))
        .order_by(Allocation.id)
    )
    if ids is not None:
        stmt = stmt.where(Allocation.id.in_(ids))
    return session.execute(stmt).all()


_LIVE_BY_ID = (
    select(
        _ALLOC.c.id,
        Tenant.__table__.c.name.label("tenant"),
        _ALLOC.c.state,
        _ALLOC.c.request,
        _ALLOC.c.priority,
        _ALLOC.c.attempt,
        _ALLOC.c.restartable,
        _ALLOC.c.command,
        _ALLOC.c.nodes,
        _ALLOC.c.slices,
        _ALLOC.c.reason,
        _ALLOC.c.bound_at,
    )
    .join(Tenant.__table__, _ALLOC.c.tenant_id == Tenant.__table__.c.id)
    .where(_ALLOC.c.state.in_(LIVE), _ALLOC.c.id.in_(bindparam("ids", expanding=True)))
    .order_by(_ALLOC.c.id)
)
_LIVE_HEADS = (
    select(_ALLOC.c.id, _ALLOC.c.state, _ALLOC.c.attempt, _ALLOC.c.reason)
    .where(_ALLOC.c.state.in_(LIVE))
    .order_by(_ALLOC.c.id)
)


def live_heads(session: Session) -> Sequence[Any]:
    """(id, state, attempt, reason) of every pending, bound and active allocation, by id."""
    return session.connection().execute(_LIVE_HEADS).all()


def set_reasons(session: Session, reasons: dict[int, str]) -> None:
    """Record why pending allocations wait (one statement per distinct reason)."""
    by_reason: dict[str, list[int]] = {}
    for alloc_id, reason in reasons.items():
        by_reason.setdefault(reason[:1024], []).append(alloc_id)
    for reason, ids in by_reason.items():
        for i in range(0, len(ids), 500):
            session.execute(
                update(Allocation)
                .where(Allocation.id.in_(ids[i : i + 500]), Allocation.state == "pending")
                .values(reason=reason),
                execution_options={"synchronize_session": False},
            )


def count_by(session: Session, state: str) -> dict[str, int]:
    stmt = (
        select(Tenant.name, func.count(Allocation.id))
        .join(Tenant, Allocation.tenant_id == Tenant.id)
        .where(Allocation.state == state)
        .group_by(Tenant.name)
    )
    return {name: int(n) for name, n in session.execute(stmt).all()}


def end_states(session: Session, ids: Sequence[int]) -> dict[int, str]:
    """The states of those of `ids` that have ended, by id."""
    out: dict[int, str] = {}
    for i in range(0, len(ids), 500):
        stmt = select(_ALLOC.c.id, _ALLOC.c.state).where(
            _ALLOC.c.id.in_(list(ids[i : i + 500])), _ALLOC.c.state.in_(ENDED)
        )
        out.update((int(r.id), str(r.state)) for r in session.connection().execute(stmt))
    return out
