"""Tenants' idle-reclaim policies (set by admins, read by the tenant's members); the controller
that applies them and time limits is `server.reclaim`."""

from __future__ import annotations

from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_duration_s
from computepool.server.context import Ctx
from computepool.server.errors import Invalid
from computepool.server.logic.audit import record
from computepool.server.logic.tenants import visible
from computepool.store import reclaim
from computepool.store.db import db_now
from computepool.wire.reclaim import ReclaimPolicyIn, ReclaimPolicyOut


def _duration(value: int | str, field: str, *, zero_ok: bool = False) -> int:
    if zero_ok and value in (0, "0"):
        return 0
    try:
        return parse_duration_s(value, field)
    except InvalidInput as e:
        raise Invalid(f"{e.where}: {e.message}", e.where) from e


def _out(tenant: str, policy: reclaim.Policy | None) -> ReclaimPolicyOut:
    if policy is None:
        return ReclaimPolicyOut(tenant=tenant, enabled=False)
    return ReclaimPolicyOut(
        tenant=tenant, enabled=True, idle_s=policy.idle_s, warn_s=policy.warn_s, updated_at=policy.updated_at
    )


def set_policy(ctx: Ctx, name: str, body: ReclaimPolicyIn) -> ReclaimPolicyOut:
    idle_s = _duration(body.idle, "idle")
    warn_s = _duration(body.warn, "warn", zero_ok=True)
    if warn_s >= idle_s:
        raise Invalid(f"warn: {warn_s} s is not shorter than idle ({idle_s} s)", "warn")
    with ctx.db.write() as s:
        tenant = visible(s, ctx, name)
        policy = reclaim.set_policy(s, tenant, idle_s, warn_s, db_now(s))
        record(s, ctx, f"reclaim:{name}", tenant=name, detail={"idle_s": idle_s, "warn_s": warn_s})
        return _out(name, policy)


def get_policy(ctx: Ctx, name: str) -> ReclaimPolicyOut:
    with ctx.db.read() as s:
        return _out(name, reclaim.get_policy(s, visible(s, ctx, name)))


def delete_policy(ctx: Ctx, name: str) -> ReclaimPolicyOut:
    with ctx.db.write() as s:
        tenant = visible(s, ctx, name)
        if reclaim.delete_policy(s, tenant):
            record(s, ctx, f"reclaim:{name}", tenant=name, detail={"enabled": False})
        return _out(name, None)
