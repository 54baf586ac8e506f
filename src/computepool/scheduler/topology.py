"""Topology across nodes: a gang's members on nodes that share one value of a node label.

Nodes carry free-form labels (constraints.py); a pool names one of them its *topology label*
(`cpool server --topology-label rack`, `ClusterState.topology_label`), the level at which members
talk fastest (a rack, a leaf switch). A gang then prefers nodes of one value of that label and,
when no value has room for all of it, the fewest values: whole groups, those with the most room
first. A request may *require* one value with `colocate: <label key>`; it then waits rather than
spread, and `why_spread` says so for `explain`.

Inside a node the same idea applies to devices: several devices of one request come from one
NVLink group when possible (`pickers.linked_choice`), and the node itself is chosen among those
where they span the fewest groups (`prefer_linked`), before the policy's score decides.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from computepool.core.request import Request
from computepool.scheduler.filters import device_need
from computepool.scheduler.state import ClusterState

if TYPE_CHECKING:
    from computepool.scheduler.placement import Decision, Scheduler


def label_column(state: ClusterState, key: str) -> tuple[np.ndarray, list[str]]:
    """Per node, the index of its value of label `key` (-1: none), and the values."""
    if state.rules is None:
        return np.full(state.n_nodes, -1, dtype=np.int64), []
    return state.rules.label_column(key)


def room_by_value(
    sched: Scheduler, state: ClusterState, req: Request, key: str, within: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Nodes with room for one member, per value of `key`: (count per value, label column, values)."""
    col, values = label_column(state, key)
    ok = sched.feasible_nodes(state, req, within) & (col >= 0)
    return np.bincount(col[ok], minlength=len(values)), col, values


def place_colocated(
    sched: Scheduler, state: ClusterState, req: Request, explain: bool, within: np.ndarray | None
) -> Decision:
    """Place a gang on nodes of one label value (the tightest that holds it), else — unless the
    request requires it — on the fewest values, else anywhere. The member order is the rank order."""
    key = req.colocate or state.topology_label
    assert key is not None
    counts, col, values = room_by_value(sched, state, req, key, within)
    n = req.gang_nodes
    for v in sorted(np.flatnonzero(counts >= n).tolist(), key=lambda v: (counts[v], values[v])):
        mask = col == v
        d = sched.place_members(state, req, False, mask if within is None else mask & within)
        if d.ok:
            return d
    if req.colocate:
        d = sched.place_members(state, req, explain, np.zeros(state.n_nodes, dtype=bool))
        assert d.reasons is not None
        d.reasons.notes = [x for x in d.reasons.notes if not x.startswith("gang needs")]
        d.reasons.notes.append(spread_note(req, key, counts, values))
        return d
    order = sorted(range(len(values)), key=lambda v: (-counts[v], values[v]))
    taken, room = [], 0
    for v in order:
        if counts[v] == 0 or room >= n:
            break
        taken.append(v)
        room += int(counts[v])
    if room >= n and len(taken) > 1:
        mask = np.isin(col, taken)
        d = sched.place_members(state, req, False, mask if within is None else mask & within)
        if d.ok:
            return d
    return sched.place_members(state, req, explain, within)


def spread_note(req: Request, key: str, counts: np.ndarray, values: list[str]) -> str:
    """The `explain` line for a gang that would fit if it could spread over values of `key`."""
    head = f"topology: no {req.gang_nodes} nodes with room share one value of {key}"
    if not len(counts) or counts.max() == 0:
        return f"{head} (no node with room has the label {key})"
    best = int(np.argmax(counts))  # ties to the first value seen: deterministic
    return f"{head} (best: {key}={values[best]} has {int(counts[best])})"


def why_spread(sched: Scheduler, state: ClusterState, req: Request) -> str | None:
    """When a `colocate` gang waits only because of that rule, the line that says so; else None."""
    if req.colocate is None or req.gang_nodes < 2:
        return None
    free = replace(req, colocate=None)
    if not sched.place(state, free, observe=False, explain=False).ok:
        return None
    counts, _, values = room_by_value(sched, state, req, req.colocate)
    return spread_note(req, req.colocate, counts, values)


def link_spread(state: ClusterState, nodes: np.ndarray, req: Request) -> np.ndarray:
    """Per node of `nodes`, the fewest NVLink groups holding `req.gpu_count` of its usable devices.

    The smallest m whose m largest groups (counting usable devices only) hold the request; a
    device with no known group is a group of its own. More than the device count where none fit.
    """
    assert state.gpu_link is not None
    usable = device_need(state, state.node_view().take(nodes), req).usable
    g = usable.shape[1]
    link = state.gpu_link[nodes]
    gid = np.where(link >= 0, link, -1 - np.arange(g, dtype=np.int64))
    same = (gid[:, :, None] == gid[:, None, :]) & usable[:, :, None] & usable[:, None, :]
    first = usable & ~np.tril(same, -1).any(axis=2)  # one device stands for its group
    sizes = -np.sort(-np.where(first, same.sum(axis=2), 0), axis=1)  # group sizes, largest first
    return (np.cumsum(sizes, axis=1) < req.gpu_count).sum(axis=1) + 1


def prefer_linked(state: ClusterState, req: Request, vals: np.ndarray, argmax: bool = True) -> np.ndarray:
    """Node scores (−inf: infeasible) keeping only the nodes where the request spans fewest groups.

    A lexicographic rule before the policy's score: it applies only to a request for several
    devices on a node in a pool where some device reports a group, so every other choice is the
    policy's own. It is a preference: a node is never made infeasible by it alone. `argmax`: the
    caller takes the best score, so when that node holds the request in one group nothing else
    needs a look (the common case, one row instead of every feasible node).
    """
    if req.gpu_count < 2 or state.gpu_link is None:
        return vals
    cand = np.flatnonzero(np.isfinite(vals))
    if len(cand) < 2:
        return vals
    if argmax and link_spread(state, np.array([int(np.argmax(vals))]), req)[0] == 1:
        return vals
    spread = link_spread(state, cand, req)
    worse = spread > spread.min()
    if not worse.any():
        return vals
    out = vals.copy()
    out[cand[worse]] = -np.inf
    return out
