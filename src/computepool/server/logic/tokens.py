"""API tokens of users: created (secret shown once), listed (never the secret), revoked."""

from __future__ import annotations

from datetime import timedelta

from computepool.server.context import Ctx
from computepool.server.credentials import new_secret
from computepool.server.errors import NotFound
from computepool.server.logic.audit import record
from computepool.server.policy import Role, Target, authorize
from computepool.store import tokens, users
from computepool.store.db import db_now
from computepool.store.models import ApiToken
from computepool.wire.common import Items
from computepool.wire.identity import TokenCreate, TokenCreated, TokenOut


def _out(t: ApiToken) -> TokenOut:
    assert t.user is not None
    return TokenOut(
        id=t.id,
        name=t.name,
        user=t.user.name,
        created_by=t.created_by,
        created_at=t.created_at,
        expires_at=t.expires_at,
        revoked_at=t.revoked_at,
    )


def create(ctx: Ctx, body: TokenCreate) -> TokenCreated:
    caller = ctx.caller()
    name = body.user or caller.name
    with ctx.db.write() as s:
        user = users.get(s, name)
        if user is None:
            raise NotFound.of("user", name, "user")
        authorize(
            caller,
            ctx.action,
            Target(
                "user", name, tenant=user.tenant.name, owner=name, owner_role=Role(user.role), field="user"
            ),
        )
        now = db_now(s)
        secret = new_secret()
        expires = now + timedelta(seconds=body.expires_in_s) if body.expires_in_s else None
        tok = tokens.add(
            s,
            ApiToken(
                id=secret.id,
                secret_hash=secret.secret_hash,
                name=body.name,
                user_id=user.id,
                created_by=caller.name,
                created_at=now,
                expires_at=expires,
            ),
        )
        record(s, ctx, f"token:{tok.id}", tenant=user.tenant.name, detail={"user": name})
        return TokenCreated(id=tok.id, token=secret.token, user=name, expires_at=expires)


def list_all(ctx: Ctx) -> Items[TokenOut]:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        rows = tokens.list_user_tokens(s, user=scope.user, tenant=scope.tenant)
        return Items[TokenOut](items=[_out(t) for t in rows])


def revoke(ctx: Ctx, token_id: str) -> TokenOut:
    with ctx.db.write() as s:
        tok = tokens.get(s, token_id)
        if tok is None or tok.user is None:
            raise NotFound.of("token", token_id)
        owner = tok.user
        authorize(
            ctx.caller(),
            ctx.action,
            Target(
                "token", token_id, tenant=owner.tenant.name, owner=owner.name, owner_role=Role(owner.role)
            ),
        )
        tokens.revoke(s, tok, db_now(s))
        if ctx.caches is not None:
            ctx.caches.tokens.forget(tok.id)
        record(s, ctx, f"token:{tok.id}", tenant=owner.tenant.name, detail={"user": owner.name})
        return _out(tok)
