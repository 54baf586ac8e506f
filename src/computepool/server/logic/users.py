"""Users: created by an admin, or by a tenant-admin inside their own tenant (never as admin)."""

from __future__ import annotations

from computepool.server.context import Ctx
from computepool.server.errors import Conflict
from computepool.server.logic import tenants as tenant_service
from computepool.server.logic.audit import record
from computepool.server.policy import Role, Target, authorize
from computepool.store import users
from computepool.store.db import db_now
from computepool.store.models import User
from computepool.wire.common import Items
from computepool.wire.identity import UserCreate, UserOut


def out(u: User) -> UserOut:
    return UserOut(name=u.name, tenant=u.tenant.name, role=u.role, created_at=u.created_at)


def create(ctx: Ctx, body: UserCreate) -> UserOut:
    with ctx.db.write() as s:
        tenant = tenant_service.visible(s, ctx, body.tenant, field="tenant")
        target = Target("user", body.name, tenant=body.tenant, owner=body.name, owner_role=Role(body.role))
        authorize(ctx.caller(), ctx.action, target)
        if users.get(s, body.name) is not None:
            raise Conflict(f"user '{body.name}' exists already", "name")
        u = users.create(s, body.name, tenant, body.role, db_now(s))
        record(s, ctx, f"user:{u.name}", tenant=tenant.name, detail={"role": u.role})
        return out(u)


def list_all(ctx: Ctx) -> Items[UserOut]:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        return Items[UserOut](items=[out(u) for u in users.list_all(s, tenant=scope.tenant)])
