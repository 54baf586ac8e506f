"""Tenants and their quotas."""

from __future__ import annotations

from sqlalchemy.orm import Session

from computepool.server.context import Ctx
from computepool.server.errors import Conflict, Invalid, NotFound
from computepool.server.logic.audit import record
from computepool.server.policy import Target, authorize
from computepool.store import quotas, tenants
from computepool.store.db import db_now
from computepool.store.models import Tenant
from computepool.wire.common import Items
from computepool.wire.identity import TenantCreate, TenantOut
from computepool.wire.quotas import MODEL_RESOURCES, POOL_RESOURCES, Quota


def _out(t: Tenant) -> TenantOut:
    return TenantOut(name=t.name, weight=t.weight, created_at=t.created_at)


def visible(session: Session, ctx: Ctx, name: str, field: str | None = None) -> Tenant:
    """The tenant, if it exists and the caller may see it; otherwise the same 404 either way."""
    tenant = tenants.get(session, name)
    if tenant is None:
        raise NotFound.of("tenant", name, field)
    authorize(ctx.caller(), ctx.action, Target("tenant", name, tenant=name, field=field))
    return tenant


def create(ctx: Ctx, body: TenantCreate) -> TenantOut:
    with ctx.db.write() as s:
        if tenants.get(s, body.name) is not None:
            raise Conflict(f"tenant '{body.name}' exists already", "name")
        t = tenants.create(s, body.name, body.weight, db_now(s))
        record(s, ctx, f"tenant:{t.name}", tenant=t.name, detail={"weight": t.weight})
        return _out(t)


def list_all(ctx: Ctx) -> Items[TenantOut]:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        return Items[TenantOut](items=[_out(t) for t in tenants.list_all(s, only=scope.tenant)])


def get(ctx: Ctx, name: str) -> TenantOut:
    with ctx.db.read() as s:
        return _out(visible(s, ctx, name))


def set_quota(ctx: Ctx, name: str, body: Quota) -> Quota:
    entries: list[tuple[str, str, int, int]] = []
    for res in POOL_RESOURCES:
        pair = getattr(body, res)
        if pair is not None:
            entries.append(("", res, pair.guaranteed, pair.limit))
    for model, mq in body.models.items():
        for res in MODEL_RESOURCES:
            pair = getattr(mq, res)
            if pair is not None:
                pool = getattr(body, res)
                if pool is not None and pair.guaranteed > pool.limit:
                    raise Invalid(
                        f"guaranteed {pair.guaranteed} for {model} is above the {res} limit {pool.limit}",
                        f"models.{model}.{res}.guaranteed",
                    )
                entries.append((model, res, pair.guaranteed, pair.limit))
    with ctx.db.write() as s:
        tenant = visible(s, ctx, name)
        quotas.replace(s, tenant, entries)
        record(s, ctx, f"quota:{name}", tenant=name, detail={"quota": body.model_dump(exclude_none=True)})
        out = _quota_of(s, tenant)
    if ctx.caches is not None:
        ctx.caches.shape.invalidate()
    return out


def get_quota(ctx: Ctx, name: str) -> Quota:
    with ctx.db.read() as s:
        return _quota_of(s, visible(s, ctx, name))


def _quota_of(s: Session, tenant: Tenant) -> Quota:
    doc: dict[str, object] = {}
    models: dict[str, dict[str, object]] = {}
    for e in quotas.get(s, tenant):
        pair = {"guaranteed": e.guaranteed, "limit": e.limit_value}
        if e.model:
            models.setdefault(e.model, {})[e.resource] = pair
        else:
            doc[e.resource] = pair
    doc["models"] = models
    return Quota.model_validate(doc)
