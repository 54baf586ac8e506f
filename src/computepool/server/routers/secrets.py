"""Tenants' secrets: set, list (names only), delete. No route ever answers a value."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import secrets
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.secrets import SecretOut, SecretSet

router = APIRouter(tags=["secrets"])
NamePath = Annotated[str, Path(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,62}$", description="The secret's name.")]
TenantQuery = Annotated[
    str | None,
    Query(pattern=r"^[a-z0-9][a-z0-9_.-]{0,62}$", description="Admins only: the tenant whose secrets."),
]


@router.put("/secrets/{name}", summary="Set a secret of the tenant's (its admins); the value is never shown")
def set_secret(
    name: NamePath, body: SecretSet, ctx: Annotated[Ctx, Depends(requires(Action.SECRET_SET))]
) -> SecretOut:
    return secrets.set_secret(ctx, name, body)


@router.get("/secrets", summary="The tenant's secrets: names, who set them and when; never values")
def list_secrets(
    ctx: Annotated[Ctx, Depends(requires(Action.SECRET_LIST))], tenant: TenantQuery = None
) -> Items[SecretOut]:
    return secrets.list_secrets(ctx, tenant)


@router.delete("/secrets/{name}", summary="Delete a secret of the tenant's (its admins)")
def delete_secret(
    name: NamePath, ctx: Annotated[Ctx, Depends(requires(Action.SECRET_DELETE))], tenant: TenantQuery = None
) -> SecretOut:
    return secrets.delete_secret(ctx, name, tenant)
