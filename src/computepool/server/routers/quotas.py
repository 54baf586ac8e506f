"""Tenant quotas."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import tenants
from computepool.server.policy import Action
from computepool.wire.quotas import Quota

router = APIRouter(tags=["quotas"])


@router.put("/tenants/{name}/quota", summary="Replace a tenant's quota", response_model_exclude_none=True)
def set_quota(name: str, body: Quota, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_SET))]) -> Quota:
    return tenants.set_quota(ctx, name, body)


@router.get("/tenants/{name}/quota", summary="A tenant's quota", response_model_exclude_none=True)
def get_quota(name: str, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_GET))]) -> Quota:
    return tenants.get_quota(ctx, name)
