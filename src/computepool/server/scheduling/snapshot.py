"""The snapshot a cycle decides from: nodes, tenants, quotas and live allocations, read at once.

The controller keeps a `SnapshotCache` so a cycle reads only what changed; `load_snapshot`
reads everything afresh (admission checks, metrics, tests). Both give the same snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from computepool.core import Request
from computepool.scheduler.hetero import Speeds
from computepool.server.scheduling.quota import QuotaMap, Usage, estimate
from computepool.server.scheduling.requests import stored_core
from computepool.server.settings import ServerSettings
from computepool.store import allocations as store
from computepool.store import scheduling as sql
from computepool.store import throughputs
from computepool.store.db import db_now


@dataclass(frozen=True)
class DevSnap:
    index: int
    model: str
    memory_mib: int
    compute_milli: int
    uuid: str
    mig_parent_uuid: str | None = None  # a MIG instance: its GPU (the profile is in `model`)
    link_group: str = ""  # NVLink peers share one (scheduler/topology.py)
    vendor: str = ""  # core/vendors.py: which variables name it, which tiers it enforces


@dataclass(frozen=True)
class NodeSnap:
    name: str
    cpu_milli: int
    memory_mib: int
    devices: tuple[DevSnap, ...]
    state: str  # ready | suspect | lost
    cordoned: bool
    draining: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: Mapping[str, str] = field(default_factory=dict)
    dedicated_to: str | None = None  # tenant name
    lending: bool = True
    fresh: bool = True  # heard from within two heartbeat intervals

    @property
    def schedulable(self) -> bool:
        """New work goes only to a node heard from lately: one that missed two heartbeats may be
        gone, and work bound to it would wait until the node is declared lost."""
        return self.state == "ready" and self.fresh and not self.cordoned


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
        self.core = stored_core(self.request)
        self.est = estimate(self.core)


@dataclass
class Snapshot:
    nodes: list[NodeSnap]
    weights: dict[str, float]
    quotas: dict[str, QuotaMap]
    live: list[Live]
    now: datetime | None = None  # the database's clock when read: time limits' ends are measured from it
    topology_label: str | None = None  # the node label gangs prefer to share (ServerSettings)
    silent: int = 0  # nodes not heard from for suspect_after_s
    braked: bool = False  # so many are silent that none is declared lost (`lost_brake`)
    ended: dict[int, str] = field(default_factory=dict)  # ended allocations pending ones wait for: state
    # measured steps/s per tenant (scheduler/speed_pref.py), read when a pending request names a job type
    speeds: dict[str, Speeds] = field(default_factory=dict)


def node_state(age_s: float, settings: ServerSettings) -> str:
    """ready, suspect or lost, from the age of the node's last heartbeat."""
    if age_s < settings.suspect_after_s:
        return "ready"
    return "suspect" if age_s < settings.lost_after_s else "lost"


def lost_brake(silent: int, total: int, share: float, min_nodes: int) -> bool:
    """Whether `silent` of `total` nodes quiet together more likely means the control plane's
    own trouble (its network, its database) than theirs: then none is declared lost."""
    return silent >= min_nodes and silent > share * total


def node_states(
    beats: list[datetime], now: datetime, since: datetime | None, settings: ServerSettings
) -> tuple[list[str], list[bool], int, bool]:
    """Each node's state, whether it is fresh, how many are silent, and whether the brake holds.
    Silence counts from no earlier than `since` (what the leader has observed); freshness from
    the heartbeat alone."""
    fresh_after = now - timedelta(seconds=2 * settings.heartbeat_interval_s)
    start = since or datetime.min.replace(tzinfo=now.tzinfo)
    states = [node_state(max(0.0, (now - max(b, start)).total_seconds()), settings) for b in beats]
    silent = sum(1 for st in states if st != "ready")
    braked = lost_brake(silent, len(states), settings.lost_brake_share, settings.lost_brake_min_nodes)
    if braked:
        states = ["suspect" if st == "lost" else st for st in states]
    return states, [b >= fresh_after for b in beats], silent, braked


def load_snapshot(
    s: Session, settings: ServerSettings, *, live: bool = True, observed_since: datetime | None = None
) -> Snapshot:
    """A whole snapshot read afresh (`live=False`: without allocations, what admission checks).
    The controller keeps a `SnapshotCache` instead, which reads only what changed."""
    return SnapshotCache().load(s, settings, live=live, observed_since=observed_since)


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
        self._ended: dict[int, str] = {}  # an end is final: read once

    def load(
        self,
        s: Session,
        settings: ServerSettings,
        *,
        live: bool = True,
        observed_since: datetime | None = None,
    ) -> Snapshot:
        """`observed_since`: the leader's `Leadership.since` (silence counts from no earlier)."""
        now = db_now(s)
        node_rows = sql.node_rows(s)
        keys = {(r[0], r[1], r[6]): r[0] for r in node_rows}
        missing = [nid for k, nid in keys.items() if k not in self._devices]
        if missing:
            found = sql.device_rows(s, missing)
            self._devices.update(
                (k, tuple(DevSnap(*d) for d in found[nid])) for k, nid in keys.items() if nid in found
            )
        for gone in set(self._devices) - set(keys):
            del self._devices[gone]
        states, fresh, silent, braked = node_states([r[4] for r in node_rows], now, observed_since, settings)
        nodes = [
            NodeSnap(
                name=name,
                cpu_milli=cpu,
                memory_mib=mem,
                devices=self._devices[(nid, name, joined)],
                state=states[k],
                cordoned=cordoned,
                draining=draining,
                labels=labels or {},
                taints=taints or {},
                dedicated_to=owner,
                lending=bool(lending),
                fresh=fresh[k],
            )
            for k, (nid, name, cpu, mem, _, cordoned, joined, draining, labels, taints, owner, lending) in (
                enumerate(node_rows)
            )
        ]
        weights, quotas = sql.tenants_and_quotas(s)
        if not live:
            return Snapshot(nodes, weights, quotas, [], now, settings.topology_label, silent, braked)
        heads = store.live_heads(s)
        stale = [
            i
            for i, st, att, _ in heads
            if (c := self._live.get(i)) is None or c.state != st or c.attempt != att
        ]
        if stale:
            for i in stale:
                self._live.pop(i, None)
            for r in store.live_rows(s, stale):
                self._live[r.id] = _live_of(r)
        current: list[Live] = []
        keep: dict[int, Live] = {}
        for i, st, att, reason in heads:
            a = self._live.get(i)
            if a is None:
                continue  # ended between the two reads: what it held is free
            if a.state == st and a.attempt == att:
                a.reason = reason
            # else it changed again between the two reads (on PostgreSQL each statement sees the
            # latest commits: a job bound last cycle turns active as its agent reports): the row
            # read second is the newer, and leaving it out would offer what it holds to others
            keep[i] = a
            current.append(a)
        self._live = keep
        snap = Snapshot(nodes, weights, quotas, current, now, settings.topology_label, silent, braked)
        snap.ended = self._ends_awaited(s, current)
        typed = {a.tenant for a in current if a.state == "pending" and a.request.get("job_type")}
        if typed:
            snap.speeds = {t: Speeds(r) for t, r in throughputs.speeds(s, sorted(typed)).items()}
        return snap

    def _ends_awaited(self, s: Session, current: list[Live]) -> dict[int, str]:
        """The final states of the ended allocations that pending ones name in `after`."""
        wanted = {
            int(d["id"]) for a in current if a.state == "pending" for d in a.request.get("after") or []
        } - {a.id for a in current}
        missing = [i for i in wanted if i not in self._ended]
        if missing:
            self._ended.update(store.end_states(s, missing))
        self._ended = {i: st for i, st in self._ended.items() if i in wanted}
        return dict(self._ended)
