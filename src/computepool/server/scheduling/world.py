"""The snapshot as the scheduler's state, and the statement that holds a cycle's tentative changes.

`World` is the capacity (`scheduler.state.ClusterState`), who holds what and each tenant's
usage. Trying a placement that needs evictions changes it tentatively: a `Statement` records
every eviction and restore, in order, so a request's attempt can be rolled back to any
checkpoint exactly (the model is KAI scheduler's statement, which does the same for the
evictions and pipelines it simulates).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from computepool.core import Device, Node, Request
from computepool.core.resources import mig_profile_of
from computepool.core.vendors import canonical
from computepool.scheduler.constraints import NodeConstraints, NodeRules
from computepool.scheduler.filters import Reasons, explain
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import Change, ClusterState, tag_of, tier_code
from computepool.scheduler.topology import why_spread
from computepool.server.scheduling.quota import Usage, host_usage, slices_usage
from computepool.server.scheduling.snapshot import Live, Snapshot


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
                    Device(
                        d.index,
                        d.vendor,
                        d.model,
                        d.memory_mib,
                        d.uuid,
                        d.compute_milli,
                        link_group=d.link_group,
                        mig_parent_uuid=d.mig_parent_uuid,
                        mig_profile=mig_profile_of(d.model) if d.mig_parent_uuid is not None else "",
                    )
                    for d in n.devices
                ],
                schedulable=True if empty else n.schedulable,
            )
            for n in self.nodes
        ]
        self.state = ClusterState.from_nodes(core_nodes)
        if not empty:  # admission (`empty`) ignores them: labels, taints and owners may change
            self.state.rules = NodeConstraints(
                [NodeRules(n.labels, n.taints, n.dedicated_to, n.lending) for n in self.nodes]
            )
            self.state.topology_label = snap.topology_label
        self.usage: dict[str, Usage] = {t: Counter() for t in snap.weights}
        self.changes: dict[int, list[Change]] = {}
        self.placed: dict[int, set[int]] = {}  # bound this cycle: allocation → nodes of its GPU slices
        self.held: dict[int, Usage] = {}
        self.freed = 0  # bumped whenever capacity is given back (preemption): failures may now fit
        self._holders: tuple[int, dict[int, set[int]]] | None = None  # (state version, by node)
        self._owns: dict[str, bool] = {}  # tenant → whether some node is dedicated to it

    def idle_devices_sentence(self, k: int, shown: int = 3) -> str | None:
        """`needs 2 whole idle GPUs on one node; vm: 0 of 3 idle (held by 51, 52)`: the nodes
        with the most idle devices first, each with the allocations that hold its others. None
        when some node has `k` idle: then idle devices are not what the request waits for."""
        st = self.state
        if self._holders is None or self._holders[0] != st.version:  # once per change, not per kind
            by_node: dict[int, set[int]] = {}  # node index → allocations holding a device of it
            for alloc_id, changes in self.changes.items():
                for ch in changes:
                    if any(ch.gpu_milli.values()):
                        by_node.setdefault(ch.node, set()).add(alloc_id)
            for alloc_id, on in self.placed.items():  # bound this cycle: what the next cycle sees held
                for i in on:
                    by_node.setdefault(i, set()).add(alloc_id)
            self._holders = (st.version, by_node)
        holders = self._holders[1]
        rows = []
        for i, n in enumerate(self.nodes):
            total = int((st.gpu_cap[i] > 0).sum())
            if total:
                idle = int(((st.gpu_free[i] == st.gpu_cap[i]) & (st.gpu_cap[i] > 0)).sum())
                rows.append((idle, n.name, total, sorted(holders.get(i, ()))))
        rows.sort(key=lambda x: (-x[0], x[1]))
        if rows and rows[0][0] >= k:
            return None
        parts = [
            f"{name}: {idle} of {total} idle" + (f" (held by {', '.join(map(str, ids))})" if ids else "")
            for idle, name, total, ids in rows[:shown]
        ]
        if len(rows) > shown:
            parts.append(f"{len(rows) - shown} more node{'' if len(rows) - shown == 1 else 's'} with GPUs")
        need = f"needs {k} whole idle GPU{'' if k == 1 else 's'} on one node"
        return "; ".join([need, *parts]) if parts else f"{need}; no node has GPUs"

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
                tier_code(a.core),
                a.tenant,  # a device's mps slices are one tenant's: released when the last goes
            )
            self.state.apply(ch)
            changes.append(ch)
        self.changes[a.id] = changes
        u = self.usage_of(a)
        self.held[a.id] = u
        self.usage.setdefault(a.tenant, Counter()).update(u)

    def unhold(self, a: Live) -> None:
        """Give back what `hold(a)` took (capacity and usage); counts as capacity freed."""
        self.freed += 1
        for ch in reversed(self.changes.pop(a.id, [])):
            self.state.undo(ch)
        self.usage[a.tenant].subtract(self.held.pop(a.id, Counter()))

    def lent_to(self, a: Live, owner: str) -> bool:
        """Is `a` another tenant's work on a node dedicated to `owner` (which may take it back)?"""
        rules = self.state.rules
        if rules is None or a.tenant == owner:
            return False
        return any(rules.owner_of(i) == owner for n in a.nodes if (i := self.index.get(n)) is not None)

    def owns_nodes(self, tenant: str) -> bool:
        rules = self.state.rules
        if rules is None:
            return False
        owns = self._owns.get(tenant)  # asked for every pending request: nodes' owners are fixed here
        if owns is None:
            owns = self._owns[tenant] = bool(rules.owned(tenant).any())
        return owns

    def statement(self) -> Statement:
        """A new statement for tentative changes to this world."""
        return Statement(self)

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
                        "vendor": canonical(dev.vendor) or dev.vendor,
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
        idle = self.idle_devices_sentence(req.gpu_count) if req.gpu_count > 0 and req.whole_devices else None
        if idle is not None and self.nodes:
            r.notes.append(idle)
        if req.colocate is not None and req.gang_nodes > 1 and self.nodes:
            spread = why_spread(Scheduler(make_scorer("bestfit")), self.state, req)
            if spread is not None:
                r.notes.append(spread)
        return r


@dataclass
class Statement:
    """The tentative evictions and restores of one request's attempt, in order, undoable.

    `checkpoint()` marks a point; `rollback(cp)` undoes everything recorded after it, newest
    first, leaving the world exactly as it was there; `commit()` keeps what was done and
    forgets the log. Evicting counts as capacity freed (`World.freed`) even when rolled back.
    """

    world: World
    _ops: list[tuple[bool, Live]] = field(default_factory=list)  # (evicted?, allocation)

    def checkpoint(self) -> int:
        return len(self._ops)

    def evict(self, a: Live) -> None:
        """Take `a`'s slices out of the world, tentatively."""
        self.world.unhold(a)
        self._ops.append((True, a))

    def restore(self, a: Live) -> None:
        """Put an allocation evicted in this statement back, tentatively."""
        self.world.hold(a)
        self._ops.append((False, a))

    def evicted(self) -> list[Live]:
        """The allocations out of the world now because of this statement, in eviction order."""
        out: dict[int, Live] = {}
        for evicted, a in self._ops:
            if evicted:
                out[a.id] = a
            else:
                out.pop(a.id, None)
        return list(out.values())

    def rollback(self, checkpoint: int = 0) -> None:
        while len(self._ops) > checkpoint:
            evicted, a = self._ops.pop()
            if evicted:
                self.world.hold(a)
            else:
                self.world.unhold(a)

    def commit(self) -> None:
        self._ops.clear()
