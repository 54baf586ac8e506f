"""Allocations for users: create, read, explain, release, cancel, logs (the node agents' side —
assignments, reports, log chunks — is in agent_reports.py).

Lifecycle: `pending → bound` (the scheduler placed it; slices fixed). A *plain* allocation (no
command) is used as it is and stays `bound` until released. A *job* (with a command) is run by
the agents of its nodes and turns `active` when one reports the process running; it ends
`released` when it exits 0, `failed` otherwise. Preemption and node loss requeue a restartable
allocation (`pending`, attempt + 1) and end any other one (`preempted`, `failed`). Every
transition is an event with its time and reason.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from computepool.core import InvalidInput, Isolation, Request, Sharing
from computepool.core.allocation import AllocationState
from computepool.core.quantities import parse_duration_s
from computepool.server import reclaim, scheduling, topics
from computepool.server.caches import Shape, ShapeCache
from computepool.server.context import Ctx
from computepool.server.errors import Conflict, Invalid, NotFound
from computepool.server.hub import Hub
from computepool.server.logic import blobs as blob_service
from computepool.server.logic import gangs, images, job_control, published, request_defaults
from computepool.server.logic import secrets as secret_logic
from computepool.server.logic.audit import record
from computepool.server.logic.request_defaults import RequestDefaults
from computepool.server.policy import Target, authorize
from computepool.server.scheduling.backfill import about_reservation
from computepool.server.scheduling.gates import held_reason
from computepool.store import allocations as store
from computepool.store import logs
from computepool.store.db import db_now
from computepool.store.models import Allocation, Tenant
from computepool.wire.allocation_out import (
    AllocationOut,
    EventOut,
    ExplainOut,
    LogsOut,
    ReasonsOut,
    RequestOut,
    SliceOut,
    StreamOut,
)
from computepool.wire.allocations import AllocationCreate, parse_array
from computepool.wire.common import Items

MAX_LOG_READ = 1 << 20


# --- shaping ------------------------------------------------------------------------------------
def _out(a: Any, events: Sequence[Any] | None, tenant: str | None = None) -> AllocationOut:
    """`a`: an ORM allocation or a plain row of its columns (then with `tenant`); `events`:
    its history, or None when the caller did not ask for it (lists)."""
    return AllocationOut(
        id=a.id,
        name=a.name,
        tenant=tenant or a.tenant.name,
        owner=a.owner,
        request=RequestOut.model_validate(_hidden(a.request)),
        command=a.command,
        env=_hide_secrets(a.env),
        restartable=a.restartable,
        state=a.state,
        reason=a.reason,
        attempt=a.attempt,
        term=a.term,
        nodes=list(a.nodes),
        slices=[SliceOut.model_validate(sl) for sl in a.slices],
        exit_code=a.exit_code,
        created_at=a.created_at,
        bound_at=a.bound_at,
        started_at=a.started_at,
        ended_at=a.ended_at,
        events=None if events is None else [_event_out(e) for e in events],
        members=gangs.members_out(a),
        **job_control.out_fields(a.request),
    )


def _event_out(e: Any) -> EventOut:
    return EventOut(at=e.at, state=e.state, reason=e.reason)


def _one(s: Session, a: Allocation) -> AllocationOut:
    return _out(a, store.events_of(s, [a.id])[a.id])


def _visible(s: Session, ctx: Ctx, alloc_id: int, *, lock: bool = False) -> Allocation:
    """The allocation if the caller's tenant may see it; the same 404 otherwise."""
    a = store.get(s, alloc_id, for_update=lock)
    if a is None:
        raise NotFound.of("allocation", alloc_id)
    authorize(ctx.caller(), ctx.action, Target("allocation", str(alloc_id), tenant=a.tenant.name))
    return a


# --- create -------------------------------------------------------------------------------------
def _normalise(body: AllocationCreate, tenant: str) -> dict[str, Any]:
    """The request as stored: isolation resolved (exclusive for whole devices, timeslice for fractions)."""
    if body.gpus == 0 and "gpu_milli" in body.model_fields_set and body.gpu_milli != 1000:
        raise Invalid("gpu_milli: given without any device (gpus is 0)", "gpu_milli")
    if body.exclusive and body.isolation not in (None, "exclusive", "mig"):
        raise Invalid(f"isolation: '{body.isolation}' contradicts exclusive=true", "isolation")
    if body.mig is not None and body.isolation not in (None, "mig"):
        raise Invalid(f"isolation: '{body.isolation}' contradicts mig={body.mig!r}", "isolation")
    if body.ports and body.image is None:
        raise Invalid("ports: published ports need a container (give image)", "ports")
    if body.ports and body.command is None:
        raise Invalid("ports: published ports need a job (give command)", "ports")
    if body.image is not None and body.command is None:
        raise Invalid("image: a container needs a command to run in it", "image")
    try:
        time_limit = None if body.time_limit is None else parse_duration_s(body.time_limit, "time_limit")
    except InvalidInput as e:
        raise Invalid(f"{e.where}: {e.message}", e.where) from e
    if (body.mig is not None or body.isolation == "mig") and "gpus" not in body.model_fields_set:
        body = body.model_copy(update={"gpus": 1})  # a MIG instance is one device
    fractional = body.gpus == 1 and body.gpu_milli < 1000
    if body.mig is not None:
        isolation = "mig"
    elif body.isolation is not None:
        isolation = body.isolation
    elif body.exclusive:
        isolation = "exclusive"
    else:
        isolation = "timeslice" if fractional or body.gpus == 0 else "exclusive"
    exclusive = (
        body.exclusive
        or body.isolation in ("exclusive", "mig")
        or (isolation == "exclusive" and body.gpus > 0)
    )
    return {
        "name": body.name,
        "tenant": tenant,
        "gpus": body.gpus,
        "gpu_milli": body.gpu_milli,
        "gpu_memory_mib": body.gpu_memory_mib,
        "cpu_milli": body.cpu_milli,
        "memory_mib": body.memory_mib,
        "models": sorted(set(body.models)) if body.models else None,
        "vendors": sorted(set(body.vendors)) if body.vendors else None,
        "min_gpu_memory_mib": body.min_gpu_memory_mib,
        "stacks": dict(sorted(body.stacks.items())) if body.stacks else None,
        "job_type": body.job_type,
        "exclusive": exclusive,
        "isolation": isolation,
        "gang_nodes": body.gang_nodes,
        "priority": body.priority,
        "command": body.command,
        "env": body.env,
        "restartable": body.restartable,
        "image": body.image,
        "ports": sorted(set(body.ports)) if body.ports else None,
        "mig": body.mig,
        "node_selector": dict(sorted(body.node_selector.items())) if body.node_selector else None,
        "tolerations": sorted(set(body.tolerations)) if body.tolerations else None,
        "time_limit": time_limit,
        "colocate": body.colocate,
        "code": body.code,
        "stdin": body.stdin,
        "secrets": secret_logic.stored_uses(body.secrets, body.env),  # names only
    } | job_control.stored(body)


def _load_shape(ctx: Ctx) -> tuple[scheduling.Snapshot, dict[str, int], dict[str, RequestDefaults]]:
    cols = (Tenant.name, Tenant.id, *request_defaults.COLUMNS)
    with ctx.db.read() as s:
        snap = scheduling.load_snapshot(s, ctx.settings, live=False)
        rows = s.execute(select(*cols)).all()
    ids = {r.name: r.id for r in rows}
    defaults = {r.name: request_defaults.resolve(ctx.settings, *r[2:]) for r in rows}
    return snap, ids, defaults


def _fit_key(core: Request) -> tuple[Any, ...]:
    return (
        core.gpu_count,
        core.gpu_milli,
        core.gpu_memory_mib,
        core.cpu_milli,
        core.memory_mib,
        core.models,
        core.vendors,
        core.min_gpu_memory_mib,
        core.sharing,
        core.gang_nodes,
        core.tier,
        core.mig_profile,
    )


def _refused_field(snap: scheduling.Snapshot, core: Request) -> str:
    """The field that keeps a request off every node: the first whose relaxing lets it fit."""
    if core.gpu_count == 0:
        return "cpu_milli"
    relaxed: list[tuple[str, Request]] = []
    if core.tier == Isolation.MIG:
        whole = replace(core, mig_profile=None, isolation=None, sharing=Sharing.SHARED, gpu_milli=1000)
        relaxed.append(("mig" if core.mig_profile else "isolation", whole))
    if core.gpu_memory_mib:
        relaxed.append(("gpu_memory_mib", replace(core, gpu_memory_mib=None)))
    if core.models:
        relaxed.append(("models", replace(core, models=None)))
    if core.vendors is not None:
        relaxed.append(("vendors", replace(core, vendors=None)))
    if core.min_gpu_memory_mib:
        relaxed.append(("min_gpu_memory_mib", replace(core, min_gpu_memory_mib=0)))
    if core.tier in (Isolation.MPS, Isolation.TIMESLICE):  # devices that cannot enforce the tier
        relaxed.append(("isolation", replace(core, isolation=Isolation.EXCLUSIVE, gpu_milli=1000)))
    for field, req in relaxed:
        if scheduling.never_fits(snap, req) is None:
            return field
    return "gpus"


def _refusal(shape: Shape, core: Request, tenant: str) -> tuple[str, str] | None:
    """(message, field) when the request alone breaks its tenant's limit or can never fit."""
    quota = shape.snapshot.quotas.get(tenant, {})
    too_big = scheduling.over_limit(Counter(), scheduling.estimate(core), quota)
    if too_big is not None:
        return f"the request alone exceeds tenant {tenant}'s {too_big}", "tenant"
    key = _fit_key(core)
    if key in shape.fits:
        never = shape.fits[key]
    else:
        never = scheduling.never_fits(shape.snapshot, core)
        ShapeCache.remember_fit(shape, key, never)
    if never is not None:
        return never, _refused_field(shape.snapshot, core)
    return None


# Refusals the CPU and memory defaults play no part in (the hint about them would mislead).
_NOT_THE_DEFAULTS = frozenset(
    {"models", "vendors", "min_gpu_memory_mib", "mig", "isolation", "gpu_memory_mib", "time_limit", "array"}
)


def _defaulted(
    shape: Shape, req: dict[str, Any], tenant: str, array_size: int = 0
) -> tuple[dict[str, Any], tuple[str, str] | None]:
    """The request with its tenant's defaults where it names no CPU or memory, and why it is
    refused (None: it is not)."""
    defaults = shape.defaults[tenant]
    req, filled = request_defaults.fill(req, defaults)
    try:
        core = scheduling.to_core(req)
    except InvalidInput as e:
        raise Invalid(f"{e.where}: {e.message}", e.where) from e
    problem = request_defaults.over_ceiling(req, defaults, tenant, array_size) or _refusal(
        shape, core, tenant
    )
    if problem is not None and filled and problem[1] not in _NOT_THE_DEFAULTS:  # the defaults are not why
        problem = (problem[0] + request_defaults.hint(tenant, defaults, filled), problem[1])
    return req, problem


def _admit(ctx: Ctx, req: dict[str, Any], tenant: str, array_size: int = 0) -> tuple[dict[str, Any], int]:
    """The request as stored (with the tenant's defaults where it names no CPU or memory: booked
    and enforced like any request) and the tenant's id, once it passes admission; 404/422 otherwise.

    Nodes, quotas and defaults come from the process's short-lived shape cache; anything it would
    refuse is checked again against the database first, so a cache never refuses wrongly.
    """
    published.check(req.get("ports"), ctx.settings)  # never a privileged port, nor one the pool gives
    cache = ctx.caches.shape if ctx.caches is not None else ShapeCache(0.0)
    shape = cache.get(lambda: _load_shape(ctx))
    stored, problem = (
        _defaulted(shape, req, tenant, array_size) if tenant in shape.tenant_ids else (req, ("", ""))
    )
    if problem is not None:
        cache.invalidate()
        shape = cache.get(lambda: _load_shape(ctx))
        if tenant not in shape.tenant_ids:
            raise NotFound.of("tenant", tenant, "tenant")
        stored, problem = _defaulted(shape, req, tenant, array_size)
        if problem is not None:
            raise Invalid(*problem)
    return stored, shape.tenant_ids[tenant]


def _array_size(body: AllocationCreate) -> int:
    return len(parse_array(body.array)[0]) if body.array else 0


def admitted(ctx: Ctx, body: AllocationCreate, tenant: str) -> tuple[dict[str, Any], int]:
    """The request as stored and its tenant's id, once it passes every check of POST /allocations
    (for requests the control plane makes itself, such as function workers)."""
    req = _normalise(body, tenant)
    try:
        scheduling.to_core(req)  # a bad field is named before the tenant is looked up
    except InvalidInput as e:
        raise Invalid(f"{e.where}: {e.message}", e.where) from e
    req, tenant_id = _admit(ctx, req, tenant, _array_size(body))
    if req.get("image") is not None:
        with ctx.db.read() as s:
            images.pin(s, ctx.settings, tenant, tenant_id, req)
    if req.get("secrets"):
        with ctx.db.read() as s:
            secret_logic.check_known(s, tenant_id, req, lock=False)
    return req, tenant_id


SECRET_ENV = store.SECRET_ENV  # given to the job by its env, never shown back


def _hide_secrets(env: dict[str, str] | None) -> dict[str, str] | None:
    if not env or SECRET_ENV.isdisjoint(env):
        return env
    return {k: ("(hidden)" if k in SECRET_ENV else v) for k, v in env.items()}


def _hidden(req: dict[str, Any]) -> dict[str, Any]:
    env = req.get("env")
    return req if not env or SECRET_ENV.isdisjoint(env) else dict(req, env=_hide_secrets(env))


def create(ctx: Ctx, body: AllocationCreate, key: str | None, hub: Hub) -> tuple[AllocationOut, bool]:
    """Store a pending allocation (201), or return the one this caller made with `key` (200)."""
    caller = ctx.caller()
    tenant_name = body.tenant or caller.tenant or ""
    if body.tenant is not None:
        authorize(caller, ctx.action, Target("tenant", body.tenant, tenant=body.tenant, field="tenant"))
    req = _normalise(body, tenant_name)
    try:
        scheduling.to_core(req)  # a bad field is named before the tenant is looked up
    except InvalidInput as e:
        raise Invalid(f"{e.where}: {e.message}", e.where) from e
    try:
        req, tenant_id = _admit(ctx, req, tenant_name, _array_size(body))
    except (Invalid, NotFound):
        if key is not None:  # a retry answers with the first one, whatever the pool says now
            with ctx.db.read() as s:
                found = store.by_key(s, caller.name, key)
                if found is not None:
                    return _one(s, found), False
        raise
    try:
        with ctx.db.write() as s:
            now = db_now(s)
            images.pin(s, ctx.settings, tenant_name, tenant_id, req)  # the image id the job will run
            blob_service.claim(s, tenant_id, req, now)  # code and stdin: blobs the tenant holds
            secret_logic.check_known(s, tenant_id, req)  # the secrets it names: the tenant's own
            job_control.check_after(s, tenant_id, req)  # what it waits for: the tenant's own
            row: dict[str, Any] = {
                "name": body.name or "",
                "tenant_id": tenant_id,
                "owner": caller.name,
                "idempotency_key": key,
                "request": req,
                "priority": body.priority,
                "command": body.command,
                "env": body.env,
                "restartable": body.restartable,
            }
            alloc_id = job_control.insert(s, body, row, now)
            req = row["request"]  # a job array's first member: its array and environment set
            record(
                s, ctx, f"allocation:{alloc_id}", tenant=tenant_name, detail={"request": _brief(req)}, now=now
            )
        out = AllocationOut(
            id=alloc_id,
            name=body.name or "",
            tenant=tenant_name,
            owner=caller.name,
            request=RequestOut.model_validate(req),
            command=body.command,
            env=row["env"],
            restartable=body.restartable,
            state="pending",
            reason="submitted",
            attempt=1,
            term=0,
            nodes=[],
            slices=[],
            exit_code=None,
            created_at=now,
            bound_at=None,
            started_at=None,
            ended_at=None,
            events=[EventOut(at=now, state="pending", reason="submitted")],
            **job_control.out_fields(req),
        )
    except IntegrityError:
        if key is None:
            raise
        with ctx.db.read() as s:  # the same key raced in from another request: answer with that one
            found = store.by_key(s, caller.name, key)
            if found is None:
                raise
            return _one(s, found), False
    hub.wake_scheduler()
    return out, True


def _brief(req: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in req.items() if k not in ("env", "command") and v not in (None, False, 0)}


# --- read ---------------------------------------------------------------------------------------
def list_all(
    ctx: Ctx,
    *,
    state: str | None,
    tenant: str | None,
    limit: int,
    events: bool = False,
    array: int | None = None,
) -> Items[AllocationOut]:
    """Newest first; each one's history only when asked (`events`): a list of many rows is read in
    one query, without reading every row's events."""
    scope = authorize(ctx.caller(), ctx.action)
    if scope.tenant is not None:
        if tenant is not None and tenant != scope.tenant:
            return Items[AllocationOut](items=[])
        tenant = scope.tenant
    with ctx.db.read() as s:
        rows = store.query(s, tenant=tenant, state=state, limit=limit, array=array)
        history = store.events_of(s, [r.id for r in rows]) if events else {}
    return Items[AllocationOut](
        items=[_out(r, history[r.id] if events else None, tenant=r.tenant_name) for r in rows]
    )


def get(ctx: Ctx, alloc_id: int) -> AllocationOut:
    """The read behind every client's wait: plain queries, no ORM objects."""
    with ctx.db.read() as s:
        found = store.read_one(s, alloc_id)
    if found is None:
        raise NotFound.of("allocation", alloc_id)
    row, events = found
    authorize(ctx.caller(), ctx.action, Target("allocation", str(alloc_id), tenant=row.tenant_name))
    return _out(row, events, tenant=row.tenant_name)


@dataclass(frozen=True)
class _Seen:
    id: int
    state: AllocationState
    reason: str
    tenant: str
    request: dict[str, Any]
    nodes: list[str]
    slices: int


def explain(ctx: Ctx, alloc_id: int) -> ExplainOut:
    """Why it waits (filters counted over nodes, quota), where it runs, or why it ended."""
    with ctx.db.read() as s:
        row = _visible(s, ctx, alloc_id)
        a = _Seen(
            row.id,
            row.state,
            row.reason,
            row.tenant.name,
            dict(row.request),
            list(row.nodes),
            len(row.slices),
        )
        holding = reclaim.holding_notes(dict(row.request), row.bound_at, row.reason, db_now(s))
        snap = scheduling.load_snapshot(s, ctx.settings)
    world, _running, _stops = scheduling.build_world(snap)
    core = scheduling.stored_core(a.request)
    tenant = a.tenant
    used = world.usage.get(tenant, Counter())
    quota = snap.quotas.get(tenant, {})
    ask = scheduling.estimate(core)
    quota_doc: dict[str, Any] = {}
    for key in sorted(set(quota) | {k for k, v in ask.items() if v} | {k for k, v in used.items() if v}):
        model, res = key
        g, lim = quota.get(key, (None, None))
        entry = {"used": used[key], "request": ask[key], "guaranteed": g, "limit": lim}
        if model:
            quota_doc.setdefault("models", {}).setdefault(model, {})[res] = entry
        else:
            quota_doc[res] = entry
    counts: dict[str, int] = {}
    notes: list[str] = []
    position: int | None = None
    if a.state == "pending":
        reasons = world.reasons(core)
        counts, notes = dict(reasons.counts.most_common()), list(reasons.notes)
        refused = scheduling.over_limit(used, ask, quota)
        if refused is not None:
            summary = refused
        elif about_reservation(a.reason) or held_reason(a.reason):  # reservations, dependencies, arrays
            summary = a.reason
        elif counts or notes:
            summary = str(reasons)
        else:
            summary = (
                a.reason if a.reason not in ("", "submitted") else "fits now: waiting for the next cycle"
            )
        mine = sorted(
            (x for x in snap.live if x.state == "pending" and x.tenant == tenant),
            key=lambda x: (-x.priority, x.id),
        )
        position = next((i + 1 for i, x in enumerate(mine) if x.id == a.id), None)
    elif a.state in store.HOLDING:
        held = f"{a.slices} device slice{'s' if a.slices != 1 else ''}" if a.slices else "no devices"
        summary = f"{a.state} on {', '.join(dict.fromkeys(a.nodes)) or 'no node'} ({held})"
        summary = "; ".join([summary, *holding])  # time left, idle warning
    else:
        summary = f"{a.state}: {a.reason}"
    return ExplainOut(
        state=a.state,
        summary=summary,
        reasons=ReasonsOut(counts=counts, notes=notes),
        quota=quota_doc,
        queue_position=position,
    )


# --- release / cancel ---------------------------------------------------------------------------
def _end(
    ctx: Ctx, alloc_id: int, hub: Hub, *, state: AllocationState, allowed: tuple[str, ...]
) -> AllocationOut:
    caller = ctx.caller()
    reason = f"{state} by {caller.actor}"
    with ctx.db.write() as s:  # a few statements under the write lock; the answer is read after
        head = store.lock_head(s, alloc_id)
        if head is None:
            raise NotFound.of("allocation", alloc_id)
        authorize(caller, ctx.action, Target("allocation", str(alloc_id), tenant=head.tenant))
        if head.state not in allowed:
            verb = "released" if state == "released" else "cancelled"
            raise Conflict(
                f"allocation {alloc_id} is {head.state}: only {'/'.join(allowed)} ones can be {verb}"
            )
        now = db_now(s)
        store.end(s, head, state, reason, now)
        record(s, ctx, f"allocation:{alloc_id}", tenant=head.tenant, detail={"nodes": head.nodes}, now=now)
    hub.notify(*topics.nodes(head.nodes), *topics.ended([alloc_id]))
    hub.wake_scheduler()
    return get(ctx, alloc_id)


def release(ctx: Ctx, alloc_id: int, hub: Hub) -> AllocationOut:
    return _end(ctx, alloc_id, hub, state="released", allowed=store.HOLDING)


def cancel(ctx: Ctx, alloc_id: int, hub: Hub) -> AllocationOut:
    return _end(ctx, alloc_id, hub, state="cancelled", allowed=store.LIVE)


def read_log(ctx: Ctx, alloc_id: int, rank: int, offsets: dict[str, int]) -> LogsOut:
    """Both streams of one gang member from their offsets, in one read (one request per poll)."""
    with ctx.db.read() as s:
        a = _visible(s, ctx, alloc_id)
        ranks = int(a.request.get("gang_nodes") or 1)
        if rank >= ranks:
            raise Invalid(
                f"rank: allocation {alloc_id} has {ranks} member{'s' if ranks > 1 else ''}: "
                f"rank {rank} is not one (ranks 0..{ranks - 1})",
                "rank",
            )
        streams: dict[str, StreamOut] = {}
        drained = True
        for stream, offset in offsets.items():
            data, nxt = logs.read_log(s, alloc_id, rank, stream, offset, MAX_LOG_READ)
            nxt = max(nxt, offset)
            streams[stream] = StreamOut(data=data, next=nxt)
            drained = drained and nxt >= logs.log_length(s, alloc_id, rank, stream)
        return LogsOut(
            stdout=streams["stdout"],
            stderr=streams["stderr"],
            rank=rank,
            ranks=ranks,
            attempt=a.attempt,
            state=a.state,
            exit_code=a.exit_code,
            reason=a.reason,
            ended=a.state in store.ENDED and drained,
        )
