"""whoami, users and API tokens."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from computepool.server.context import Ctx
from computepool.server.deps import requires
from computepool.server.logic import tokens, users
from computepool.server.policy import Action
from computepool.wire.common import Items
from computepool.wire.identity import (
    TokenCreate,
    TokenCreated,
    TokenOut,
    UserCreate,
    UserOut,
    WhoAmI,
)

router = APIRouter(tags=["identity"])


@router.get("/whoami", summary="Who the bearer token belongs to")
def whoami(ctx: Annotated[Ctx, Depends(requires(Action.WHOAMI))]) -> WhoAmI:
    p = ctx.caller()
    return WhoAmI(name=p.name, role=p.role, tenant=p.tenant, node=p.node, token_id=p.token_id)


@router.post("/users", status_code=201, summary="Create a user")
def create_user(body: UserCreate, ctx: Annotated[Ctx, Depends(requires(Action.USER_CREATE))]) -> UserOut:
    return users.create(ctx, body)


@router.get("/users", summary="Users the caller may see")
def list_users(ctx: Annotated[Ctx, Depends(requires(Action.USER_LIST))]) -> Items[UserOut]:
    return users.list_all(ctx)


@router.post("/tokens", status_code=201, summary="Create an API token (the secret is shown only here)")
def create_token(
    body: TokenCreate, ctx: Annotated[Ctx, Depends(requires(Action.TOKEN_CREATE))]
) -> TokenCreated:
    return tokens.create(ctx, body)


@router.get("/tokens", summary="API tokens the caller may see (never their secrets)")
def list_tokens(ctx: Annotated[Ctx, Depends(requires(Action.TOKEN_LIST))]) -> Items[TokenOut]:
    return tokens.list_all(ctx)


@router.delete("/tokens/{token_id}", summary="Revoke an API token")
def revoke_token(token_id: str, ctx: Annotated[Ctx, Depends(requires(Action.TOKEN_REVOKE))]) -> TokenOut:
    return tokens.revoke(ctx, token_id)
