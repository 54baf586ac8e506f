"""Write one cycle's plan in one transaction, fenced by the scheduler lease's term."""

from __future__ import annotations

from dataclasses import dataclass, field

from computepool.core.allocation import HOLDING
from computepool.server.scheduling import gang_ports as gangs
from computepool.server.scheduling.decide import Plan
from computepool.store import allocations as store
from computepool.store import lease
from computepool.store import scheduling as sql
from computepool.store.db import Database, db_now


class LostLease(Exception):
    """The commit's term is no longer the lease's: another replica schedules now."""


@dataclass
class CommitResult:
    bound: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    unstarted: list[int] = field(default_factory=list)  # pending ones ended: a dependency never met
    nodes: set[str] = field(default_factory=set)


def commit(
    db: Database, plan: Plan, holder: str, term: int, *, gang_ports: tuple[int, int] = gangs.DEFAULT_PORTS
) -> CommitResult:
    """Write the cycle's decisions in one transaction, fenced by the lease term.

    Raises LostLease (writing nothing) when another replica holds the lease or a newer term.
    Decisions about allocations that changed since the snapshot (cancelled, released) are skipped.
    Binds, the bulk of a busy cycle, are written a few statements for all of them.
    A gang bound over several nodes also gets its master port from `gang_ports` and its members.
    """
    res = CommitResult()
    with db.write() as s:
        if not lease.holds_lease(s, holder, term):
            raise LostLease(f"scheduler term {term} is no longer current")
        now = db_now(s)
        rows = sql.lock_allocations(s, [x.id for x in plan.stops])
        for st in plan.stops:
            a = rows.get(st.id)
            if a is None or a.attempt != st.attempt or a.state not in HOLDING:
                continue
            res.nodes.update(a.nodes)
            if st.state == "preempted":
                store.transition(s, a, "preempted", st.reason, now, term=term)
                sql.audit_scheduler(s, now, "allocation.preempt", a, term, {"reason": st.reason})
            if st.requeue:
                why = "after preemption" if st.state == "preempted" else f"after {st.reason}"
                store.requeue(s, a, f"requeued as attempt {a.attempt + 1} {why}", now)
                sql.audit_scheduler(s, now, "allocation.requeue", a, term, {"reason": st.reason})
                res.requeued.append(a.id)
            elif st.state != "preempted":
                store.transition(s, a, st.state, st.reason, now, term=term)
                sql.audit_scheduler(s, now, "allocation.fail", a, term, {"reason": st.reason})
            res.stopped.append(a.id)
        ending = sql.lock_allocations(s, list(plan.ends))
        for alloc_id, (attempt, why) in plan.ends.items():  # dependencies never met: ended unstarted
            a = ending.get(alloc_id)
            if a is None or a.attempt != attempt or a.state != "pending":
                continue
            store.transition(s, a, "failed", why, now, term=term)
            sql.audit_scheduler(s, now, "allocation.fail", a, term, {"reason": why})
            res.stopped.append(a.id)
            res.unstarted.append(a.id)
        s.flush()
        if plan.binds:
            heads = sql.bind_heads(s, [b.id for b in plan.binds])
            bound = sql.write_binds(s, plan.binds, heads, term, now, sql.node_names(s))
            gangs.reserve(s, (gangs.BoundGang(b.id, b.attempt, b.nodes) for b in bound), gang_ports)
            res.bound.extend(b.id for b in bound)
            res.nodes.update(n for b in bound for n in b.nodes)
        store.set_reasons(s, plan.reasons)
    return res
