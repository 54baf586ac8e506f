"""API tokens (of users and of nodes) and join tokens. Only hashes of secrets are stored here."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from computepool.store.models import ApiToken, JoinToken, Tenant, User


def get(session: Session, token_id: str) -> ApiToken | None:
    return session.get(ApiToken, token_id)


def add(session: Session, token: ApiToken) -> ApiToken:
    session.add(token)
    session.flush()
    return token


def list_user_tokens(
    session: Session, *, user: str | None = None, tenant: str | None = None
) -> Sequence[ApiToken]:
    """User tokens (not node credentials), optionally of one user or of one tenant's users."""
    stmt = select(ApiToken).join(User, ApiToken.user_id == User.id).order_by(ApiToken.created_at, ApiToken.id)
    if user is not None:
        stmt = stmt.where(User.name == user)
    if tenant is not None:
        stmt = stmt.join(Tenant, User.tenant_id == Tenant.id).where(Tenant.name == tenant)
    return session.scalars(stmt).all()


def revoke(session: Session, token: ApiToken, now: datetime) -> None:
    if token.revoked_at is None:
        token.revoked_at = now
        session.flush()


def get_join(session: Session, token_id: str) -> JoinToken | None:
    return session.get(JoinToken, token_id)


def add_join(session: Session, token: JoinToken) -> JoinToken:
    session.add(token)
    session.flush()
    return token


def consume_join(session: Session, token: JoinToken, now: datetime) -> bool:
    """Count one use; False when a single-use token was used already (checked in the UPDATE itself)."""
    res = session.execute(
        update(JoinToken)
        .where(JoinToken.id == token.id, or_(JoinToken.single_use.is_(False), JoinToken.uses == 0))
        .values(uses=JoinToken.uses + 1, last_used_at=now)
        .execution_options(synchronize_session=False)
    )
    session.expire(token)
    return res.rowcount == 1  # type: ignore[attr-defined]
