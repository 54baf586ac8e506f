"""The SQL of the control plane's replica list: each replica's URL and when it last said so."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from computepool.store.models import ControlPlaneUrl


def publish(s: Session, url: str, now: datetime) -> None:
    """`url` is alive as of `now` (the row is made or renewed)."""
    row = s.get(ControlPlaneUrl, url)
    if row is None:
        s.add(ControlPlaneUrl(url=url, seen_at=now))
    else:
        row.seen_at = now
    s.flush()


def withdraw(s: Session, url: str) -> None:
    """The replica at `url` stops (a clean shutdown): agents are no longer sent there."""
    s.execute(delete(ControlPlaneUrl).where(ControlPlaneUrl.url == url))


def live(s: Session, now: datetime, max_age_s: float) -> list[str]:
    """The URLs renewed within `max_age_s`, in URL order; rows stale for an hour more are removed."""
    cutoff = now - timedelta(seconds=max_age_s)
    s.execute(delete(ControlPlaneUrl).where(ControlPlaneUrl.seen_at < cutoff - timedelta(hours=1)))
    stmt = select(ControlPlaneUrl.url).where(ControlPlaneUrl.seen_at >= cutoff).order_by(ControlPlaneUrl.url)
    return [str(u) for u in s.execute(stmt).scalars()]
