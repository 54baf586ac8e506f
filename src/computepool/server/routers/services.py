"""Model services: create or change, list, show, delete (their replicas are the controller's)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.hub import Hub
from computepool.server.logic import coop, services
from computepool.server.policy import Action
from computepool.wire.common import Items, Name
from computepool.wire.coop import CoopPlanOut
from computepool.wire.services import ServiceIn, ServiceOut

router = APIRouter(tags=["services"])
TenantParam = Annotated[Name | None, Query(description="Admins: another tenant's service.")]


async def get_hub(request: Request) -> Hub:
    """On the event loop: FastAPI runs a plain `def` dependency in a worker thread, a hop per request."""
    hub: Hub = request.app.state.hub
    return hub


@router.put(
    "/services/{name}",
    summary="Create a model service (201) or change it (200; a changed spec is a new generation)",
    responses={201: {"description": "The service was created"}},
)
def put_service(
    name: Name,
    body: ServiceIn,
    response: Response,
    ctx: Annotated[Ctx, Depends(requires(Action.SERVICE_PUT))],
    hub: Annotated[Hub, Depends(get_hub)],
) -> ServiceOut:
    out, created = services.put(ctx, name, body, hub)
    response.status_code = 201 if created else 200
    return out


@router.get("/services", summary="The services of the caller's tenant (admins: all)")
def list_services(ctx: Annotated[Ctx, Depends(requires(Action.SERVICE_LIST))]) -> Items[ServiceOut]:
    return services.list_all(ctx)


@router.get("/services/{name}", summary="One service with its replicas")
def get_service(
    name: Name, ctx: Annotated[Ctx, Depends(requires(Action.SERVICE_GET))], tenant: TenantParam = None
) -> ServiceOut:
    return services.get(ctx, name, tenant)


@router.get("/services/{name}/plan", summary="A cooperative service's plan: its split, measurements and why")
def get_service_plan(
    name: Name, ctx: Annotated[Ctx, Depends(requires(Action.SERVICE_PLAN_GET))], tenant: TenantParam = None
) -> CoopPlanOut:
    return coop.plan(ctx, name, tenant)


@router.delete("/services/{name}", summary="Delete a service: its replicas are drained, then released")
def delete_service(
    name: Name,
    ctx: Annotated[Ctx, Depends(requires(Action.SERVICE_DELETE))],
    hub: Annotated[Hub, Depends(get_hub)],
    tenant: TenantParam = None,
) -> ServiceOut:
    return services.delete(ctx, name, tenant, hub)
