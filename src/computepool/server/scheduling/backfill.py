"""The control plane's side of reservation with backfill (`scheduler.reservation`).

Each cycle, before pending work is served: the oldest waiting gang (highest priority, then
oldest; one its tenant's limits admit) gets a reservation computed from the bound work's time
limits, in seconds from the snapshot's clock. Other requests then keep off the reserved nodes
unless their time limit ends by the shadow time. The reasons say so in the user's words.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from datetime import datetime, timedelta

from computepool.scheduler.placement import Scheduler
from computepool.scheduler.reservation import Held, Reservation, human_s, reserve, when
from computepool.server.scheduling.quota import over_limit
from computepool.server.scheduling.snapshot import Live, Snapshot
from computepool.server.scheduling.world import World

MAX_GANGS_TRIED = 4  # gangs that could never fit are skipped, a few at most per cycle


def time_limit_s(a: Live) -> float | None:
    limit = a.request.get("time_limit")
    return None if limit is None else float(limit)


def ends_at(a: Live, now: datetime | None) -> float | None:
    """When bound work ends by its time limit, in seconds from `now` (None: no limit, or no clock)."""
    limit = time_limit_s(a)
    if limit is None or a.bound_at is None or now is None:
        return None
    return max(0.0, (a.bound_at - now).total_seconds() + limit)  # overdue work ends any moment


def plan(
    snap: Snapshot, world: World, sched: Scheduler, running: list[Live], waiting: Collection[int] = ()
) -> Reservation | None:
    """The reservation for the oldest gang that cannot start now (those in `waiting` may not start
    yet whatever is free: scheduling/gates.py); None when no gang waits."""
    gangs = [a for a in snap.live if a.state == "pending" and a.core.gang_nodes > 1 and a.id not in waiting]
    if not gangs or world.state.n_nodes == 0:
        return None
    gangs.sort(key=lambda a: (-a.priority, a.id))
    held = [Held(a.id, ends_at(a, snap.now), tuple(world.changes.get(a.id, ()))) for a in running]
    tried = 0
    for g in gangs:
        used = world.usage.get(g.tenant, Counter())
        if over_limit(used, g.est, snap.quotas.get(g.tenant, {})) is not None:
            continue  # its own tenant's limit holds it back: capacity would idle for nothing
        res = reserve(sched, world.state, g.id, g.core, held, 0.0)
        if res is not None:
            return res
        tried += 1
        if tried >= MAX_GANGS_TRIED:
            break
    return None


def clock(snap: Snapshot, res: Reservation) -> str | None:
    """The shadow time on the wall clock (`14:05 UTC`), when known."""
    left = res.free_in()
    if left is None or snap.now is None:
        return None
    return (snap.now + timedelta(seconds=left)).strftime("%H:%M UTC")


def held_back(snap: Snapshot, res: Reservation) -> str:
    """Why a request that would fit now waits: the reservation, and the limit that would let it start."""
    text = f"waits: capacity reserved for gang {res.gang} {when(res, clock(snap, res))}"
    left = res.free_in()
    if left is not None and left >= 1:
        text += f"; a --time-limit under {human_s(left)} could start now"
    return text


def reserved_note(snap: Snapshot, world: World, res: Reservation) -> str:
    """For the gang itself: which nodes are kept for it, and from when."""
    names = ", ".join(world.nodes[i].name for i in res.nodes[:8])
    more = f" and {len(res.nodes) - 8} more" if len(res.nodes) > 8 else ""
    return f"reserved: nodes {names}{more} {when(res, clock(snap, res))}"


def about_reservation(reason: str) -> bool:
    """Whether a stored reason is the reservation's (explain then shows it as the cycle wrote it)."""
    return reason.startswith("waits: capacity reserved") or "reserved: nodes" in reason
