"""Gateway usage and per-tenant gateway rate limits (the /v1 routes are in `server.gateway`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Response

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import gateway
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.services import GatewayLimitIn, GatewayLimitOut, UsageRow

router = APIRouter(tags=["gateway"])


@router.get("/gateway/usage", summary="Gateway requests and tokens per tenant, user, token, service, hour")
def usage(
    ctx: Annotated[Ctx, Depends(requires(Action.GATEWAY_USAGE_LIST))],
    since: Annotated[
        str | None, Query(max_length=64, description="An ISO 8601 time, or how long ago: 7d (default), 12h.")
    ] = None,
    tenant: Annotated[str | None, Query(max_length=63, description="Admins: one tenant's rows.")] = None,
    service: Annotated[str | None, Query(max_length=63, description="One service's rows.")] = None,
    limit: Annotated[
        int,
        Query(ge=1, le=gateway.USAGE_LIMIT_MAX, description="At most this many rows, oldest hours first."),
    ] = gateway.USAGE_LIMIT,
) -> Items[UsageRow]:
    return gateway.usage(ctx, since, tenant, service, limit)


@router.put("/tenants/{name}/gateway-limit", summary="Set a tenant's gateway rate limit")
def set_limit(
    name: str, body: GatewayLimitIn, ctx: Annotated[Ctx, Depends(requires(Action.GATEWAY_LIMIT_SET))]
) -> GatewayLimitOut:
    return gateway.set_limit(ctx, name, body)


@router.get("/tenants/{name}/gateway-limit", summary="A tenant's gateway rate limit")
def get_limit(name: str, ctx: Annotated[Ctx, Depends(requires(Action.GATEWAY_LIMIT_GET))]) -> GatewayLimitOut:
    return gateway.get_limit(ctx, name)


@router.delete(
    "/tenants/{name}/gateway-limit", status_code=204, summary="Remove a tenant's gateway rate limit"
)
def delete_limit(name: str, ctx: Annotated[Ctx, Depends(requires(Action.GATEWAY_LIMIT_SET))]) -> Response:
    gateway.delete_limit(ctx, name)
    return Response(status_code=204)
