"""Tenant quotas: `{guaranteed, limit}` per resource, pool-wide (`model=""`) or per GPU model."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from computepool.store.models import QuotaEntry, Tenant

ANY_MODEL = ""


def get(session: Session, tenant: Tenant) -> Sequence[QuotaEntry]:
    stmt = select(QuotaEntry).where(QuotaEntry.tenant_id == tenant.id)
    return session.scalars(stmt.order_by(QuotaEntry.model, QuotaEntry.resource)).all()


def replace(session: Session, tenant: Tenant, entries: Iterable[tuple[str, str, int, int]]) -> None:
    """Make `(model, resource, guaranteed, limit)` the tenant's whole quota."""
    session.execute(delete(QuotaEntry).where(QuotaEntry.tenant_id == tenant.id))
    for model, resource, guaranteed, limit in entries:
        session.add(
            QuotaEntry(
                tenant_id=tenant.id, model=model, resource=resource, guaranteed=guaranteed, limit_value=limit
            )
        )
    session.flush()
