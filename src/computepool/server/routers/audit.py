"""The audit log and its verification."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import audit
from computepool.server.policy import Action
from computepool.wire.audit import AuditOut, AuditVerifyOut
from computepool.wire.common import Items

router = APIRouter(tags=["audit"])


@router.get("/audit", summary="Audit records in chain order, filtered")
def list_audit(
    ctx: Annotated[Ctx, Depends(requires(Action.AUDIT_LIST))],
    tenant: Annotated[str | None, Query(max_length=63, description="Only this tenant's records.")] = None,
    actor: Annotated[str | None, Query(max_length=80, description="e.g. user:alice or node:n1.")] = None,
    action: Annotated[str | None, Query(max_length=64, description="e.g. tenant.create.")] = None,
    since: Annotated[datetime | None, Query(description="From this time (inclusive), ISO 8601.")] = None,
    until: Annotated[datetime | None, Query(description="Before this time, ISO 8601.")] = None,
    after: Annotated[int, Query(ge=0, le=2**62, description="Only records after this sequence number.")] = 0,
    limit: Annotated[int, Query(ge=1, le=10_000, description="At most this many records.")] = 1000,
) -> Items[AuditOut]:
    return audit.list_records(
        ctx,
        {
            "tenant": tenant,
            "actor": actor,
            "action": action,
            "since": since,
            "until": until,
            "after_seq": after,
            "limit": limit,
        },
    )


@router.get("/audit/verify", summary="Recompute the hash chain")
def verify(ctx: Annotated[Ctx, Depends(requires(Action.AUDIT_VERIFY))]) -> AuditVerifyOut:
    return audit.verify(ctx)
