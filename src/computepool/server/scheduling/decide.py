"""Every decision of one cycle, from the snapshot alone (no I/O, no clock).

Allocations on lost or removed nodes are stopped (restartable ones and jobs that never started
requeued), restartable ones on draining nodes are moved; the bound ones are held in a `World`;
pending requests are served across tenants by weighted dominant-resource share (tenants whose next
request stays within their guarantee first), within a tenant by priority then age; each is checked
against its tenant's limits and placed by `scheduler.placement.Scheduler` with the `default` policy
— the same code as the simulator. A request within its tenant's guarantee that does not fit may
preempt other tenants' *borrowed* capacity (usage above guarantee): lowest priority, then least
elapsed, and only as many as needed, tried in a `Statement` that rolls back when the claim fails.
Before any of it, the oldest waiting gang gets a reservation (`backfill`): the rest keeps off its
nodes unless its time limit ends before the gang could start.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from computepool.core import Request
from computepool.core.allocation import AllocationState, Isolation
from computepool.scheduler import speed_pref
from computepool.scheduler.filters import Reasons, model_ids
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.reservation import Reservation
from computepool.server.scheduling import backfill, gates
from computepool.server.scheduling.quota import (
    host_usage,
    over_limit,
    reclaimable,
    slices_usage,
    within_guarantee,
)
from computepool.server.scheduling.snapshot import Live, Snapshot
from computepool.server.scheduling.world import Statement, World

MAX_VICTIM_CANDIDATES = 256


@dataclass(frozen=True)
class Bind:
    id: int
    attempt: int
    tenant: str
    nodes: list[str]
    slices: list[dict[str, Any]]
    preempted: tuple[int, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Stop:
    """End (or requeue) a bound or active allocation: preempted, or its node is lost."""

    id: int
    attempt: int
    tenant: str
    nodes: list[str]
    state: AllocationState  # preempted | failed
    reason: str
    requeue: bool


@dataclass
class Plan:
    binds: list[Bind] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)  # pending id → why it waits
    ends: dict[int, tuple[int, str]] = field(default_factory=dict)  # pending id → (attempt, why never)
    recheck_s: float | None = None  # decide again this soon even if nothing changes (a retry's back-off)

    def touched_nodes(self) -> set[str]:
        return {n for b in self.binds for n in b.nodes} | {n for st in self.stops for n in st.nodes}


def isolation_of(req: dict[str, Any]) -> str:
    return str(req["isolation"])


def new_scheduler(snap: Snapshot) -> Scheduler:
    """A fresh `default` scheduler that has seen the snapshot's requests in id order (determinism)."""
    sched = Scheduler(make_scorer("default"))
    for a in snap.live:
        sched.scorer.observe(a.core)
    return sched


def build_world(snap: Snapshot) -> tuple[World, list[Live], list[Stop]]:
    """The state with every bound allocation held, except those on lost or removed nodes, and
    restartable ones on draining nodes (stops; the restartable ones are requeued)."""
    world = World(snap)
    running: list[Live] = []
    stops: list[Stop] = []
    for a in snap.live:
        if a.state == "pending":
            continue
        gone = [n for n in a.nodes if n not in world.index]
        if gone:
            why = "lost" if gone[0] in world.by_name else "removed from the pool"
            member = f" (rank {a.nodes.index(gone[0])} of the gang)" if len(a.nodes) > 1 else ""
            reason = f"node {gone[0]}{member} {why}"
            # a one-node job bound but never reported running never started: it may start elsewhere
            again = a.restartable or (a.state == "bound" and a.has_command and len(a.nodes) == 1)
            stops.append(Stop(a.id, a.attempt, a.tenant, a.nodes, "failed", reason, requeue=again))
            continue
        drained = next((n for n in a.nodes if world.by_name[n].draining), None)
        if drained is not None and a.restartable:  # moved: requeued, placed elsewhere this cycle
            reason = f"node {drained} drained"
            stops.append(Stop(a.id, a.attempt, a.tenant, a.nodes, "failed", reason, requeue=True))
            continue
        world.hold(a)  # work that cannot restart finishes where it runs (as a Slurm drain)
        running.append(a)
    return world, running, stops


def decide(snap: Snapshot) -> Plan:
    """Every decision of one cycle, from the snapshot alone."""
    world, running, stops = build_world(snap)
    gate = gates.judge(snap)  # dependencies, array limits, retries' back-off
    plan = Plan(stops=stops, ends=gate.ends, recheck_s=gate.recheck_s)
    sched = new_scheduler(snap)
    _serve_pending(snap, world, sched, running, plan, gate.held)
    return plan


Kind = tuple[Any, ...]


@dataclass
class _Cycle:
    """What serving one request needs to know of the cycle so far."""

    snap: Snapshot
    world: World
    sched: Scheduler
    running: list[Live]
    plan: Plan
    failed_kinds: dict[Kind, int] = field(default_factory=dict)  # kind → `world.freed` at last failure
    waiting: dict[Kind, list[int]] = field(default_factory=dict)  # kind → pending ids that did not fit
    victims_taken: set[int] = field(default_factory=set)
    reservation: Reservation | None = None  # nodes kept for the oldest waiting gang (backfill.py)

    def keep_off(self, a: Live) -> np.ndarray | None:
        """The nodes `a` may use beside the reservation: None (all) unless it would delay the gang."""
        res = self.reservation
        if res is None or a.id == res.gang:
            return None
        return res.within(backfill.time_limit_s(a))  # pending: it would end its limit from now


def _serve_pending(
    snap: Snapshot, world: World, sched: Scheduler, running: list[Live], plan: Plan, held: dict[int, str]
) -> None:
    queues: dict[str, list[Live]] = {}
    plan.reasons.update(held)
    for a in snap.live:
        if a.state == "pending" and a.id not in held and a.id not in plan.ends:
            queues.setdefault(a.tenant, []).append(a)
    for q in queues.values():
        q.sort(key=lambda a: (-a.priority, a.id))
    cap = world.capacity()
    ptr = dict.fromkeys(queues, 0)

    def rank(t: str) -> tuple[bool, float, str]:
        used = world.usage.get(t, Counter())
        head = queues[t][ptr[t]]
        borrowing = not within_guarantee(used, head.est, snap.quotas.get(t, {}))
        share = max((used[("", r)] / c for r, c in cap.items() if c > 0), default=0.0)
        return borrowing, share / max(snap.weights.get(t, 1.0), 1e-9), t

    heap = [(rank(t), t) for t in sorted(queues)]
    heapq.heapify(heap)
    cycle = _Cycle(snap, world, sched, running, plan)
    cycle.reservation = backfill.plan(snap, world, sched, running, held.keys() | plan.ends.keys())
    first: dict[Kind, Request] = {}
    t: str | None = None
    while t is not None or heap:
        if t is None:
            _, t = heapq.heappop(heap)
        a = queues[t][ptr[t]]
        ptr[t] += 1
        keep_off = cycle.keep_off(a)
        kind = _kind(world, a.core, keep_off)
        first.setdefault(kind, a.core)
        _serve_one(cycle, a, kind, keep_off)
        if ptr[t] >= len(queues[t]):
            t = None
        elif heap:
            t = heapq.heappushpop(heap, (rank(t), t))[1]
        # else the only tenant left: it comes next whatever its rank (a long queue pays no ranking)
    # Why the rest waits, explained once per kind against the pool as the cycle leaves it.
    for kind, ids in cycle.waiting.items():
        text = _why_waiting(cycle, first[kind], ids, restricted=kind[-1])
        for i in ids:
            plan.reasons[i] = text
    # Only reasons that changed are written: a steady pool costs no writes.
    known = {a.id: a.reason for a in snap.live}
    plan.reasons = {i: r for i, r in plan.reasons.items() if known.get(i) != r[:1024]}


def _serve_one(c: _Cycle, a: Live, kind: Kind, keep_off: np.ndarray | None = None) -> None:
    """Place one pending request (of `kind`, off the nodes `keep_off` leaves out: a reservation's),
    preempting borrowed capacity when its tenant's guarantee allows; or record why it waits."""
    world, plan = c.world, c.plan
    req = a.core
    quota = c.snap.quotas.get(a.tenant, {})
    used = world.usage.get(a.tenant)
    if used is None:
        used = world.usage[a.tenant] = Counter()
    refused = over_limit(used, a.est, quota)
    if refused is not None:
        plan.reasons[a.id] = refused
        return
    guaranteed = within_guarantee(used, a.est, quota)
    owner = world.owns_nodes(a.tenant)  # may take its dedicated nodes back from borrowers
    if c.failed_kinds.get(kind) == world.freed and not guaranteed and not owner:
        c.waiting.setdefault(kind, []).append(a.id)  # the pool only fills up within a cycle: it fails again
        return
    if world.state.n_nodes == 0:  # nothing to place on (the scheduler needs at least one node)
        c.failed_kinds[kind] = world.freed
        c.waiting.setdefault(kind, []).append(a.id)
        return
    d = _place(c, req, keep_off, _speed_order(c, a))
    stmt = world.statement()
    if not d.ok and (guaranteed or owner):
        d = _preempt(c, a, stmt, lent_only=not guaranteed, keep_off=keep_off)
    if d.ok:
        nodes, slices = world.slices_for(d, isolation_of(a.request))
        exact = slices_usage(slices, world.model_of) + host_usage(req, len(nodes))
        refused = over_limit(used, exact, quota)
        if refused is None:
            preempted = stmt.evicted()
            stmt.commit()
            Scheduler.commit(world.state, d)
            world.placed[a.id] = {world.index[sl["node"]] for sl in slices if int(sl["compute_milli"]) > 0}
            used.update(exact)
            if c.reservation is not None and c.reservation.gang == a.id:
                c.reservation = None  # the gang it held capacity for is bound: nothing is kept any more
            note = _borrow_note(world, d)
            plan.binds.append(
                Bind(a.id, a.attempt, a.tenant, nodes, slices, tuple(v.id for v in preempted), note)
            )
            for v in preempted:
                c.running.remove(v)
                c.victims_taken.add(v.id)
                plan.stops.append(
                    Stop(
                        v.id,
                        v.attempt,
                        v.tenant,
                        v.nodes,
                        "preempted",
                        _preempted_why(world, v, a),
                        requeue=v.restartable,
                    )
                )
            return
        stmt.rollback()  # put the victims back: the claim is refused after all
        plan.reasons[a.id] = refused
        return
    c.failed_kinds[kind] = world.freed
    c.waiting.setdefault(kind, []).append(a.id)


def _kind(world: World, req: Request, keep_off: np.ndarray | None = None) -> Kind:
    """Requests of one kind fail alike in a cycle: same shape and, where nodes have rules, the
    same selector, tolerations and (with dedicated nodes) tenant; the same colocation; and kept
    off a reservation's nodes or not (always the last item)."""
    rules = world.state.rules
    return (
        req.kind_key(),
        req.memory_mib,
        req.gang_nodes,
        rules.key(req) if rules is not None else (),
        req.colocate,
        keep_off is not None,
    )


def _speed_order(c: _Cycle, a: Live) -> list[frozenset[str]] | None:
    """The device models to try in turn for a request naming a job type, fastest first by its
    tenant's measured speeds (scheduler/speed_pref.py); None: no preference (placed as ever)."""
    job_type = a.request.get("job_type")
    speeds = c.snap.speeds.get(a.tenant)
    req = a.core
    if not job_type or speeds is None or not req.gpu_count or req.tier == Isolation.MIG:
        return None
    rates = speed_pref.rates_for(speeds, str(job_type), req.gpu_count * req.gang_nodes)
    if not rates:
        return None
    state = c.world.state
    ids = model_ids(state, req)
    names = state.models if ids is None else [state.models[int(i)] for i in ids]
    return speed_pref.model_order(rates, names)


def _place(
    c: _Cycle, req: Request, keep_off: np.ndarray | None = None, order: list[frozenset[str]] | None = None
) -> Decision:
    """Place on the preferred nodes first: an owner on its dedicated nodes, others off them; never
    on nodes `keep_off` leaves out (a reservation's). Within each, `order`'s device models in turn
    (a job type's fastest first), the first where it fits now."""
    rules = c.world.state.rules
    tiers = rules.preference(req) if rules is not None else [None]
    d = Decision(request=req, reasons=Reasons(0))
    for within in tiers:
        if keep_off is not None:
            within = keep_off if within is None else within & keep_off
        groups: list[frozenset[str] | None] = list(order) if order else [None]
        for models in groups:
            narrowed = req if models is None else replace(req, models=models)
            d = c.sched.place(c.world.state, narrowed, observe=False, explain=False, within=within)
            if d.ok:
                d.request = req
                return d
    return d


def _why_waiting(c: _Cycle, req: Request, ids: list[int], *, restricted: bool) -> str:
    """Why pending requests of one kind wait, against the pool as the cycle leaves it."""
    world, res = c.world, c.reservation
    if restricted and res is not None and c.sched.place(world.state, req, observe=False, explain=False).ok:
        return backfill.held_back(c.snap, res)  # it would fit, but on the reserved nodes
    reasons = world.reasons(req)  # with the topology rule's note when that is why a gang waits
    if res is not None and res.gang in ids:
        reasons.notes.append(backfill.reserved_note(c.snap, world, res))
    return str(reasons)


def _borrow_note(world: World, d: Decision) -> str:
    """Say so when the work borrows another tenant's dedicated node: it is preemptible there."""
    rules = world.state.rules
    if rules is None or not d.placements:
        return ""
    lent = rules.borrowed(d.request)
    if not any(lent[pl.node] for pl in d.placements):
        return ""
    return " (borrowing a node dedicated to another tenant: preemptible)"


def _preempted_why(world: World, v: Live, a: Live) -> str:
    if world.lent_to(v, a.tenant):
        return f"preempted: dedicated node taken back by its tenant {a.tenant} (allocation {a.id})"
    return f"preempted: borrowed capacity reclaimed by tenant {a.tenant} (allocation {a.id})"


def _preempt(
    c: _Cycle, a: Live, stmt: Statement, *, lent_only: bool = False, keep_off: np.ndarray | None = None
) -> Decision:
    """Evict other tenants' borrowed allocations in `stmt`, cheapest first, until `a` fits; keep
    only the ones needed. Returns the decision; when it is not ok, `stmt` is rolled back.

    Work borrowing a node dedicated to `a`'s tenant is always a candidate; other work only when
    taking it keeps its tenant at or above its guarantee, and not at all when `lent_only`.
    Fit is whatever `Scheduler.place` says (fractions, memory, tiers, gangs), so victims are
    tried in rank order rather than searched as the whole-GPU replay does
    (`scheduler.queueing.select_victims`); docs/architecture.md compares the two.
    """
    world = c.world
    candidates = sorted(
        (v for v in c.running if v.tenant != a.tenant and v.id not in c.victims_taken),
        key=lambda v: (v.priority, -(v.bound_at.timestamp() if v.bound_at else 0.0), -v.id),
    )[:MAX_VICTIM_CANDIDATES]
    start = stmt.checkpoint()
    removed: list[Live] = []
    d = Decision(request=a.core, reasons=Reasons(0))
    for v in candidates:
        vq = c.snap.quotas.get(v.tenant, {})
        if not world.lent_to(v, a.tenant) and (
            lent_only or not reclaimable(world.usage[v.tenant], world.held[v.id], vq)
        ):
            continue
        stmt.evict(v)
        removed.append(v)
        d = c.sched.place(world.state, a.core, observe=False, explain=False, within=keep_off)
        if d.ok:
            break
    if not d.ok:
        stmt.rollback(start)
        return d
    # Keep only what is needed: give back the costliest victims first while the claim still fits.
    for v in reversed(removed[:-1]):
        cp = stmt.checkpoint()
        stmt.restore(v)
        again = c.sched.place(world.state, a.core, observe=False, explain=False, within=keep_off)
        if again.ok:
            d = again
        else:
            stmt.rollback(cp)
    return d


def pool_is_empty(snap: Snapshot) -> bool:
    return not snap.nodes


def never_fits(snap: Snapshot, req: Request) -> str | None:
    """Why no node of the pool could ever hold `req` (capacities, ignoring usage); None if some could."""
    if not snap.nodes:
        return None  # nodes may still join
    # Node rules are left out: labels, taints and dedication change, and nodes may join with others.
    req = replace(req, node_selector=(), tolerations=frozenset(), colocate=None, stacks=())
    world = World(snap, empty=True)
    sched = Scheduler(make_scorer("bestfit"))
    if sched.place(world.state, req, observe=False, explain=False).ok:
        return None
    return f"no node of the pool could ever hold this request ({world.reasons(req)})"
