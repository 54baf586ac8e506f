"""Tenants: who shares the pool, and with which fair-share weight."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.store.models import Tenant


def get(session: Session, name: str) -> Tenant | None:
    return session.execute(select(Tenant).where(Tenant.name == name)).scalar_one_or_none()


def list_all(session: Session, only: str | None = None) -> Sequence[Tenant]:
    stmt = select(Tenant).order_by(Tenant.name)
    if only is not None:
        stmt = stmt.where(Tenant.name == only)
    return session.scalars(stmt).all()


def create(session: Session, name: str, weight: float, now: datetime) -> Tenant:
    tenant = Tenant(name=name, weight=weight, created_at=now)
    session.add(tenant)
    session.flush()
    return tenant
