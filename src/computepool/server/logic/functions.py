"""Remote Python functions for users: register, list, delete, submit calls, read results, cancel.

A function is a tenant's, seen by its users like allocations (another tenant's answers 404).
Its workers are ordinary allocations of the registered per-worker request; which and when is
in function_workers.py. Registration is idempotent: the same spec from the same tenant answers
the same id, and a deleted function registered again comes back under its old id.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING
from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.errors import Conflict, Invalid, NotFound
from computepool.server.hub import Hub
from computepool.server.logic import allocations, function_workers
from computepool.server.logic import blobs as blob_service
from computepool.server.logic.audit import record
from computepool.server.logic.function_handoff import Handoff, Waiter, Watch
from computepool.server.policy import Target, authorize
from computepool.store import functions as store
from computepool.store.db import db_now
from computepool.wire.common import Items
from computepool.wire.functions import (
    CallIds,
    CallOut,
    CallsIn,
    FunctionCreate,
    FunctionOut,
    ResultsIn,
    ResultsOut,
)

# Results, tracebacks and output one answer carries at most (base64 characters): the rest waits
# for the next poll, so neither the server nor the caller holds a thousand large results at once.
RESULTS_BUDGET_CHARS = 96 << 20


def _out(fn: store.FunctionRow, live: int, pending: int) -> FunctionOut:
    return FunctionOut(
        id=fn.id,
        name=fn.name,
        tenant=fn.tenant,
        owner=fn.owner,
        python=fn.python,
        keep_warm_s=fn.keep_warm_s,
        max_workers=fn.max_workers,
        workers_live=live,
        calls_pending=pending,
    )


def _visible(ctx: Ctx, fn: store.FunctionRow | None, fid: int) -> store.FunctionRow:
    if fn is None or fn.deleted:
        raise NotFound.of("function", fid)
    authorize(ctx.caller(), ctx.action, Target("function", str(fid), tenant=fn.tenant))
    return fn


def _spec_hash(body: FunctionCreate, tenant: str) -> str:
    spec = body.model_dump(mode="json", exclude_none=True)
    spec["request"]["tenant"] = tenant
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _check_python(ctx: Ctx, python: str) -> None:
    with ctx.db.read() as s:
        since = db_now(s) - timedelta(seconds=ctx.settings.suspect_after_s)
        provided = store.pythons_of_ready_nodes(s, since)
    if python in provided:
        return
    offer = (
        "provide " + ", ".join(sorted(provided, key=lambda v: tuple(int(p) for p in v.split("."))))
        if provided
        else "report no Python version (no ready node, or agents too old to say)"
    )
    raise Invalid(f"this function needs Python {python} (the caller's); the pool's nodes {offer}", "python")


def register(ctx: Ctx, body: FunctionCreate) -> tuple[FunctionOut, bool]:
    """Store the function (201) or answer the one this tenant registered with the same spec (200)."""
    caller = ctx.caller()
    req = body.request
    tenant = req.tenant or caller.tenant or ""
    if req.tenant is not None:
        authorize(caller, ctx.action, Target("tenant", req.tenant, tenant=req.tenant, field="request.tenant"))
    if req.command is None:
        raise Invalid("request.command: a worker needs a start command", "request.command")
    if req.gang_nodes != 1:
        raise Invalid("request.gang_nodes: a function's worker runs on one node", "request.gang_nodes")
    _check_python(ctx, body.python)
    selector = dict(req.node_selector or {}) | store.python_labels([body.python])
    worker = req.model_copy(
        update={"name": f"fn-{body.name}"[:63], "node_selector": selector, "restartable": False}
    )
    try:
        stored, tenant_id = allocations.admitted(ctx, worker, tenant)
    except Invalid as e:  # name the field as the caller sent it: inside `request`
        field = f"request.{e.field}" if e.field else "request"
        message = f"request.{e.message}" if e.message.startswith(f"{e.field}:") else e.message
        raise Invalid(message, field) from e
    spec = _spec_hash(body, tenant)
    with ctx.db.write() as s:
        now = db_now(s)
        try:
            blob_service.claim(s, tenant_id, stored, now)  # the code archive: a blob the tenant holds
        except Invalid as e:
            raise Invalid(f"request.{e.message}", f"request.{e.field}") from e
        found = store.by_spec(s, tenant_id, spec)
        if found is not None:
            if found.deleted:
                store.revive(s, found.id)
                record(s, ctx, f"function:{found.id}", tenant=tenant, detail={"revived": True}, now=now)
            live, pending = store.counts(s, [found.id])[found.id]
            return _out(found, live, pending), False
        fid = store.insert_function(
            s,
            {
                "tenant_id": tenant_id,
                "owner": caller.name,
                "name": body.name,
                "spec_hash": spec,
                "request": stored,
                "python": body.python,
                "keep_warm_s": body.keep_warm_s,
                "max_workers": body.max_workers,
                "created_at": now,
            },
        )
        record(s, ctx, f"function:{fid}", tenant=tenant, detail={"name": body.name}, now=now)
        fn = store.get_function(s, fid)
        assert fn is not None
        return _out(fn, 0, 0), True


def list_all(ctx: Ctx) -> Items[FunctionOut]:
    scope = authorize(ctx.caller(), ctx.action)
    with ctx.db.read() as s:
        fns = store.list_functions(s, scope.tenant)
        counts = store.counts(s, [f.id for f in fns])
    return Items[FunctionOut](items=[_out(f, *counts[f.id]) for f in fns])


def get(ctx: Ctx, fid: int) -> FunctionOut:
    with ctx.db.read() as s:
        fn = _visible(ctx, store.get_function(s, fid), fid)
        live, pending = store.counts(s, [fid])[fid]
    return _out(fn, live, pending)


def delete(ctx: Ctx, fid: int, hub: Hub) -> FunctionOut:
    """Cancel its waiting and running calls and its workers; the function is gone from listings."""
    with ctx.db.write() as s:
        fn = _visible(ctx, store.get_function(s, fid, lock=True), fid)
        now = db_now(s)
        store.mark_deleted(s, fid, now)
        store.fail_pending(s, fid, "function deleted", now, state="cancelled")
        store.cancel_running(s, fid, "function deleted", now)
        nodes = function_workers.cancel_workers(s, store.live_worker_ids(s, fid), "function deleted", now)
        record(s, ctx, f"function:{fid}", tenant=fn.tenant, now=now)
    hub.notify(topics.fn_calls(fid), topics.fn_results(fid), *topics.nodes(nodes))
    hub.wake_scheduler()
    return _out(fn, 0, 0)


def submit(
    ctx: Ctx,
    fid: int,
    body: CallsIn,
    hub: Hub,
    handoff: Handoff | None = None,
    watch: Watch | None = None,
) -> CallIds:
    """Queue the calls in one transaction, handing the oldest waiting ones to the workers parked on
    this replica (claimed for them in the same transaction); start workers when none is idle and
    fewer than max live. `watch`: a submission of one call that waits for its outcome here."""
    given: dict[Waiter, list[tuple[int, str]]] = {}
    taken: list[Waiter] = []
    committed = False
    try:
        with ctx.db.write() as s:
            fn = _visible(ctx, store.get_function(s, fid, lock=True), fid)
            now = db_now(s)
            ids = store.calls_of_submission(s, fid, body.key) if body.key else []
            if ids:  # this submission sent again: its calls are stored, and on their way
                return CallIds(ids=ids)
            ids = store.insert_calls(s, fid, fn.tenant_id, [c.args for c in body.calls], now, body.key)
            if watch is not None and handoff is not None and len(ids) == 1:
                handoff.watch(ids[0], watch)
            left = len(ids)
            taken = handoff.take(fid, len(ids)) if handoff is not None else []
            # a worker's share of the waiting calls needs their count, but the one worker a
            # function may have takes all it asks for: None, and whether calls are left over
            # shows in whether it got them all
            pending = store.pending_count(s, fid) if taken and fn.max_workers > 1 else None
            for w in taken:
                if left > 0:
                    got, asked = _hand_over(s, fn, w, pending, now)
                    given[w] = got
                    if pending is not None:
                        pending -= len(got)
                        left = pending
                    elif len(got) < asked:
                        left = 0
            started = function_workers.ensure_workers(s, fn, now) if left > 0 else 0
        committed = True
    finally:
        for w in taken:  # a taken worker is always answered (empty: it reads the queue itself)
            w.answer(given.get(w, []) if committed else [])
    if left > 0:
        hub.notify(topics.fn_calls(fid))
    if started:
        hub.wake_scheduler()
    return CallIds(ids=ids)


def _hand_over(
    s: Session, fn: store.FunctionRow, w: Waiter, pending: int | None, now: datetime
) -> tuple[list[tuple[int, str]], int]:
    """Claim the parked worker's share of the waiting calls for it (`pending`: how many wait, None:
    as many as it takes), if its allocation still holds; (the calls, how many it asked for)."""
    head = store.worker_head(s, w.worker)
    if head is None or head.state not in HOLDING or head.deleted:
        return [], 0
    if head.keep_warm_s == 0:
        k = 1
    elif pending is None:
        k = w.max_calls
    else:
        k = function_workers.share(pending, fn.max_workers, w.max_calls)
    return store.claim_many(s, fn.id, w.worker, k, now), k


def results(ctx: Ctx, fid: int, body: ResultsIn) -> ResultsOut:
    """The calls among `ids` that ended or printed past their offset (possibly none)."""
    wanted = set(body.ids)
    with ctx.db.read() as s:
        _visible(ctx, store.get_function(s, fid), fid)
        if store.count_known(s, fid, list(wanted)) < len(wanted):
            seen = store.known(s, fid, list(wanted))
            missing = next(i for i in body.ids if i not in seen)
            raise NotFound.of("call", missing, "ids")
        read = {i: (body.output_from.get(str(i), 0), body.stderr_from.get(str(i), 0)) for i in wanted}
        rows = store.results(s, fid, list(wanted), with_news=True, budget=RESULTS_BUDGET_CHARS, read=read)
    return ResultsOut(calls=_relevant(rows, body.output_from, body.stderr_from))


def news(ctx: Ctx, fid: int, ids: Sequence[int]) -> ResultsOut:
    """The calls among `ids` (just submitted by this caller: no check) that ended or printed."""
    with ctx.db.read() as s:
        read = dict.fromkeys(ids, (0, 0))
        rows = store.results(s, fid, list(ids), with_news=True, budget=RESULTS_BUDGET_CHARS, read=read)
    return ResultsOut(calls=_relevant(rows, {}, {}))


def outcome(row: store.CallRow) -> list[CallOut]:
    """A call's news as a submission's answer carries it: none while it runs and printed nothing."""
    return _relevant([row], {}, {})


def _relevant(
    rows: Sequence[store.CallRow], output_from: Mapping[str, int], stderr_from: Mapping[str, int]
) -> list[CallOut]:
    out: list[CallOut] = []
    for r in sorted(rows, key=lambda r: r.id):
        start = output_from.get(str(r.id), 0)
        err_start = stderr_from.get(str(r.id), 0)
        ended = r.state in store.ENDED_CALL
        if not ended and len(r.output) <= start and len(r.stderr) <= err_start:
            continue
        out.append(
            CallOut(
                id=r.id,
                state=r.state,
                ok=r.ok,
                result=r.result,
                traceback=r.traceback,
                error=r.error,
                output=r.output[start:],
                output_next=max(len(r.output), start),
                stderr=r.stderr[err_start:],
                stderr_next=max(len(r.stderr), err_start),
            )
        )
    return out


def cancel_call(ctx: Ctx, fid: int, cid: int, hub: Hub) -> CallOut:
    """A waiting call is dropped; a running one ends with its worker allocation, unless that worker
    still holds other calls of a batch: those are not failed for it; the worker drops the call at
    its next hand-in if it has not begun it (its outcome, if it ran, is not kept)."""
    with ctx.db.write() as s:
        fn = _visible(ctx, store.get_function(s, fid, lock=True), fid)
        found = store.call_of(s, cid)
        if found is None or found[2] != fid:
            raise NotFound.of("call", cid)
        state, worker, _ = found
        if state in store.ENDED_CALL:
            raise Conflict(f"call {cid} is {state}: only pending or running calls can be cancelled")
        now = db_now(s)
        why = f"cancelled by {ctx.caller().actor}"
        store.cancel_call(s, cid, now, why)
        alone = worker is not None and not store.held_by(s, worker)
        nodes = function_workers.cancel_workers(s, [worker] if worker and alone else [], why, now)
        record(s, ctx, f"function:{fid}", tenant=fn.tenant, detail={"call": cid, "was": state}, now=now)
        [row] = store.results(s, fid, [cid])
    hub.notify(topics.fn_results(fid), *topics.nodes(nodes))
    if nodes:
        hub.wake_scheduler()
    return _relevant([row], {}, {})[0]
