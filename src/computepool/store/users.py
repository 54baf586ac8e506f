"""Users: a name (unique in the pool), a tenant and a role."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from computepool.store.models import Tenant, User


def get(session: Session, name: str) -> User | None:
    return session.execute(select(User).where(User.name == name)).scalar_one_or_none()


def list_all(session: Session, tenant: str | None = None) -> Sequence[User]:
    stmt = select(User).join(User.tenant).order_by(User.name)
    if tenant is not None:
        stmt = stmt.where(Tenant.name == tenant)
    return session.scalars(stmt).all()


def count(session: Session) -> int:
    return session.execute(select(func.count()).select_from(User)).scalar_one()


def create(session: Session, name: str, tenant: Tenant, role: str, now: datetime) -> User:
    user = User(name=name, tenant=tenant, role=role, created_at=now)
    session.add(user)
    session.flush()
    return user
