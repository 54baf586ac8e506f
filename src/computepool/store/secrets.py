"""Tenants' secrets as stored: ciphertext only (sealing and opening is server/secret_box.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from computepool.store.models import Secret


def get(session: Session, tenant_id: int, name: str, *, for_update: bool = False) -> Secret | None:
    stmt = select(Secret).where(Secret.tenant_id == tenant_id, Secret.name == name)
    if for_update:
        stmt = stmt.with_for_update()
    return session.execute(stmt).scalar_one_or_none()


def of_tenant(session: Session, tenant_id: int) -> Sequence[Secret]:
    return session.scalars(select(Secret).where(Secret.tenant_id == tenant_id).order_by(Secret.name)).all()


def named(
    session: Session, tenant_id: int, names: Iterable[str], *, share: bool = False
) -> dict[str, Secret]:
    """The tenant's secrets among `names`, by name; `share` locks them against a delete (PostgreSQL:
    FOR SHARE) until the caller's transaction ends, so a job never names one that was just deleted."""
    wanted = sorted(set(names))
    if not wanted:
        return {}
    stmt = select(Secret).where(Secret.tenant_id == tenant_id, Secret.name.in_(wanted))
    if share:
        stmt = stmt.with_for_update(read=True)
    return {s.name: s for s in session.scalars(stmt)}


def put(
    session: Session, tenant_id: int, name: str, ciphertext: str, by: str, now: datetime
) -> tuple[Secret, bool]:
    """Set the secret (True: it is new), replacing any value it had."""
    secret = get(session, tenant_id, name, for_update=True)
    created = secret is None
    if secret is None:
        secret = Secret(tenant_id=tenant_id, name=name, created_at=now)
        session.add(secret)
    secret.ciphertext, secret.set_by, secret.updated_at = ciphertext, by, now
    session.flush()
    return secret, created


def delete(session: Session, secret: Secret) -> None:
    session.delete(secret)
    session.flush()


def any_one(session: Session) -> Secret | None:
    """Some stored secret: at start, proof that this server's key opens what the database holds."""
    return session.scalars(select(Secret).order_by(Secret.id).limit(1)).first()
