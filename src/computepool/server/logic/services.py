"""Model services for users: create or change (PUT), list, show, delete.

A service belongs to a tenant, seen by its users like allocations (another tenant's answers 404
exactly like a missing one). Its replicas are allocations the service controller starts
(service_controller.py); this module only stores the spec. A changed spec is a new generation,
whose replicas replace the old ones one by one; a change that leaves each replica's request, port
variable and health path as they were (scaling bounds, timings) re-stamps the live replicas of the
previous generation instead, so that changing `max_replicas` restarts nothing.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from computepool.core.allocation import LIVE
from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.errors import Invalid, NotFound
from computepool.server.hub import Hub
from computepool.server.logic import allocations, request_defaults
from computepool.server.logic import blobs as blob_service
from computepool.server.logic.audit import record
from computepool.server.logic.request_defaults import RequestDefaults
from computepool.server.logic.service_load import Load, fresh_load
from computepool.server.policy import Target, authorize
from computepool.store import allocations as alloc_store
from computepool.store import services as store
from computepool.store import tenants as tenant_store
from computepool.store.db import db_now
from computepool.store.models import Allocation
from computepool.wire.common import Items
from computepool.wire.services import ReplicaOut, ServiceIn, ServiceOut, ServiceSpec

# spec fields that a running replica embodies: changing one of them replaces the replicas
REPLICA_FIELDS = ("request", "port_env", "health_path")


def replica_request(spec: ServiceSpec, tenant: str, defaults: RequestDefaults) -> dict[str, Any]:
    """One replica's request as stored with its allocation (the same normal form as POST /allocations,
    with the tenant's defaults where it names no CPU or memory)."""
    return request_defaults.fill(allocations._normalise(spec.request, tenant), defaults)[0]


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _replica_out(r: store.ReplicaRow, load: Load | None) -> ReplicaOut:
    return ReplicaOut(
        allocation_id=r.id,
        state=r.state,
        replica_state=r.replica_state,
        generation=r.generation,
        node=r.node,
        endpoint=r.endpoint,
        inflight=(load.per_replica.get(r.id, 0) if load else 0),
        since=r.since,
        reason=r.reason,
    )


def _out(svc: store.ServiceRow, reps: list[store.ReplicaRow], load: Load | None) -> ServiceOut:
    return ServiceOut(
        id=svc.id,
        name=svc.name,
        tenant=svc.tenant,
        owner=svc.owner,
        generation=svc.generation,
        desired=svc.desired,
        ready=sum(1 for r in reps if r.state == "active" and r.replica_state == "ready"),
        inflight=load.inflight if load else 0,
        queued=load.queued if load else 0,
        reason=svc.reason,
        spec=ServiceSpec.model_validate(_shown_spec(svc.spec)),
        replicas=[_replica_out(r, load) for r in reps],
        created_at=svc.created_at,
        updated_at=svc.updated_at,
        last_request_at=svc.last_request_at,
    )


def _outs(s: Session, svcs: list[store.ServiceRow]) -> list[ServiceOut]:
    ids = [v.id for v in svcs]
    reps = store.replicas(s, ids)
    loads = fresh_load(s, ids, db_now(s))
    by: dict[int, list[store.ReplicaRow]] = {i: [] for i in ids}
    for r in reps:
        by[r.service_id].append(r)
    return [_out(v, by[v.id], loads.get(v.id)) for v in svcs]


def _tenant_of(ctx: Ctx, s: Session, tenant: str | None) -> tuple[str, int]:
    """The tenant named (admins; others may name only their own) or the caller's, and its id."""
    caller = ctx.caller()
    name = tenant or caller.tenant or ""
    if tenant is not None:
        authorize(caller, ctx.action, Target("tenant", tenant, tenant=tenant, field="tenant"))
    row = tenant_store.get(s, name)
    if row is None:
        raise NotFound.of("tenant", name, "tenant")
    return name, int(row.id)


def _visible(ctx: Ctx, s: Session, name: str, tenant: str | None, *, lock: bool = False) -> store.ServiceRow:
    caller = ctx.caller()
    tname = tenant or caller.tenant or ""
    authorize(caller, ctx.action, Target("service", name, tenant=tname))
    row = tenant_store.get(s, tname)
    svc = None if row is None else store.by_name(s, int(row.id), name, lock=lock)
    if svc is None:
        raise NotFound.of("service", name)
    return svc


def put(ctx: Ctx, name: str, body: ServiceIn, hub: Hub) -> tuple[ServiceOut, bool]:
    """Create the service (True) or change it (False); the request passes POST /allocations' checks."""
    caller = ctx.caller()
    spec = body.spec
    if body.tenant is not None and spec.request.tenant not in (None, body.tenant):
        raise Invalid(
            f"spec.request.tenant: '{spec.request.tenant}' contradicts tenant '{body.tenant}'",
            "spec.request.tenant",
        )
    tenant = body.tenant or spec.request.tenant
    if tenant is not None:
        authorize(caller, ctx.action, Target("tenant", tenant, tenant=tenant, field="tenant"))
    tenant = tenant or caller.tenant or ""
    request = spec.request.model_copy(update={"tenant": None})
    spec = spec.model_copy(update={"request": request})
    try:
        stored, tenant_id = allocations.admitted(ctx, request, tenant)
    except Invalid as e:  # name the field as the caller sent it: inside spec.request
        field = f"spec.request.{e.field}" if e.field else "spec.request"
        message = f"spec.request.{e.message}" if e.message.startswith(f"{e.field}:") else e.message
        raise Invalid(message, field) from e
    dumped = spec.model_dump(mode="json")
    # the request as the caller wrote it: read back, it normalises exactly as it did here
    dumped["request"] = request.model_dump(mode="json", exclude_unset=True)
    with ctx.db.write() as s:
        now = db_now(s)
        try:
            blob_service.claim(s, tenant_id, stored, now)
        except Invalid as e:
            raise Invalid(f"spec.request.{e.message}", f"spec.request.{e.field}") from e
        found = store.by_name(s, tenant_id, name, lock=True)
        created = found is None
        _check_cap(ctx, s, tenant, tenant_id, spec.min_replicas, None if found is None else found.id)
        if found is None:
            sid = store.insert(s, tenant_id, caller.name, name, dumped, now)
            record(s, ctx, f"service:{sid}", tenant=tenant, detail={"name": name}, now=now)
        else:
            sid = found.id
            if _canon(found.spec) != _canon(dumped):
                generation = found.generation + 1
                store.set_spec(s, sid, dumped, generation, now)
                if all(_canon(found.spec.get(k)) == _canon(dumped.get(k)) for k in REPLICA_FIELDS):
                    _restamp(s, sid, found.generation, generation)
                detail = {"name": name, "generation": generation}
                record(s, ctx, f"service:{sid}", tenant=tenant, detail=detail, now=now)
        svc = store.by_ids(s, [sid])[sid]
        out = _outs(s, [svc])[0]
    hub.notify(topics.service(sid))
    return out, created


def _check_cap(ctx: Ctx, s: Session, tenant: str, tenant_id: int, min_replicas: int, sid: int | None) -> None:
    """The tenant's services together may not need more replicas than max_replicas_per_tenant (the
    controller never starts more than that either: one tenant cannot take every port)."""
    cap = ctx.settings.max_replicas_per_tenant
    others = store.min_replicas_of_tenant(s, tenant_id, besides=sid)
    if others + min_replicas > cap:
        raise Invalid(
            f"spec.min_replicas: {min_replicas} would give tenant '{tenant}' at least "
            f"{others + min_replicas} replicas over its services, above the {cap} a tenant may have "
            "(max_replicas_per_tenant)",
            "spec.min_replicas",
        )


def _restamp(s: Session, sid: int, previous: int, generation: int) -> None:
    """The replicas of the previous generation embody the new one too; older ones (still being
    replaced in a rollout) keep their generation, so that they are still replaced."""
    s.execute(
        update(Allocation)
        .where(
            Allocation.service_id == sid,
            Allocation.state.in_(LIVE),
            Allocation.service_generation == previous,
        )
        .values(service_generation=generation),
        execution_options={"synchronize_session": False},
    )


def list_all(ctx: Ctx) -> Items[ServiceOut]:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        return Items[ServiceOut](items=_outs(s, store.list_services(s, scope.tenant)))


def get(ctx: Ctx, name: str, tenant: str | None) -> ServiceOut:
    with ctx.db.read() as s:
        return _outs(s, [_visible(ctx, s, name, tenant)])[0]


def delete(ctx: Ctx, name: str, tenant: str | None, hub: Hub) -> ServiceOut:
    """Soft-delete: replicas not yet running are cancelled, running ones drained (the controller
    releases them once their requests finished, or after drain_s)."""
    with ctx.db.write() as s:
        svc = _visible(ctx, s, name, tenant, lock=True)
        now = db_now(s)
        store.mark_deleted(s, svc.id, now)
        nodes = drain_or_cancel(s, store.replicas(s, [svc.id]), "service deleted", now)
        record(s, ctx, f"service:{svc.id}", tenant=svc.tenant, detail={"name": name}, now=now)
        out = _outs(s, [store.by_ids(s, [svc.id])[svc.id]])[0]
    hub.notify(topics.service(svc.id), *topics.nodes(nodes))
    hub.wake_scheduler()
    return out


def drain_or_cancel(s: Session, reps: list[store.ReplicaRow], why: str, now: datetime) -> list[str]:
    """Active replicas start draining; the others are cancelled at once. The nodes to wake."""
    nodes: list[str] = []
    for r in reps:
        if r.state == "active":
            if r.replica_state != "draining":
                store.set_replica_state(s, r.id, "draining", now)
            continue
        head = alloc_store.lock_head(s, r.id)
        if head is None or head.state not in LIVE:
            continue
        alloc_store.end(s, head, "cancelled", why, now)
        nodes.extend(head.nodes)
    return nodes


def _shown_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec as readers see it: secrets the pool put in request.env (a cooperative plan's) hidden."""
    request = spec.get("request")
    return spec if not isinstance(request, dict) else dict(spec, request=allocations._hidden(request))
