"""A cooperative service's plan for its users (`cpool services explain`): visible exactly like the
service itself; a service that is not cooperative has no plan and answers 404 like a missing one."""

from __future__ import annotations

from computepool.server.context import Ctx
from computepool.server.coop.state import plan_out
from computepool.server.errors import NotFound
from computepool.server.logic.services import _visible
from computepool.store import coop as coop_store
from computepool.store.db import db_now
from computepool.wire.coop import CoopPlanOut


def plan(ctx: Ctx, name: str, tenant: str | None) -> CoopPlanOut:
    with ctx.db.read() as s:
        svc = _visible(ctx, s, name, tenant)
        if not svc.spec.get("cooperative"):
            raise NotFound.of("service", name)
        row = coop_store.plans(s, [svc.id]).get(svc.id)
        return plan_out(svc.name, row, db_now(s))
