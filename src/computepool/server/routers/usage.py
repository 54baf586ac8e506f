"""The usage ledger (grouped, priced), prices, device history and the static equivalent."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query

from computepool.core.usage import UsageBy
from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import usage
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.usage import (
    DeviceSampleOut,
    PriceIn,
    PriceOut,
    StaticEquivalentOut,
    UsageOut,
)

router = APIRouter(tags=["usage"])

When = Annotated[
    str | None, Query(max_length=64, description="An ISO 8601 time, or how long ago: 30m, 12h, 7d.")
]
Item = Annotated[
    str,
    Path(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="A device model as nodes report it (price per GPU-hour), or energy-kwh (per kWh).",
    ),
]


@router.get(
    "/usage", summary="GPU-hours, CPU-hours, energy and cost, grouped", response_model_exclude_none=True
)
def get_usage(
    ctx: Annotated[Ctx, Depends(requires(Action.USAGE_LIST))],
    by: Annotated[UsageBy, Query(description="Group by tenant, user, job or device model.")] = "tenant",
    since: When = None,
    until: When = None,
) -> UsageOut:
    return usage.usage(ctx, by, since, until)


@router.get("/usage/static-equivalent", summary="What static per-tenant partitions would have needed")
def static_equivalent(
    ctx: Annotated[Ctx, Depends(requires(Action.USAGE_STATIC_GET))],
    since: When = None,
    until: When = None,
) -> StaticEquivalentOut:
    return usage.static_equivalent(ctx, since, until)


@router.get("/prices", summary="Prices per GPU-hour of each device model and per kWh")
def list_prices(ctx: Annotated[Ctx, Depends(requires(Action.PRICE_LIST))]) -> Items[PriceOut]:
    return usage.list_prices(ctx)


@router.put("/prices/{item}", summary="Set a price (admin)")
def set_price(
    item: Item, body: PriceIn, ctx: Annotated[Ctx, Depends(requires(Action.PRICE_SET))]
) -> PriceOut:
    return usage.set_price(ctx, item, body)


@router.delete("/prices/{item}", summary="Remove a price (admin); its item then costs nothing")
def delete_price(item: Item, ctx: Annotated[Ctx, Depends(requires(Action.PRICE_SET))]) -> PriceOut:
    return usage.delete_price(ctx, item)


@router.get("/nodes/{name}/history", summary="A node's devices' utilization, memory and power over time")
def node_history(
    name: str,
    ctx: Annotated[Ctx, Depends(requires(Action.NODE_HISTORY_GET))],
    since: When = None,
) -> Items[DeviceSampleOut]:
    return usage.node_history(ctx, name, since)
