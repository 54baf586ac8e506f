"""Tenants."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import reclaim, request_defaults, tenants
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.identity import TenantCreate, TenantOut
from computepool.wire.reclaim import ReclaimPolicyIn, ReclaimPolicyOut
from computepool.wire.tenant_defaults import TenantDefaultsIn, TenantDefaultsOut

router = APIRouter(tags=["tenants"])


@router.post("/tenants", status_code=201, summary="Create a tenant")
def create_tenant(
    body: TenantCreate, ctx: Annotated[Ctx, Depends(requires(Action.TENANT_CREATE))]
) -> TenantOut:
    return tenants.create(ctx, body)


@router.get("/tenants", summary="Tenants the caller may see")
def list_tenants(ctx: Annotated[Ctx, Depends(requires(Action.TENANT_LIST))]) -> Items[TenantOut]:
    return tenants.list_all(ctx)


@router.get("/tenants/{name}", summary="One tenant")
def get_tenant(name: str, ctx: Annotated[Ctx, Depends(requires(Action.TENANT_GET))]) -> TenantOut:
    return tenants.get(ctx, name)


@router.put("/tenants/{name}/reclaim", summary="Set a tenant's idle-reclaim policy (admin)")
def set_reclaim(
    name: str, body: ReclaimPolicyIn, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_SET))]
) -> ReclaimPolicyOut:
    return reclaim.set_policy(ctx, name, body)


@router.get("/tenants/{name}/reclaim", summary="A tenant's idle-reclaim policy")
def get_reclaim(name: str, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_GET))]) -> ReclaimPolicyOut:
    return reclaim.get_policy(ctx, name)


@router.delete("/tenants/{name}/reclaim", summary="Turn a tenant's idle reclaim off (admin)")
def delete_reclaim(name: str, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_SET))]) -> ReclaimPolicyOut:
    return reclaim.delete_policy(ctx, name)


@router.get("/tenants/{name}/defaults", summary="What requests get that name no CPU or memory")
def get_defaults(name: str, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_GET))]) -> TenantDefaultsOut:
    return request_defaults.get(ctx, name)


@router.patch(
    "/tenants/{name}/defaults",
    summary="Change a tenant's request defaults and process limit (admin; null: the pool's default)",
)
def change_defaults(
    name: str, body: TenantDefaultsIn, ctx: Annotated[Ctx, Depends(requires(Action.QUOTA_SET))]
) -> TenantDefaultsOut:
    return request_defaults.change(ctx, name, body)
