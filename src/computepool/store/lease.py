"""The scheduling lease: one row naming the replica that leads and its term (a fencing token).

Whoever holds it runs the scheduler and the other leader-only loops; every write they make is
fenced by checking, in the same transaction, that the term is still theirs.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from computepool.store.models import SchedulerLease

LEASE_ID = 1


def _lease_row(session: Session) -> SchedulerLease | None:
    stmt = select(SchedulerLease).where(SchedulerLease.id == LEASE_ID).with_for_update()
    return session.execute(stmt).scalar_one_or_none()


def acquire_lease(
    session: Session, holder: str, now: datetime, ttl_s: float, *, take_over_from: str | None = None
) -> int | None:
    """Hold (or renew) the lease; the term when this holder schedules, None when another does.

    Taking the lease over from an expired holder bumps the term, which fences its commits out.
    `take_over_from`: take it at once, before it expires, if that replica still holds it — the
    caller knows its session is gone (it could take the advisory lock that replica holds while it
    lives); the new term fences it out.
    """
    row = _lease_row(session)
    expires = now + timedelta(seconds=ttl_s)
    if row is None:
        session.add(SchedulerLease(id=LEASE_ID, holder=holder, term=1, expires_at=expires))
        session.flush()
        return 1
    if row.holder == holder:
        row.expires_at = expires
    elif row.holder == take_over_from or row.expires_at <= now:
        row.holder, row.term, row.expires_at = holder, row.term + 1, expires
    else:
        return None
    session.flush()
    return row.term


_LEASE_T = SchedulerLease.__table__
_HOLDS = select(_LEASE_T.c.holder, _LEASE_T.c.term).where(_LEASE_T.c.id == LEASE_ID).with_for_update()


def holds_lease(session: Session, holder: str, term: int) -> bool:
    """Inside a commit: does `holder` still hold the lease in `term`? (Locks the row on PostgreSQL.)"""
    row = session.connection().execute(_HOLDS).one_or_none()
    return row is not None and row[0] == holder and row[1] == term


_LEASE_T = SchedulerLease.__table__
_CURRENT_TERM = select(_LEASE_T.c.term).where(_LEASE_T.c.id == LEASE_ID)


def current_term(session: Session) -> int:
    """The lease's term (0 before any leader); a prebuilt Core statement: every assignments read asks."""
    row = session.connection().execute(_CURRENT_TERM).scalar()
    return int(row or 0)


def mark_observing(session: Session, holder: str, at: datetime) -> None:
    """`holder`, holding the lease, has watched the nodes with a working database since `at`."""
    stmt = update(SchedulerLease).where(SchedulerLease.id == LEASE_ID, SchedulerLease.holder == holder)
    session.execute(stmt.values(observed_since=at))


def observed_since(session: Session, now: datetime) -> datetime | None:
    """From when node silence counts, as the scheduling leader counts it: since its holder began to
    watch with a working database; once the lease has expired, from no earlier than its expiry (the
    next leader counts from when it takes over). None when no leader ever said (no lease, or one
    from before this was recorded): silence then counts from the heartbeats alone."""
    stmt = select(SchedulerLease.observed_since, SchedulerLease.expires_at).where(
        SchedulerLease.id == LEASE_ID
    )
    row = session.execute(stmt).one_or_none()
    if row is None or row[0] is None:
        return None
    since: datetime = row[0]
    return max(since, row[1]) if row[1] <= now else since
