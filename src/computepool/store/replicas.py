"""The SQL of the control plane's replica list: each replica's URL and when it last said so."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from computepool.store.models import ControlPlaneUrl


def publish(s: Session, url: str, now: datetime) -> None:
    """`url` is alive as of `now` (the row is made or renewed, in one statement: two processes
    publishing one URL at once, such as a replica and its restarted self, never collide)."""
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert(ControlPlaneUrl).values(url=url, seen_at=now)
    s.execute(stmt.on_conflict_do_update(index_elements=["url"], set_={"seen_at": stmt.excluded.seen_at}))


def withdraw(s: Session, url: str) -> None:
    """The replica at `url` stops (a clean shutdown): agents are no longer sent there."""
    s.execute(delete(ControlPlaneUrl).where(ControlPlaneUrl.url == url))


def live(s: Session, now: datetime, max_age_s: float) -> list[str]:
    """The URLs renewed within `max_age_s`, in URL order; rows stale for an hour more are removed."""
    cutoff = now - timedelta(seconds=max_age_s)
    s.execute(delete(ControlPlaneUrl).where(ControlPlaneUrl.seen_at < cutoff - timedelta(hours=1)))
    stmt = select(ControlPlaneUrl.url).where(ControlPlaneUrl.seen_at >= cutoff).order_by(ControlPlaneUrl.url)
    return [str(u) for u in s.execute(stmt).scalars()]
