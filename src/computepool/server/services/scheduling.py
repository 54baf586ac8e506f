"""The scheduling controller: snapshot → decisions (pure) → one fenced commit per cycle.

One controller runs per server process; the replica holding the `scheduler_lease` row schedules.
Each cycle:

1. *Lease.* Hold or renew the lease; taking it over from an expired holder bumps the term.
2. *Snapshot.* Nodes (ready and uncordoned are schedulable; lost ones are dropped), tenants,
   quotas and the pending, bound and active allocations, read in one transaction.
3. *Decide* (`decide`, no I/O): allocations on lost or removed nodes are stopped (restartable
   ones requeued); the bound ones are applied to a `scheduler.state.ClusterState`; pending
   requests are served across tenants by weighted dominant-resource share (tenants whose next
   request stays within their guarantee first), within a tenant by priority then age; each is
   checked against its tenant's limits and placed by `scheduler.placement.Scheduler` with the
   `default` policy — the same code as the simulator. A request within its tenant's guarantee
   that does not fit may preempt other tenants' *borrowed* capacity (usage above guarantee):
   lowest priority, then least elapsed, and only as many as needed.
4. *Commit* every decision in one transaction that first checks, under the lease row's lock,
   that this holder still has the lease in the same term; otherwise nothing is written.

Decisions are a function of the snapshot alone (the scorer is rebuilt each cycle and learns
the request distribution from the snapshot in id order), so replicas agree and tests can
replay a cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from computepool.core import Device, InvalidInput, Node, Request, Sharing
from computepool.scheduler.filters import Reasons, explain
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import Change, ClusterState, tag_of
from computepool.server.hub import Hub
from computepool.server.settings import ServerSettings
from computepool.store import allocations as store
from computepool.store import audit
from computepool.store.db import Database, db_now
from computepool.store.models import (
    Allocation,
    AllocationEvent,
    AllocationNode,
    QuotaEntry,
    Tenant,
)
from computepool.store.models import Device as DeviceRow
from computepool.store.models import Node as NodeRow

log = logging.getLogger("computepool.server")

Key = tuple[str, str]  # (GPU model or "" for the whole pool, resource)
Usage = Counter[Key]
QuotaMap = dict[Key, tuple[int, int]]  # (guaranteed, limit)
MAX_VICTIM_CANDIDATES = 256
LEASE_TTL_S = 10.0
CYCLE_INTERVAL_S = 1.0


class LostLease(Exception):
    """The commit's term is no longer the lease's: another replica schedules now."""


# --- snapshot -------------------------------------------------------------------------------
@dataclass(frozen=True)
class DevSnap:
    index: int
    model: str
    memory_mib: int
    compute_milli: int
    uuid: str


@dataclass(frozen=True)
class NodeSnap:
    name: str
    cpu_milli: int
    memory_mib: int
    devices: tuple[DevSnap, ...]
    state: str  # ready | suspect | lost
    cordoned: bool
    draining: bool = False

    @property
    def schedulable(self) -> bool:
        return self.state == "ready" and not self.cordoned


@dataclass
class Live:
    """A pending, bound or active allocation as the scheduler sees it."""

    id: int
    tenant: str
    state: str
    request: dict[str, Any]
    priority: int
    attempt: int
    restartable: bool
    has_command: bool
    nodes: list[str]
    slices: list[dict[str, Any]]
    reason: str
    bound_at: datetime | None
    core: Request = field(init=False)
    est: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.core = to_core(self.request)
        self.est = estimate(self.core)


@dataclass
class Snapshot:
    nodes: list[NodeSnap]
    weights: dict[str, float]
    quotas: dict[str, QuotaMap]
    live: list[Live]


def node_state(age_s: float, settings: ServerSettings) -> str:
    if age_s < settings.suspect_after_s:
        return "ready"
    return "suspect" if age_s < settings.lost_after_s else "lost"


def load_snapshot(s: Session, settings: ServerSettings, *, live: bool = True) -> Snapshot:
    """A whole snapshot read afresh (`live=False`: without allocations, what admission checks).
    The controller keeps a `SnapshotCache` instead, which reads only what changed."""
    return SnapshotCache().load(s, settings, live=live)


def _tenants_and_quotas(s: Session) -> tuple[dict[str, float], dict[str, QuotaMap]]:
    conn = s.connection()
    weights = {name: w for name, w in conn.execute(_WEIGHTS).all()}
    quotas: dict[str, QuotaMap] = {t: {} for t in weights}
    rows = conn.execute(_QUOTAS).all()
    for tenant, model, res, g, lim in rows:
        quotas[tenant][(model, res)] = (int(g), int(lim))
    return weights, quotas


def _live_of(r: Any) -> Live:
    return Live(
        id=r.id,
        tenant=r.tenant,
        state=r.state,
        request=r.request,
        priority=r.priority,
        attempt=r.attempt,
        restartable=r.restartable,
        has_command=r.command is not None,
        nodes=list(r.nodes),
        slices=list(r.slices),
        reason=r.reason,
        bound_at=r.bound_at,
    )


_NODE_T = NodeRow.__table__
_NODE_ROWS = select(
    _NODE_T.c.id,
    _NODE_T.c.name,
    _NODE_T.c.cpu_milli,
    _NODE_T.c.memory_mib,
    _NODE_T.c.last_heartbeat_at,
    _NODE_T.c.cordoned,
    _NODE_T.c.joined_at,
    _NODE_T.c.draining,
).order_by(_NODE_T.c.name)
_TENANT_T = Tenant.__table__
_WEIGHTS = select(_TENANT_T.c.name, _TENANT_T.c.weight)
_QUOTA_T = QuotaEntry.__table__
_QUOTAS = select(
    _TENANT_T.c.name, _QUOTA_T.c.model, _QUOTA_T.c.resource, _QUOTA_T.c.guaranteed, _QUOTA_T.c.limit_value
).join(_TENANT_T, _QUOTA_T.c.tenant_id == _TENANT_T.c.id)
_NODE_NAMES = select(_NODE_T.c.name)


class SnapshotCache:
    """The controller's memory of the last snapshot, so a cycle reads only what changed.

    Devices never change after a node joins (a node that comes back with others joins anew), so
    they are read once per joined node (id, name and join time: SQLite may reuse a deleted id).
    Live allocations are listed by (id, state, attempt) — no JSON — and only new or changed
    ones are read whole: a request, its nodes and its slices are fixed for an attempt in a state.
    Everything else (heartbeat ages, cordons, tenants, quotas, pending reasons) is read every
    cycle. The result equals a fresh cache's (`load_snapshot`).
    """

    def __init__(self) -> None:
        self._devices: dict[tuple[int, str, datetime], tuple[DevSnap, ...]] = {}
        self._live: dict[int, Live] = {}

    def load(self, s: Session, settings: ServerSettings, *, live: bool = True) -> Snapshot:
        now = db_now(s)
        conn = s.connection()
        node_rows = conn.execute(_NODE_ROWS).all()
        keys = {(r[0], r[1], r[6]): r[0] for r in node_rows}
        missing = [nid for k, nid in keys.items() if k not in self._devices]
        if missing:
            found: dict[int, list[DevSnap]] = {i: [] for i in missing}
            for k in range(0, len(missing), 500):
                stmt = (
                    select(
                        DeviceRow.node_id,
                        DeviceRow.index,
                        DeviceRow.model,
                        DeviceRow.memory_mib,
                        DeviceRow.compute_milli,
                        DeviceRow.uuid,
                    )
                    .where(DeviceRow.node_id.in_(missing[k : k + 500]))
                    .order_by(DeviceRow.node_id, DeviceRow.index)
                )
                for nid, *d in s.execute(stmt):
                    found[nid].append(DevSnap(*d))
            self._devices.update((k, tuple(found[nid])) for k, nid in keys.items() if nid in found)
        for gone in set(self._devices) - set(keys):
            del self._devices[gone]
        nodes = [
            NodeSnap(
                name=name,
                cpu_milli=cpu,
                memory_mib=mem,
                devices=self._devices[(nid, name, joined)],
                state=node_state(max(0.0, (now - beat).total_seconds()), settings),
                cordoned=cordoned,
                draining=draining,
            )
            for nid, name, cpu, mem, beat, cordoned, joined, draining in node_rows
        ]
        weights, quotas = _tenants_and_quotas(s)
        if not live:
            return Snapshot(nodes=nodes, weights=weights, quotas=quotas, live=[])
        heads = store.live_heads(s)
        stale = [
            i
            for i, st, att, _ in heads
            if (c := self._live.get(i)) is None or c.state != st or c.attempt != att
        ]
        if stale:
            for r in store.live_rows(s, stale):
                self._live[r.id] = _live_of(r)
        live: list[Live] = []
        keep: dict[int, Live] = {}
        for i, st, att, reason in heads:
            a = self._live.get(i)
            if a is None or a.state != st or a.attempt != att:
                continue  # changed again between the two reads: the next cycle sees it
            a.reason = reason
            keep[i] = a
            live.append(a)
        self._live = keep
        return Snapshot(nodes=nodes, weights=weights, quotas=quotas, live=live)


# --- requests, usage and quotas -----------------------------------------------------------
_CORE_FIELD = {"gpu_count": "gpus", "sharing": "isolation"}


def to_core(req: dict[str, Any]) -> Request:
    """The stored API request as the scheduler's `Request` (raises InvalidInput naming API fields)."""
    gpus = int(req["gpus"])
    try:
        return Request(
            gpu_count=gpus,
            gpu_milli=int(req["gpu_milli"]) if gpus else 0,
            gpu_memory_mib=req.get("gpu_memory_mib") if gpus else None,
            cpu_milli=int(req["cpu_milli"]),
            memory_mib=int(req["memory_mib"]),
            models=frozenset(req["models"]) if req.get("models") else None,
            sharing=Sharing.EXCLUSIVE if req.get("exclusive") else Sharing.SHARED,
            gang_nodes=int(req["gang_nodes"]),
            priority=int(req["priority"]),
            tenant=str(req["tenant"]),
            name=str(req.get("name") or ""),
        )
    except InvalidInput as e:
        raise InvalidInput(_CORE_FIELD.get(e.where, e.where), e.message) from e


def estimate(req: Request) -> Usage:
    """What a request will count against pool-wide quotas before it is placed (exact except
    for GPU memory in proportion to compute, counted once placed, and MIG-sized devices)."""
    u: Usage = Counter()
    n = req.gang_nodes
    if req.gpu_count:
        u[("", "gpu_milli")] = req.gpu_count * req.gpu_milli * n
        if req.gpu_memory_mib is not None and req.fractional:
            u[("", "gpu_memory_mib")] = req.gpu_memory_mib * n
    u[("", "cpu_milli")] = req.cpu_milli * n
    u[("", "memory_mib")] = req.memory_mib * n
    return u


def slices_usage(slices: Iterable[dict[str, Any]], model_of: Callable[[str, int], str | None]) -> Usage:
    u: Usage = Counter()
    for sl in slices:
        u[("", "gpu_milli")] += int(sl["compute_milli"])
        u[("", "gpu_memory_mib")] += int(sl["memory_mib"])
        model = model_of(sl["node"], int(sl["device_index"]))
        if model is not None:
            u[(model, "gpu_milli")] += int(sl["compute_milli"])
            u[(model, "gpu_memory_mib")] += int(sl["memory_mib"])
    return u


def host_usage(req: Request, nodes: int) -> Usage:
    return Counter({("", "cpu_milli"): req.cpu_milli * nodes, ("", "memory_mib"): req.memory_mib * nodes})


def over_limit(used: Usage, add: Usage, quota: QuotaMap) -> str | None:
    """The first limit `add` would break, in words; None when every limit holds."""
    for key in sorted(add):
        amount = add[key]
        if amount <= 0 or key not in quota:
            continue
        limit = quota[key][1]
        if used[key] + amount > limit:
            model, res = key
            where = f"{res} of {model}" if model else res
            return f"quota: {where} limit {limit} (using {used[key]}, asks {amount})"
    return None


def within_guarantee(used: Usage, add: Usage, quota: QuotaMap) -> bool:
    """True when everything `add` asks for stays within what the tenant is guaranteed."""
    asked = [k for k, v in add.items() if v > 0]
    return bool(asked) and all(used[k] + add[k] <= quota.get(k, (0, 0))[0] for k in asked)


def reclaimable(used: Usage, victim: Usage, quota: QuotaMap) -> bool:
    """May `victim` be taken from its tenant? Only if it keeps the tenant at or above its guarantee."""
    return all(used[k] - v >= quota.get(k, (0, 0))[0] for k, v in victim.items() if v > 0)


# --- decisions ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bind:
    id: int
    attempt: int
    tenant: str
    nodes: list[str]
    slices: list[dict[str, Any]]
    preempted: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stop:
    """End (or requeue) a bound or active allocation: preempted, or its node is lost."""

    id: int
    attempt: int
    tenant: str
    nodes: list[str]
    state: str  # preempted | failed
    reason: str
    requeue: bool


@dataclass
class Plan:
    binds: list[Bind] = field(default_factory=list)
    stops: list[Stop] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)  # pending id → why it waits

    def touched_nodes(self) -> set[str]:
        return {n for b in self.binds for n in b.nodes} | {n for st in self.stops for n in st.nodes}


def isolation_of(req: dict[str, Any]) -> str:
    return str(req["isolation"])


class World:
    """The snapshot as the scheduler's state: capacity, who holds what, usage per tenant."""

    def __init__(self, snap: Snapshot, *, empty: bool = False) -> None:
        self.snap = snap
        self.nodes = [n for n in snap.nodes if n.state != "lost" or empty]
        self.by_name = {n.name: n for n in snap.nodes}
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.col = {n.name: {d.index: j for j, d in enumerate(n.devices)} for n in self.nodes}
        core_nodes = [
            Node(
                name=n.name,
                cpu_milli=n.cpu_milli,
                memory_mib=n.memory_mib,
                devices=[
                    Device(d.index, "", d.model, d.memory_mib, d.uuid, d.compute_milli) for d in n.devices
                ],
                schedulable=True if empty else n.schedulable,
            )
            for n in self.nodes
        ]
        self.state = ClusterState.from_nodes(core_nodes)
        self.usage: dict[str, Usage] = {t: Counter() for t in snap.weights}
        self.changes: dict[int, list[Change]] = {}
        self.held: dict[int, Usage] = {}
        self.freed = 0  # bumped whenever capacity is given back (preemption): failures may now fit

    def model_of(self, node: str, index: int) -> str | None:
        n = self.by_name.get(node)
        if n is None:
            return None
        for d in n.devices:
            if d.index == index:
                return d.model
        return None

    def usage_of(self, a: Live) -> Usage:
        return slices_usage(a.slices, self.model_of) + host_usage(a.core, len(a.nodes))

    def hold(self, a: Live) -> None:
        """Apply a bound allocation's slices to the state and its usage to its tenant."""
        changes: list[Change] = []
        for name in a.nodes:
            i = self.index.get(name)
            if i is None:
                continue
            cols = self.col[name]
            milli: dict[int, int] = {}
            mem: dict[int, int] = {}
            for sl in a.slices:
                j = cols.get(int(sl["device_index"])) if sl["node"] == name else None
                if j is not None:
                    milli[j] = milli.get(j, 0) + int(sl["compute_milli"])
                    mem[j] = mem.get(j, 0) + int(sl["memory_mib"])
            ch = Change(
                i,
                a.core.cpu_milli,
                a.core.memory_mib,
                milli,
                mem,
                tag_of(a.core.gpu_count, a.core.fractional),
            )
            self.state.apply(ch)
            changes.append(ch)
        self.changes[a.id] = changes
        u = self.usage_of(a)
        self.held[a.id] = u
        self.usage.setdefault(a.tenant, Counter()).update(u)

    def unhold(self, a: Live) -> None:
        self.freed += 1
        for ch in reversed(self.changes.pop(a.id, [])):
            self.state.undo(ch)
        self.usage[a.tenant].subtract(self.held.pop(a.id, Counter()))

    def slices_for(self, d: Decision, isolation: str) -> tuple[list[str], list[dict[str, Any]]]:
        nodes: list[str] = []
        slices: list[dict[str, Any]] = []
        for pl in d.placements:
            node = self.nodes[pl.node]
            nodes.append(node.name)
            for j in pl.devices:
                dev = node.devices[j]
                slices.append(
                    {
                        "node": node.name,
                        "device_index": dev.index,
                        "device_uuid": dev.uuid,
                        "compute_milli": int(pl.change.gpu_milli[j]),
                        "memory_mib": int(pl.change.gpu_memory_mib[j]),
                        "isolation": isolation,
                    }
                )
        return nodes, slices

    def capacity(self) -> dict[str, float]:
        sched = self.state.schedulable
        return {
            "gpu_milli": float(self.state.gpu_cap[sched].sum()),
            "cpu_milli": float(self.state.cpu_cap[sched].sum()),
            "memory_mib": float(self.state.mem_cap[sched].sum()),
        }

    def reasons(self, req: Request) -> Reasons:
        r = explain(self.state, req)
        if not self.nodes:
            r.notes.append("no nodes in the pool")
        if req.gang_nodes > 1:
            r.notes.append(f"gang needs {req.gang_nodes} nodes at once")
        return r


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
            reason = f"node {gone[0]} {why}"
            stops.append(Stop(a.id, a.attempt, a.tenant, a.nodes, "failed", reason, requeue=a.restartable))
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
    plan = Plan(stops=stops)
    sched = new_scheduler(snap)
    _serve_pending(snap, world, sched, running, plan)
    return plan


def _serve_pending(snap: Snapshot, world: World, sched: Scheduler, running: list[Live], plan: Plan) -> None:
    queues: dict[str, list[Live]] = {}
    for a in snap.live:
        if a.state == "pending":
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
    failed_kinds: dict[tuple[Any, ...], int] = {}  # kind → `world.freed` when it last failed
    waiting: dict[tuple[Any, ...], list[int]] = {}  # kind → pending ids that did not fit
    victims_taken: set[int] = set()
    first: dict[tuple[Any, ...], Request] = {}
    while heap:
        _, t = heapq.heappop(heap)
        a = queues[t][ptr[t]]
        ptr[t] += 1
        first.setdefault((a.core.kind_key(), a.core.memory_mib, a.core.gang_nodes), a.core)
        _serve_one(snap, world, sched, running, plan, a, failed_kinds, waiting, victims_taken)
        if ptr[t] < len(queues[t]):
            heapq.heappush(heap, (rank(t), t))
    # Why the rest waits, explained once per kind against the pool as the cycle leaves it.
    for kind, ids in waiting.items():
        text = str(world.reasons(first[kind]))
        for i in ids:
            plan.reasons[i] = text
    # Only reasons that changed are written: a steady pool costs no writes.
    known = {a.id: a.reason for a in snap.live}
    plan.reasons = {i: r for i, r in plan.reasons.items() if known.get(i) != r[:1024]}


def _serve_one(
    snap: Snapshot,
    world: World,
    sched: Scheduler,
    running: list[Live],
    plan: Plan,
    a: Live,
    failed_kinds: dict[tuple[Any, ...], int],
    waiting: dict[tuple[Any, ...], list[int]],
    victims_taken: set[int],
) -> None:
    req = a.core
    quota = snap.quotas.get(a.tenant, {})
    used = world.usage.setdefault(a.tenant, Counter())
    est = a.est
    refused = over_limit(used, est, quota)
    if refused is not None:
        plan.reasons[a.id] = refused
        return
    kind = (req.kind_key(), req.memory_mib, req.gang_nodes)
    guaranteed = within_guarantee(used, est, quota)
    if failed_kinds.get(kind) == world.freed and not guaranteed:
        waiting.setdefault(kind, []).append(a.id)  # the pool only fills up within a cycle: it fails again
        return
    if world.state.n_nodes == 0:  # nothing to place on (the scheduler needs at least one node)
        failed_kinds[kind] = world.freed
        waiting.setdefault(kind, []).append(a.id)
        return
    d = sched.place(world.state, req, observe=False, explain=False)
    preempted: list[Live] = []
    if not d.ok and guaranteed:
        d, preempted = _preempt(snap, world, sched, running, a, victims_taken)
    if d.ok:
        nodes, slices = world.slices_for(d, isolation_of(a.request))
        exact = slices_usage(slices, world.model_of) + host_usage(req, len(nodes))
        refused = over_limit(used, exact, quota)
        if refused is None:
            Scheduler.commit(world.state, d)
            used.update(exact)
            plan.binds.append(Bind(a.id, a.attempt, a.tenant, nodes, slices, tuple(v.id for v in preempted)))
            for v in preempted:
                running.remove(v)
                victims_taken.add(v.id)
                plan.stops.append(
                    Stop(
                        v.id,
                        v.attempt,
                        v.tenant,
                        v.nodes,
                        "preempted",
                        f"preempted: borrowed capacity reclaimed by tenant {a.tenant} (allocation {a.id})",
                        requeue=v.restartable,
                    )
                )
            return
        for v in preempted:  # put the victims back: the claim is refused after all
            world.hold(v)
        plan.reasons[a.id] = refused
        return
    failed_kinds[kind] = world.freed
    waiting.setdefault(kind, []).append(a.id)


def _preempt(
    snap: Snapshot, world: World, sched: Scheduler, running: list[Live], a: Live, taken: set[int]
) -> tuple[Decision, list[Live]]:
    """Remove other tenants' borrowed allocations, cheapest first, until `a` fits; keep only
    the ones needed. Returns the decision (not ok: state unchanged) and the victims."""
    candidates = sorted(
        (v for v in running if v.tenant != a.tenant and v.id not in taken),
        key=lambda v: (v.priority, -(v.bound_at.timestamp() if v.bound_at else 0.0), -v.id),
    )[:MAX_VICTIM_CANDIDATES]
    removed: list[Live] = []
    d = Decision(request=a.core, reasons=Reasons(0))
    for v in candidates:
        vq = snap.quotas.get(v.tenant, {})
        if not reclaimable(world.usage[v.tenant], world.held[v.id], vq):
            continue
        world.unhold(v)
        removed.append(v)
        d = sched.place(world.state, a.core, observe=False, explain=False)
        if d.ok:
            break
    if not d.ok:
        for v in reversed(removed):
            world.hold(v)
        return d, []
    # Keep only what is needed: give back the costliest victims first while the claim still fits.
    for v in reversed(removed[:-1]):
        world.hold(v)
        again = sched.place(world.state, a.core, observe=False, explain=False)
        if again.ok:
            removed.remove(v)
            d = again
        else:
            world.unhold(v)
    return d, removed


# --- commit -----------------------------------------------------------------------------------
@dataclass
class CommitResult:
    bound: list[int] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    requeued: list[int] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)


def _audit(s: Session, now: datetime, action: str, a: Allocation, term: int, detail: dict[str, Any]) -> None:
    event = audit.AuditEvent(
        actor="scheduler",
        action=action,
        target=f"allocation:{a.id}",
        outcome="ok",
        request_id=f"term:{term}",
        tenant=a.tenant.name,
        detail={"term": term, "attempt": a.attempt, **detail},
    )
    audit.append(s, event, now)


def _load(s: Session, ids: list[int]) -> dict[int, Allocation]:
    out: dict[int, Allocation] = {}
    for i in range(0, len(ids), 500):
        chunk = ids[i : i + 500]
        stmt = select(Allocation).where(Allocation.id.in_(chunk)).with_for_update(of=Allocation)
        out.update((a.id, a) for a in s.scalars(stmt).unique().all())
    return out


def _bind_rows(s: Session, ids: list[int]) -> dict[int, tuple[str, int, str]]:
    """id → (state, attempt, tenant) of the allocations to bind, locked (PostgreSQL) until commit."""
    out: dict[int, tuple[str, int, str]] = {}
    for i in range(0, len(ids), 500):
        stmt = (
            select(Allocation.id, Allocation.state, Allocation.attempt, Tenant.name)
            .join(Tenant, Allocation.tenant_id == Tenant.id)
            .where(Allocation.id.in_(ids[i : i + 500]))
            .with_for_update(of=Allocation)
        )
        out.update((r[0], (r[1], r[2], r[3])) for r in s.execute(stmt))
    return out


def _write_binds(
    s: Session,
    binds: list[Bind],
    rows: dict[int, tuple[str, int, str]],
    term: int,
    now: datetime,
    names: set[str],
) -> list[Bind]:
    """Bind every still-pending allocation in a few statements: rows, node index, events, audit."""
    done = [
        b
        for b in binds
        if (r := rows.get(b.id)) is not None
        and r[0] == "pending"
        and r[1] == b.attempt
        and set(b.nodes) <= names
    ]
    if not done:
        return done
    reasons = {b.id: (f"bound on {', '.join(b.nodes)}" if b.nodes else "bound")[:1024] for b in done}
    upd = (
        update(Allocation)
        .where(Allocation.id == bindparam("b_id"))
        .values(
            state="bound",
            reason=bindparam("b_reason"),
            term=term,
            bound_at=now,
            nodes=bindparam("b_nodes"),
            slices=bindparam("b_slices"),
        )
    )
    conn = s.connection()
    conn.execute(
        upd,
        [
            {"b_id": b.id, "b_reason": reasons[b.id], "b_nodes": list(b.nodes), "b_slices": list(b.slices)}
            for b in done
        ],
    )
    conn.execute(
        AllocationNode.__table__.insert(),
        [{"allocation_id": b.id, "node": n} for b in done for n in dict.fromkeys(b.nodes)],
    )
    conn.execute(
        AllocationEvent.__table__.insert(),
        [
            {
                "allocation_id": b.id,
                "at": now,
                "state": "bound",
                "reason": reasons[b.id],
                "attempt": b.attempt,
                "term": term,
            }
            for b in done
        ],
    )
    audit.append_many(
        s,
        [
            audit.AuditEvent(
                actor="scheduler",
                action="allocation.bind",
                target=f"allocation:{b.id}",
                outcome="ok",
                request_id=f"term:{term}",
                tenant=rows[b.id][2],
                detail={"term": term, "attempt": b.attempt, "nodes": b.nodes, "preempted": list(b.preempted)},
            )
            for b in done
        ],
        now,
    )
    return done


def commit(db: Database, plan: Plan, holder: str, term: int) -> CommitResult:
    """Write the cycle's decisions in one transaction, fenced by the lease term.

    Raises LostLease (writing nothing) when another replica holds the lease or a newer term.
    Decisions about allocations that changed since the snapshot (cancelled, released) are skipped.
    Binds, the bulk of a busy cycle, are written a few statements for all of them.
    """
    res = CommitResult()
    with db.write() as s:
        if not store.holds_lease(s, holder, term):
            raise LostLease(f"scheduler term {term} is no longer current")
        now = db_now(s)
        rows = _load(s, [x.id for x in plan.stops])
        for st in plan.stops:
            a = rows.get(st.id)
            if a is None or a.attempt != st.attempt or a.state not in store.HOLDING:
                continue
            res.nodes.update(a.nodes)
            if st.state == "preempted":
                store.transition(s, a, "preempted", st.reason, now, term=term)
                _audit(s, now, "allocation.preempt", a, term, {"reason": st.reason})
            if st.requeue:
                why = "after preemption" if st.state == "preempted" else f"after {st.reason}"
                store.requeue(s, a, f"requeued as attempt {a.attempt + 1} {why}", now)
                _audit(s, now, "allocation.requeue", a, term, {"reason": st.reason})
                res.requeued.append(a.id)
            elif st.state != "preempted":
                store.transition(s, a, st.state, st.reason, now, term=term)
                _audit(s, now, "allocation.fail", a, term, {"reason": st.reason})
            res.stopped.append(a.id)
        s.flush()
        if plan.binds:
            names = set(s.connection().execute(_NODE_NAMES).scalars().all())
            bound = _write_binds(s, plan.binds, _bind_rows(s, [b.id for b in plan.binds]), term, now, names)
            res.bound.extend(b.id for b in bound)
            res.nodes.update(n for b in bound for n in b.nodes)
        store.set_reasons(s, plan.reasons)
    return res


# --- the controller -----------------------------------------------------------------------------
@dataclass
class CycleReport:
    leader: bool
    term: int = 0
    seconds: float = 0.0
    decide_seconds: float = 0.0
    pending: int = 0
    result: CommitResult | None = None
    snapshot_seconds: float = 0.0
    commit_seconds: float = 0.0


class Controller:
    """The scheduling loop of one server process: woken by `Hub.wake_scheduler` or every second."""

    def __init__(
        self,
        db: Database,
        settings: ServerSettings,
        hub: Hub,
        *,
        observe: Callable[[float], None] | None = None,
        interval_s: float = CYCLE_INTERVAL_S,
        lease_ttl_s: float = LEASE_TTL_S,
        holder: str | None = None,
    ) -> None:
        self.db = db
        self.settings = settings
        self.hub = hub
        self.observe = observe
        self.interval_s = interval_s
        self.lease_ttl_s = lease_ttl_s
        self.holder = holder or f"{uuid.uuid4().hex[:16]}"
        self.auto = True  # tests turn the background loop off and call run_once
        self._lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._snapshots = SnapshotCache()
        self._term: int | None = None  # the lease term held, as of the last renewal
        self._renewed = 0.0

    def acquire(self) -> int | None:
        """Take or renew the lease in the database; the term, or None while another replica holds it."""
        with self.db.write() as s:
            term = store.acquire_lease(s, self.holder, db_now(s), self.lease_ttl_s)
        self._term, self._renewed = term, time.monotonic()
        return term

    @property
    def leader(self) -> bool:
        """Whether this process held the scheduling lease at its last renewal, within its TTL."""
        return self._term is not None and time.monotonic() - self._renewed < self.lease_ttl_s

    def _held_term(self) -> int | None:
        """The term, renewing the lease only once a third of its time has passed: a busy pool
        runs many cycles a second, and each renewal is a write. Commits stay fenced by the term
        in the database, so a lease lost meanwhile writes nothing."""
        if self._term is not None and time.monotonic() - self._renewed < self.lease_ttl_s / 3:
            return self._term
        return self.acquire()

    def run_once(self) -> CycleReport:
        """One cycle (thread-safe; cycles of one process never overlap)."""
        with self._lock:
            t0 = time.perf_counter()
            term = self._held_term()
            if term is None:
                return CycleReport(leader=False)
            with self.db.read() as s:
                lost_before = db_now(s) - timedelta(seconds=self.settings.lost_after_s)
                if not store.needs_cycle(s, lost_before):  # idle pool: nothing pending, no node lost
                    return CycleReport(True, term, time.perf_counter() - t0, 0.0, 0, CommitResult())
                snap = self._snapshots.load(s, self.settings)
            t1 = time.perf_counter()
            plan = decide(snap)
            t2 = time.perf_counter()
            try:
                result = commit(self.db, plan, self.holder, term)
            except LostLease:
                self._term = None
                if self.acquire() != term:  # another replica schedules now
                    return CycleReport(leader=False)
                raise
            t3 = time.perf_counter()
            elapsed = t3 - t0
            if self.observe is not None:
                self.observe(elapsed)
            self.hub.notify(*(f"node:{n}" for n in result.nodes))
            self.hub.notify(*(f"logs:{i}" for i in result.stopped))
            self.hub.notify(*(f"alloc:{i}" for i in (*result.bound, *result.stopped)))
            if result.requeued:  # moved work waits in the queue: place it without waiting a second
                self.hub.wake_scheduler()
            pending = sum(1 for a in snap.live if a.state == "pending")
            return CycleReport(True, term, elapsed, t2 - t1, pending, result, t1 - t0, t3 - t2)

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.hub.scheduler_event.wait(), self.interval_s)
            self.hub.scheduler_event.clear()
            if not self.auto:
                continue
            try:
                await asyncio.to_thread(self.run_once)
            except LostLease as e:
                log.info("scheduling: %s", e)
            except Exception:  # the loop must survive a bad cycle (database away, bug): log, go on
                log.exception("scheduling cycle failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="cpool-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with self._lock:  # let a cycle running in a thread finish before the engine closes
            pass


def pool_is_empty(snap: Snapshot) -> bool:
    return not snap.nodes


def never_fits(snap: Snapshot, req: Request) -> str | None:
    """Why no node of the pool could ever hold `req` (capacities, ignoring usage); None if some could."""
    if not snap.nodes:
        return None  # nodes may still join
    world = World(snap, empty=True)
    sched = Scheduler(make_scorer("bestfit"))
    if sched.place(world.state, req, observe=False, explain=False).ok:
        return None
    return f"no node of the pool could ever hold this request ({world.reasons(req)})"
