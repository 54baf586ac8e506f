"""Reservation with backfill: a large gang must not starve behind a stream of small requests.

Without it, every small request that fits starts at once, and a gang that needs several whole
nodes waits until they happen to be free together, which in a busy pool may be never. So, as in
Slurm's backfill, the oldest waiting gang (highest priority, then oldest) gets a *reservation*:

- From the bound work's time limits (bound at + limit), the *shadow time*: the earliest time
  at which the gang fits if nothing new starts, and the nodes it would take then. Work is
  released in order of its end; work without a time limit ends "never", after all the rest.
- Until the gang starts, other requests may start on those nodes only if they carry a time limit
  that ends by the shadow time (they cannot delay it); anything else goes elsewhere or waits.
- When what must end for the gang to fit has no time limit, the shadow time is unknown: the
  nodes are still reserved (nothing new lands on them, so they drain towards the gang as their
  work ends), and nothing can backfill onto them.

One reservation at a time (the oldest gang) keeps it cheap: the shadow time is found with a
doubling then a binary search over the releases, O(log R) placements for R bound allocations,
and nothing at all runs while no gang waits. Times are seconds on any clock the caller likes
(the control plane uses seconds from the cycle's snapshot time, the simulator its own clock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from computepool.core.allocation import Isolation
from computepool.core.request import Request
from computepool.scheduler.placement import Placement, Scheduler
from computepool.scheduler.state import Change, ClusterState


@dataclass(frozen=True)
class Held:
    """Bound work as the reservation sees it: when it ends (None: no time limit) and what it holds."""

    key: int
    ends_at: float | None
    changes: tuple[Change, ...]


@dataclass(frozen=True)
class Reservation:
    """Nodes kept for one gang from the shadow time (None: unknown, work without time limits)."""

    gang: int
    request: Request
    nodes: tuple[int, ...]  # the gang's nodes then, in rank order
    mask: np.ndarray  # per node: reserved
    shadow: float | None
    now: float
    outside: np.ndarray  # per node: not reserved (read-only; shared by every `within`)

    def admits(self, ends_at: float | None) -> bool:
        """May work ending at `ends_at` (None: no limit) start on the reserved nodes now?"""
        return self.shadow is not None and ends_at is not None and ends_at <= self.shadow

    def within(self, ends_at: float | None) -> np.ndarray | None:
        """The nodes such work may use: all (None) when it ends in time, else the unreserved."""
        return None if self.admits(ends_at) else self.outside

    def free_in(self) -> float | None:
        """Seconds from now to the shadow time (None: unknown)."""
        return None if self.shadow is None else max(0.0, self.shadow - self.now)


def reserve(
    sched: Scheduler,
    state: ClusterState,
    gang: int,
    req: Request,
    held: Sequence[Held],
    now: float,
    within: np.ndarray | None = None,
) -> Reservation | None:
    """The reservation for gang `gang` (request `req`), or None when it could not fit even once all
    `held` work has ended (e.g. nodes cordoned). `state` is left as it was."""
    d = sched.place(state, req, observe=False, explain=False, within=within)
    if d.ok:
        return _made(gang, req, state, d.placements, now, now)
    order = sorted(held, key=lambda h: (h.ends_at is None, h.ends_at or 0.0, h.key))
    released = 0

    def release_to(n: int) -> None:
        nonlocal released
        nodes: set[int] = set()
        for h in order[released:n]:
            for ch in reversed(h.changes):
                state.undo(ch, touch=False)
                nodes.add(ch.node)
        for h in reversed(order[n:released]):
            for ch in h.changes:
                state.apply(ch, touch=False)
                nodes.add(ch.node)
        state.touch_nodes(nodes)
        released = n

    def fits() -> bool:
        return _fits(sched, state, req, within)

    try:
        lo, hi, step = 0, 0, 1  # doubling: fits after `hi` releases, not after `lo`
        while True:
            hi = min(len(order), lo + step)
            release_to(hi)
            if fits():
                break
            if hi == len(order):
                return None
            lo, step = hi, step * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            release_to(mid)
            if fits():
                hi = mid
            else:
                lo = mid
        release_to(hi)
        d = sched.place(state, req, observe=False, explain=False, within=within)
        return _made(gang, req, state, d.placements, order[hi - 1].ends_at, now)
    finally:
        release_to(0)


def _fits(sched: Scheduler, state: ClusterState, req: Request, within: np.ndarray | None) -> bool:
    """Would `req` fit: for a gang without a required label, enough nodes with room for one member
    each (what placing it member by member finds, at the cost of one member); else a placement."""
    if (
        req.gang_nodes > 1
        and req.colocate is None
        and not (req.tier == Isolation.MIG and req.mig_profile is None)
    ):
        return int(sched.feasible_nodes(state, req, within).sum()) >= req.gang_nodes
    return sched.place(state, req, observe=False, explain=False, within=within).ok


def _made(
    gang: int,
    req: Request,
    state: ClusterState,
    placements: list[Placement],
    shadow: float | None,
    now: float,
) -> Reservation:
    nodes = tuple(pl.node for pl in placements)
    mask = np.zeros(state.n_nodes, dtype=bool)
    mask[list(nodes)] = True
    outside = ~mask
    mask.setflags(write=False)
    outside.setflags(write=False)
    return Reservation(gang, req, nodes, mask, shadow, now, outside)


def when(res: Reservation, clock: str | None = None) -> str:
    """`from ~14:05` (given `clock`: the shadow time on the wall clock), `in ~20m`, or as nodes free up."""
    left = res.free_in()
    if left is None:
        return "as its nodes free up (their work has no time limit)"
    if left <= 0:
        return "now (the work in its way is past its time limit)"
    return f"from ~{clock}" if clock else f"in ~{human_s(left)}"


def human_s(s: float) -> str:
    """Seconds as the `--time-limit` a user would type: 45s, 20m, 3h, 2d (rounded down)."""
    s = int(s)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size * (2 if unit != "m" else 1):
            return f"{s // size}{unit}"
    return f"{max(s, 1)}s"
