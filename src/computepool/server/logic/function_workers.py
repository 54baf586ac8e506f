"""Function workers: starting them, their routes, and settling those whose allocation ended.

A worker is an ordinary allocation of the function's tenant and owner, named fn-<name>, running
the registered request's command with three more variables: CPOOL_FUNCTION_ID,
CPOOL_WORKER_TOKEN (a bearer token minted for this allocation, stored hashed, valid only while
the allocation is bound or active, good for nothing but /worker/next, /worker/calls and
/worker/output of its own function) and CPOOL_KEEP_WARM_S. Workers are started when calls wait,
none is idle and fewer than max_workers are live; a worker exits by itself after keep_warm_s
without a call (0: after one call, the server answers `stop`). A warm worker claims its share of
the waiting calls at once (`share`) and hands their results in together, one transaction a batch.

The sweep (`Sweeper`, once a second in every replica) settles workers whose allocation ended:
every call it had claimed and not handed back fails with "worker ended: <state> (<reason>)".
When two workers in a row end failed before claiming any call (the command is missing, the image
cannot be pulled …), the function's waiting calls fail with that reason instead of waiting
forever; the count starts over, so later calls try a fresh worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from computepool.core.allocation import HOLDING, LIVE
from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.credentials import new_secret
from computepool.server.errors import Conflict, Forbidden, Invalid
from computepool.server.hub import Hub
from computepool.server.logic import blobs as blob_service
from computepool.server.logic.function_handoff import Handoff, Watch
from computepool.server.loops import Periodic
from computepool.server.policy import Target, authorize
from computepool.store import allocations as alloc_store
from computepool.store import functions as store
from computepool.store.db import Database, db_now
from computepool.wire.functions import ClaimOut, Done, NextCall, NextOut, OutputIn, OutputOut

log = logging.getLogger("computepool.server")
FAILURES_BEFORE_GIVING_UP = 2
SWEEP_EVERY_S = 1.0
CALL_RETENTION_S = 24 * 3600.0  # ended calls (and their results) are kept this long
FORGET_EVERY_S = 60.0


def fn_key(fid: int) -> str:
    """Hub key of a function's call queue (its waiting workers)."""
    return f"fn:{fid}"


def results_key(fid: int) -> str:
    """Hub key of a function's results and output (its waiting callers)."""
    return f"fnres:{fid}"


# --- starting and stopping workers --------------------------------------------------------------
def ensure_workers(s: Session, fn: store.FunctionRow, now: datetime) -> int:
    """Start the workers the function's waiting calls need (caller holds the function's row lock)."""
    if fn.deleted:
        return 0
    live, idle = store.worker_load(s, fn.id)
    need = min(fn.max_workers - live, store.pending_count(s, fn.id) - idle)
    if need <= 0:
        return 0
    try:  # the code archive must still be the tenant's (blobs expire unused)
        blob_service.claim(s, fn.tenant_id, fn.request, now)
    except Invalid as e:
        store.fail_pending(s, fn.id, f"worker not started: request.{e.message}", now)
        return 0
    for _ in range(need):
        _start_worker(s, fn, now)
    return need


def _start_worker(s: Session, fn: store.FunctionRow, now: datetime) -> int:
    secret = new_secret()
    env = dict(fn.request.get("env") or {})
    env.update(
        CPOOL_FUNCTION_ID=str(fn.id),
        CPOOL_WORKER_TOKEN=secret.token,
        CPOOL_KEEP_WARM_S=str(fn.keep_warm_s),
    )
    req: dict[str, Any] = dict(fn.request, env=env)
    alloc_id = alloc_store.insert_pending(
        s,
        {
            "name": req.get("name") or f"fn-{fn.name}"[:63],
            "tenant_id": fn.tenant_id,
            "owner": fn.owner,
            "idempotency_key": None,
            "request": req,
            "priority": int(req.get("priority") or 0),
            "command": req.get("command"),
            "env": env,
            "restartable": False,
        },
        now,
    )
    store.add_worker(s, alloc_id, fn.id, secret.id, secret.secret_hash, now)
    return alloc_id


def cancel_workers(s: Session, alloc_ids: Sequence[int], why: str, now: datetime) -> list[str]:
    """Cancel these worker allocations (those still live); the nodes to wake."""
    nodes: list[str] = []
    for alloc_id in alloc_ids:
        head = alloc_store.lock_head(s, alloc_id)
        if head is None or head.state not in LIVE:
            continue
        alloc_store.end(s, head, "cancelled", why, now)
        nodes.extend(head.nodes)
    return nodes


# --- the worker's routes ------------------------------------------------------------------------
def _check(ctx: Ctx, s: Session) -> tuple[int, int, store.WorkerHead]:
    """(worker allocation, function, their state) of the calling worker, while its allocation holds."""
    p = ctx.caller()
    assert p.worker is not None and p.function is not None
    authorize(p, ctx.action, Target("function", str(p.function), tenant=p.tenant))
    head = store.worker_head(s, p.worker)
    if head is None or head.state not in HOLDING:
        state = head.state if head is not None else "gone"
        raise Forbidden(f"worker allocation {p.worker} is {state}: its token is no longer valid")
    return p.worker, p.function, head


def _not_claimed(s: Session, cid: int, worker: int, field: str) -> None:
    """Why a result or output for `cid` was not taken: 409 unless the call ended meanwhile (cancelled)."""
    found = store.call_of(s, cid)
    if found is None or found[1] != worker:
        raise Conflict(f"call {cid} was not claimed by this worker", field)


def share(pending: int, max_workers: int, max_calls: int) -> int:
    """Calls one claim takes: its share of those waiting (the last ones are spread over the
    function's workers rather than queued behind one), at least 1, at most `max_calls`."""
    return max(1, min(max_calls, pending // max(1, max_workers)))


def _hand_in_and_claim(
    s: Session,
    worker: int,
    fid: int,
    head: store.WorkerHead,
    done: Sequence[Done],
    max_calls: int,
    now: datetime,
) -> tuple[list[tuple[int, str]], bool, int]:
    """Record the results handed in (calls this worker claimed), then claim up to `max_calls`;
    (calls claimed, stop, workers started)."""
    retiring = bool(done) and head.keep_warm_s == 0 and not head.deleted
    # the function's row before the call's, as cancel and delete take them (no lock-order deadlock)
    fn = store.get_function(s, fid, lock=True) if retiring else None
    results = [(d.id, d.ok, d.result, d.traceback) for d in done]
    if results and store.finish_many(s, worker, results, now) < len(results):
        for i, d in enumerate(done):  # which one was not this worker's (or ended meanwhile)
            if not store.finished_by(s, d.id, worker):
                _not_claimed(s, d.id, worker, "done.id" if len(done) == 1 else f"done[{i}].id")
    if head.deleted or retiring:
        started = 0
        if fn is not None:
            # a one-call worker is done: it no longer counts as live or idle, so the calls
            # waiting get a worker of their own now rather than at the next sweep; and it
            # delivered, so the count of workers failing in a row starts again
            store.settle_worker(s, worker)
            if fn.failures:
                store.set_failures(s, fid, 0, "")
            started = ensure_workers(s, fn, now)
        return [], True, started
    if head.keep_warm_s == 0:
        max_calls = min(max_calls, 1)  # one call per worker
    k = max_calls
    if k > 1:
        pending = store.pending_count(s, fid)
        if pending == 0:
            return [], False, 0
        k = share(pending, head.max_workers, max_calls)
    return store.claim_many(s, fid, worker, k, now), False, 0


def next_call(ctx: Ctx, done: Done | None, hub: Hub) -> NextOut:
    """Record the result handed in (a call this worker claimed), then claim the oldest waiting call."""
    out = claim_calls(ctx, [done] if done is not None else [], 1, hub)
    got = out.calls[0] if out.calls else None
    return NextOut(call=got, stop=out.stop)


def claim_calls(
    ctx: Ctx,
    done: Sequence[Done],
    max_calls: int,
    hub: Hub,
    holding: Sequence[int] = (),
    handoff: Handoff | None = None,
) -> ClaimOut:
    """Record the results handed in, in one transaction, then claim up to `max_calls` (their share
    of the calls waiting): a worker serving many short calls makes one request per batch. Of the
    calls it still `holding`, those cancelled meanwhile are named to drop. The submissions waiting
    on this replica for calls handed in get their rows, read in this transaction, once it commits."""
    drop: list[int] = []
    watches: list[Watch] = []
    rows: list[store.CallRow] = []
    with ctx.db.write() as s:
        worker, fid, head = _check(ctx, s)
        got, stop, started = _hand_in_and_claim(s, worker, fid, head, done, max_calls, db_now(s))
        if holding:
            kept = set(store.held_by(s, worker, holding))
            drop = [i for i in holding if i not in kept]
        watches = handoff.watched([d.id for d in done]) if handoff is not None and done else []
        if watches:
            rows = store.results(s, fid, [w.call for w in watches])
    by_id = {r.id: r for r in rows}
    for w in watches:
        if w.call in by_id:
            w.answer(by_id[w.call])
    if done:
        hub.notify(topics.fn_results(fid))
    if started:
        hub.wake_scheduler()
    return ClaimOut(calls=[NextCall(id=i, args=a) for i, a in got], stop=stop, drop=drop)


def claim(ctx: Ctx, hub: Hub, max_calls: int = 1) -> ClaimOut:
    """A waiting worker's re-check: read first, and take the write lock only when a call waits."""
    p = ctx.caller()
    assert p.function is not None
    with ctx.db.read() as s:
        _, _, head = _check(ctx, s)
        if head.deleted:
            return ClaimOut(calls=[], stop=True)
        if store.pending_count(s, p.function) == 0:
            return ClaimOut(calls=[], stop=False)
    return claim_calls(ctx, [], max_calls, hub)


def worker_of(ctx: Ctx) -> tuple[int, int]:
    """(worker allocation, function) of the calling worker, as its token says."""
    p = ctx.caller()
    assert p.worker is not None and p.function is not None
    return p.worker, p.function


def output(ctx: Ctx, body: OutputIn, hub: Hub) -> OutputOut:
    with ctx.db.write() as s:
        worker, fid, _ = _check(ctx, s)
        accepted = store.append_output(s, body.id, worker, body.data, body.stream)
        if not accepted:
            _not_claimed(s, body.id, worker, "id")
    if body.data and accepted:
        hub.notify(topics.fn_results(fid))
    return OutputOut(accepted=accepted)


# --- the sweep ----------------------------------------------------------------------------------
def sweep(db: Database) -> set[int]:
    """Settle ended workers and start the workers waiting calls need; the functions touched."""
    touched: set[int] = set()
    with db.read() as s:
        ended = store.ended_workers(s)
        waiting = store.functions_waiting(s)
    for w in ended:
        with db.write() as s:
            if not store.settle_worker(s, w.allocation_id):
                continue  # another replica settled it
            now = db_now(s)
            why = f"worker ended: {w.state}" + (f" ({w.reason})" if w.reason else "")
            store.fail_calls_of_worker(s, w.allocation_id, why, now)
            fn = store.get_function(s, w.function_id, lock=True)
            if fn is not None:
                if w.claimed or w.state != "failed":
                    if fn.failures:
                        store.set_failures(s, fn.id, 0, "")
                elif fn.failures + 1 >= FAILURES_BEFORE_GIVING_UP:
                    n = store.fail_pending(s, fn.id, f"{why}; {fn.failures + 1} workers in a row failed", now)
                    store.set_failures(s, fn.id, 0, why)
                    if n:
                        log.info("function %d: %d waiting calls failed: %s", fn.id, n, why)
                else:
                    store.set_failures(s, fn.id, fn.failures + 1, why)
        touched.add(w.function_id)
    touched |= withdraw_unneeded(db)
    for fid in set(waiting) | touched:
        with db.read() as s:
            fn = store.get_function(s, fid)
            if fn is None or fn.deleted:
                continue
            live, idle = store.worker_load(s, fid)
            if min(fn.max_workers - live, store.pending_count(s, fid) - idle) <= 0:
                continue
        with db.write() as s:
            fn = store.get_function(s, fid, lock=True)
            if fn is not None and ensure_workers(s, fn, db_now(s)):
                touched.add(fid)
    return touched


def withdraw_unneeded(db: Database) -> set[int]:
    """Cancel worker allocations still pending of functions with no call waiting (a map whose calls
    were all taken by the warm workers): started later, they would hold devices for keep_warm_s
    with nothing to do. Checked again under the function's row lock, which call submission takes,
    so a call that arrives meanwhile keeps its worker."""
    touched: set[int] = set()
    with db.read() as s:
        idle = store.idle_pending_workers(s)
    for fid, alloc_ids in idle.items():
        with db.write() as s:
            fn = store.get_function(s, fid, lock=True)
            if fn is None or store.pending_count(s, fid):
                continue
            now = db_now(s)
            for alloc_id in alloc_ids:
                head = alloc_store.lock_head(s, alloc_id)
                if head is not None and head.state == "pending":  # not bound meanwhile
                    alloc_store.end(s, head, "cancelled", "withdrawn: no call waits for this worker", now)
                    touched.add(fid)
    return touched


def forget(db: Database) -> int:
    """Drop calls that ended more than CALL_RETENTION_S ago; how many went."""
    with db.write() as s:
        return store.forget_ended(s, db_now(s) - timedelta(seconds=CALL_RETENTION_S))


class Sweeper:
    """Ends the calls and workers whose time ran out, once a second, and wakes whom it concerns;
    forgets ended calls past their retention now and then."""

    def __init__(self, db: Database, hub: Hub) -> None:
        self.db = db
        self.hub = hub

    def periodic(self) -> list[Periodic]:
        return [
            Periodic("function-sweep", SWEEP_EVERY_S, self.sweep, quiet=True),
            Periodic("function-forget", FORGET_EVERY_S, lambda: forget(self.db), quiet=True),
        ]

    def sweep(self) -> None:
        touched = sweep(self.db)
        if touched:
            self.hub.notify(*(t for f in touched for t in (topics.fn_results(f), topics.fn_calls(f))))
            self.hub.wake_scheduler()
