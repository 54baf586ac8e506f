"""The node agents' side of allocations: the jobs a node should run, its process reports, job output.

Kept apart from the users' side (allocations.py) because every call here acts with a node credential
and must stay within what that node holds: a report about an allocation the node does not hold is
answered as stale, and output is accepted only for the current attempt on a node that runs it.
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from computepool.server import topics
from computepool.server.context import Ctx
from computepool.server.errors import Conflict, Forbidden, NotFound
from computepool.server.hub import Hub
from computepool.server.logic import blobs as blob_service
from computepool.server.logic import gangs, job_control
from computepool.server.logic import secrets as secret_logic
from computepool.server.logic.audit import record
from computepool.server.logic.report_times import reported_start
from computepool.server.policy import Target, authorize
from computepool.store import agent_rows, lease, logs
from computepool.store import allocations as store
from computepool.store import scheduling as sql
from computepool.store.db import db_now
from computepool.store.models import Allocation, Node
from computepool.wire.allocation_out import (
    Assignment,
    Assignments,
    LogAppended,
    LogChunk,
    Report,
    Reports,
    ReportsOut,
    SliceOut,
    StaleOut,
)

_NODE_T = Node.__table__
_NODE_EXISTS = select(_NODE_T.c.id).where(_NODE_T.c.name == bindparam("name"))


def _node(s: Session, ctx: Ctx, name: str) -> None:
    """The caller may act for node `name`, and it exists (its id alone: every report and
    assignments read asks, and the whole node with its devices is two ORM queries)."""
    authorize(ctx.caller(), ctx.action, Target("node", name, node=name))
    if s.connection().execute(_NODE_EXISTS, {"name": name}).first() is None:
        raise NotFound.of("node", name)


def assignments(ctx: Ctx, name: str) -> Assignments:
    """The jobs this node should run now: bound or active allocations with a command."""
    gang_ports = (ctx.settings.gang_port_min, ctx.settings.gang_port_max)
    with ctx.db.read() as s:
        _node(s, ctx, name)
        held = agent_rows.held_jobs(s, name)
        envs = secret_logic.job_envs(s, ctx.settings, held)  # secrets' values: only here, for the node
        default_pids = ctx.settings.default_pids_max
        items = [
            Assignment(
                allocation_id=a.id,
                attempt=a.attempt,
                term=a.term,
                tenant=a.tenant_name,
                slices=[SliceOut.model_validate(sl) for sl in a.slices if sl["node"] == name],
                command=list(a.command),
                env=envs[a.id],
                isolation=a.request["isolation"],
                cpu_milli=int(a.request["cpu_milli"]),
                memory_mib=int(a.request["memory_mib"]),
                pids_max=a.max_pids or default_pids,
                restartable=a.restartable,
                image=a.request.get("image"),
                image_digest=a.request.get("image_digest"),
                ports=a.request.get("ports"),
                gang=gangs.gang_of(a, name, gang_ports),
                code=a.request.get("code"),
                stdin=a.request.get("stdin"),
                service_port=a.service_port,
                private_network=a.coop_role == "rpc",
            )
            for a in held
            if a.id in envs and not gangs.awaits_rank0(a, name)
        ]
        term = lease.current_term(s)
        files = blob_service.pending_for(s, name)
    seen = [i.model_dump(mode="json") for i in items] + [f.model_dump(mode="json") for f in files]
    digest = hashlib.sha256(json.dumps(seen, sort_keys=True).encode())
    return Assignments(version=int(digest.hexdigest()[:15], 16), term=term, assignments=items, files=files)


def report(ctx: Ctx, name: str, body: Reports, hub: Hub) -> ReportsOut:
    """Apply the agent's process states; answer the attempts it should stop (stale).

    A one-node job's start and clean exit (almost every report) are written as plain statements
    from plain rows (`_plain`); anything else (gangs, failures, losses, services, image digests,
    an allocation reported twice) goes through the ORM as before."""
    accepted: list[int] = []
    stale: list[StaleOut] = []
    changes: list[dict[str, Any]] = []
    resolved: list[dict[str, Any]] = []  # allowed-registry images: the id the node ran
    touched: set[str] = set()
    moved = False  # a change the scheduler may decide differently on (all but plain starts)
    with ctx.db.write() as s:
        _node(s, ctx, name)
        now = db_now(s)
        ids = [r.allocation_id for r in body.reports]
        rows = agent_rows.lock_reported(s, sorted(set(ids)))  # one query
        once = len(set(ids)) == len(ids)
        plain = {r.allocation_id for r in body.reports if once and _plain(rows.get(r.allocation_id), r, name)}
        orm = sql.lock_allocations(s, sorted({i for i in rows if i not in plain}))
        for r in body.reports:
            a: Allocation | agent_rows.Reported | None = orm.get(r.allocation_id)
            if a is None:
                a = rows.get(r.allocation_id)
            why = _stale_why(a, r, name)
            if why is not None or a is None:
                stale.append(StaleOut(allocation_id=r.allocation_id, attempt=r.attempt, reason=why or ""))
                continue
            accepted.append(a.id)
            before = a.state
            if isinstance(a, agent_rows.Reported):  # plain: a start or a clean exit, one node
                if r.state == "running" and before == "bound":
                    agent_rows.start(s, a, f"started on {name}", reported_start(a, r.started_at, now), now)
                    changes.append({"allocation": a.id, "from": before, "to": "active"})
                elif r.state == "exited":
                    store.end(s, a.head(), "released", "exited 0", now, exit_code=0)
                    touched.update(a.nodes)
                    moved = True
                    changes.append({"allocation": a.id, "from": before, "to": "released"})
                continue
            digest = a.request.get("image_digest")
            _apply(s, a, r, name, now, resolved, touched)
            if a.state != before:
                if not _plain_start(a, before, digest):
                    touched.update(a.nodes)
                    moved = True
                changes.append({"allocation": a.id, "from": before, "to": a.state})
        if changes or resolved:
            detail = {"changes": changes} | ({"images": resolved} if resolved else {})
            record(s, ctx, f"node:{name}", detail=detail)
    if changes:
        hub.notify(*topics.nodes(touched), *topics.ended(c["allocation"] for c in changes))
    if moved:
        hub.wake_scheduler()
    return ReportsOut(accepted=accepted, stale=stale)


def _stale_why(a: Allocation | agent_rows.Reported | None, r: Report, name: str) -> str | None:
    """Why a report is stale (the node should stop that attempt), or None."""
    if a is None or a.command is None or name not in a.nodes:
        return f"allocation {r.allocation_id} is not assigned to node {name}"
    if a.attempt != r.attempt:
        return f"attempt {r.attempt} is not current (now {a.attempt})"
    if a.state not in store.HOLDING:
        return f"allocation {a.id} is {a.state}"
    return None


def _plain(a: agent_rows.Reported | None, r: Report, name: str) -> bool:
    """A current report that needs no ORM object: a one-node job (no service) that starts without
    resolving an image digest, or exits 0; or any that runs on, where nothing changes."""
    if a is None or _stale_why(a, r, name) is not None or gangs.is_gang(a) or a.service_id is not None:
        return False
    if r.state == "running":
        return not (r.image_digest and a.request.get("image") and not a.request.get("image_digest"))
    return r.state == "exited" and r.exit_code == 0


def _apply(
    s: Session,
    a: Allocation,
    r: Report,
    name: str,
    now: datetime,
    resolved: list[dict[str, Any]],
    touched: set[str],
) -> None:
    """One current report on its ORM row: the general case."""
    before = a.state
    if gangs.is_gang(a):  # members of several nodes: the gang moves as a whole (gangs.py)
        members = list(a.nodes)  # a requeue clears them; all must hear of it
        gangs.apply_report(s, a, name, r, now)
        if a.state != before:
            touched.update(members)
    elif r.state == "running":
        if r.image_digest and a.request.get("image") and not a.request.get("image_digest"):
            a.request = {**a.request, "image_digest": r.image_digest}  # resolved once, kept
            resolved.append({"allocation": a.id, "image_digest": r.image_digest})
        if a.state == "bound":
            a.started_at = reported_start(a, r.started_at, now)
            store.transition(s, a, "active", f"started on {name}", now)
            if a.service_id is not None:  # a new attempt: what an earlier one found is void
                a.replica_listener = r.listener
        if r.listener is not None and a.service_id is not None:
            a.replica_listener = r.listener
    elif r.state == "exited" and r.exit_code == 0:
        a.exit_code = 0
        store.transition(s, a, "released", "exited 0", now)
    elif r.state in ("exited", "failed"):
        a.exit_code = r.exit_code
        what = f"exited {r.exit_code}" if r.state == "exited" else "failed"
        what = f"{what} on {name}" + (f": {r.reason}" if r.reason else "")
        delay = job_control.retry_delay(a.request, r.exit_code if r.state == "exited" else None)
        if delay is not None:  # the job's own failure, and it may run again
            touched.update(a.nodes)
            job_control.retry(s, a, what, delay, now)
        else:
            store.transition(s, a, "failed", what, now)
    else:  # lost: the agent no longer knows the process
        lost = f"process lost on {name}" + (f": {r.reason}" if r.reason else "")
        touched.update(a.nodes)
        if a.restartable:
            store.requeue(s, a, f"{lost}; requeued as attempt {a.attempt + 1}", now)
        else:
            store.transition(s, a, "failed", lost, now)


def _plain_start(a: Allocation, before: str, digest: str | None) -> bool:
    """A one-node job's bound → active: what its node is assigned stays the same (no state is in
    an assignment; the image digest is, when this report resolved it), and no scheduling decision
    tells bound from active on a node that reports, so neither the node's long-poll nor the
    scheduler is woken for it (its state's waiters are)."""
    return (
        before == "bound"
        and a.state == "active"
        and not gangs.is_gang(a)
        and a.request.get("image_digest") == digest
    )


def append_log(ctx: Ctx, alloc_id: int, body: LogChunk, hub: Hub) -> LogAppended:
    """Add a chunk of output; resent chunks (offset below the stream's end) are trimmed, not doubled."""
    principal = ctx.caller()
    with ctx.db.write() as s:
        a = store.get(s, alloc_id)
        if a is None or principal.node not in a.nodes:
            raise Forbidden(f"allocation '{alloc_id}' does not run on node '{principal.node}'")
        if body.attempt != a.attempt:
            raise Conflict(f"attempt {body.attempt} is not current (now {a.attempt})", "attempt")
        rank = list(dict.fromkeys(a.nodes)).index(principal.node)  # members in rank order (rank 0 first)
        end = logs.stream_length(s, alloc_id, body.attempt, body.stream, rank)
        if body.offset > end:
            raise Conflict(f"offset {body.offset} is past the end of {body.stream} ({end})", "offset")
        raw = body.data.encode()
        data = raw[end - body.offset :].decode(errors="ignore") if end > body.offset else body.data
        if data:
            cap = ctx.settings.log_max_mib << 20  # the oldest of the attempt's stream go past it
            logs.append_log(s, alloc_id, body.attempt, body.stream, end, data, rank, cap=cap)
    if data:
        hub.notify(topics.logs(alloc_id))
    return LogAppended(next_offset=end + len(data.encode()))
