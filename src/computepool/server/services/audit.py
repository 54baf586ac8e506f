"""Audit helpers for services: record a change in the same transaction as the change itself."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from computepool.server.context import Ctx
from computepool.server.errors import ApiError
from computepool.server.policy import Action, Principal, authorize
from computepool.server.schemas.audit import AuditOut, AuditVerifyOut
from computepool.server.schemas.common import Items
from computepool.store import audit
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.server")


def record(
    session: Session,
    ctx: Ctx,
    target: str,
    *,
    tenant: str | None = None,
    outcome: str = "ok",
    actor: str | None = None,
    detail: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> None:
    """Append to the chain inside the caller's transaction: the change and its record commit together."""
    who = actor or (ctx.principal.actor if ctx.principal else "anonymous")
    event = audit.AuditEvent(
        actor=who,
        action=str(ctx.action),
        target=target,
        outcome=outcome,
        request_id=ctx.request_id,
        tenant=tenant,
        detail=detail or {},
    )
    audit.append(session, event, now if now is not None else db_now(session))


def record_refusal(
    db: Database, principal: Principal | None, action: Action, path: str, request_id: str, exc: ApiError
) -> None:
    """A refused state-changing call (403/404/409/422) gets its own record; failures here are logged only."""
    event = audit.AuditEvent(
        actor=principal.actor if principal else "anonymous",
        action=str(action),
        target=path,
        outcome=f"refused:{exc.status}",
        request_id=request_id,
        tenant=principal.tenant if principal else None,
        detail={"error": exc.message[:200]},
    )
    try:
        with db.write() as s:
            audit.append(s, event, db_now(s))
    except Exception as e:  # the refusal is answered anyway; the database may be the problem
        log.warning("could not audit a refused %s: %s", action, type(e).__name__)


def _out(r: audit.AuditRecord) -> AuditOut:
    return AuditOut(
        seq=r.seq,
        time=r.time,
        actor=r.actor,
        tenant=r.tenant,
        action=r.action,
        target=r.target,
        outcome=r.outcome,
        request_id=r.request_id,
        detail=r.detail,
        prev_hash=r.prev_hash,
        hash=r.hash,
    )


def list_records(ctx: Ctx, filters: dict[str, Any]) -> Items[AuditOut]:
    scope = authorize(ctx.caller(), ctx.action)
    for key in ("since", "until"):  # a time without a zone is read as UTC
        t = filters.get(key)
        if t is not None and t.tzinfo is None:
            filters[key] = t.replace(tzinfo=UTC)
    tenant = filters.pop("tenant", None)
    if scope.tenant is not None:
        if tenant is not None and tenant != scope.tenant:
            return Items[AuditOut](items=[])
        tenant = scope.tenant
    with ctx.db.read() as s:
        rows = audit.query(s, tenant=tenant, **filters)
        return Items[AuditOut](items=[_out(r) for r in rows])


def verify(ctx: Ctx) -> AuditVerifyOut:
    authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        rep = audit.verify(s)
    return AuditVerifyOut(ok=rep.ok, records=rep.records, first_broken=rep.first_broken)
