"""Placement: snapshot in, decision out. The one entry point the pool and the simulator share.

For each request: feasibility and score per node class (cached per request kind, so identical
nodes are evaluated once and a placement only invalidates the class of the node it changed),
then the best-scoring schedulable node wins, lowest index on ties (for several devices on one
node in a pool with NVLink groups, among the nodes where they span the fewest groups). A gang
over several nodes is placed member by member and undone whole if any member does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from computepool.core.allocation import Isolation
from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import Request
from computepool.scheduler.filters import (
    DeviceNeed,
    Reasons,
    explain,
    feasible,
    node_feasible,
)
from computepool.scheduler.pickers import mask_to_devices, pick_on_node
from computepool.scheduler.state import Change, ClusterState, tag_of, tier_code
from computepool.scheduler.topology import place_colocated, prefer_linked
from computepool.scheduler.views import View


class Scorer(Protocol):
    """A node score and device choice for one request over feasible nodes (higher wins)."""

    name: str
    node_local: bool  # the score is a function of the node's state and the request alone
    cheap: bool  # scored straight over all nodes; otherwise per node class, cached

    @property
    def random_node(self) -> bool:
        """A random feasible node instead of the best score (`random`)."""
        ...

    @property
    def device_choice(self) -> str:
        """How `pick_on_node` chooses devices on the chosen node: "best", "first" or "random"."""
        ...

    @property
    def rng(self) -> np.random.Generator | None:
        """The generator of the random choices (random scorers only)."""
        ...

    def epoch(self) -> int:
        """Changes whenever cached scores become stale (e.g. a learned distribution moved)."""
        ...

    def observe(self, req: Request) -> None:
        """Called once per arriving request, before it is placed (online learning hook)."""
        ...

    def score(
        self, state: ClusterState, view: View, req: Request, need: DeviceNeed | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Score per row of `view`, and device bitmasks or None to use `pick`.

        Cheap scorers get every node and `need=None`; infeasible rows are masked afterwards.
        """
        ...

    def pick(self, view: View, req: Request, need: DeviceNeed) -> np.ndarray:
        """Device bitmask per row, when `score` does not choose devices itself."""
        ...


@dataclass
class Placement:
    """One node's part of a decision."""

    node: int
    node_name: str
    devices: list[int]
    change: Change
    score: float


@dataclass
class Decision:
    """The outcome for one request: placements (one per gang member), or why it failed."""

    request: Request
    placements: list[Placement] = field(default_factory=list)
    reasons: Reasons | None = None

    @property
    def ok(self) -> bool:
        return self.reasons is None


@dataclass
class _KindCache:
    epoch: int
    score: np.ndarray  # per class id: score, -inf when infeasible
    pick: np.ndarray  # per class id: device bitmask
    stamp: np.ndarray  # per class id: stamp of the class instance scored (0: none)
    node_score: np.ndarray | None = None  # per node, as of `synced` (read-only for callers)
    node_pick: np.ndarray | None = None
    synced: int = -1  # position in the state's change log the node arrays reflect


class Scheduler:
    """Places requests with one scoring policy. Deterministic for a given snapshot and seed."""

    def __init__(self, scorer: Scorer, *, cache: bool = True, max_cached_kinds: int = 4096) -> None:
        self.scorer = scorer
        self.direct = scorer.cheap
        self._argmax = not scorer.random_node  # `_choose` takes the best score
        self.use_cache = cache and scorer.node_local
        self.max_cached_kinds = max_cached_kinds
        self._cache: dict[tuple, _KindCache] = {}
        self._cache_owner: str | None = None

    # --- scoring ---------------------------------------------------------------------------
    def _best_direct(
        self, state: ClusterState, req: Request, excluded: list[int], within: np.ndarray | None = None
    ) -> tuple[int, float, int]:
        """Cheap scorers: feasibility and score straight over all nodes; devices for the winner."""
        ok = node_feasible(state, req)
        if within is not None:
            ok &= within
        if excluded:
            ok[excluded] = False
        if not ok.any():
            return -1, -np.inf, 0
        view = state.node_view()
        scores, _ = self.scorer.score(state, view, req, None)
        scores = prefer_linked(state, req, np.where(ok, scores, -np.inf), self._argmax)
        j = self._choose(scores)
        mask = pick_on_node(state, j, req, self.scorer.device_choice, self.scorer.rng)
        return j, float(scores[j]), mask

    def _best_cached(
        self, state: ClusterState, req: Request, excluded: list[int], within: np.ndarray | None = None
    ) -> tuple[int, float, int]:
        """Costly scorers: score each node class once per request kind, cache, pick the best node."""
        vals, picks = self._scores_for_nodes(state, req)
        ok = state.eligible(req) & (state.mem_free >= req.memory_mib)
        if within is not None:
            ok &= within
        vals = np.where(ok, vals, -np.inf)
        if excluded:
            vals[excluded] = -np.inf
        vals = prefer_linked(state, req, vals, self._argmax)
        best = self._choose(vals)
        return best, float(vals[best]), int(picks[best])

    def _scores_for_nodes(self, state: ClusterState, req: Request) -> tuple[np.ndarray, np.ndarray]:
        """Score and device bitmask for every node (−inf where infeasible), via the class cache."""
        cls = state.class_of
        if not self.use_cache:
            uniq, inverse = np.unique(cls, return_inverse=True)
            s, p = self._score_classes(state, uniq, req)
            return s[inverse], p[inverse]
        if self._cache_owner != state.uid:
            self._cache.clear()
            self._cache_owner = state.uid
        key = req.kind_key()
        epoch = self.scorer.epoch()
        entry = self._cache.get(key)
        if entry is None or entry.epoch != epoch:
            if len(self._cache) >= self.max_cached_kinds:
                self._cache.clear()
            entry = _KindCache(epoch, np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64))
            self._cache[key] = entry
        n_cls = state.n_classes
        if len(entry.score) < n_cls:
            grow = max(n_cls, 2 * len(entry.score), 64)
            entry.score = np.resize(entry.score, grow)
            entry.pick = np.resize(entry.pick, grow)
            stamp = np.zeros(grow, np.int64)
            stamp[: len(entry.stamp)] = entry.stamp
            entry.stamp = stamp
        log, base = state.changed, state.changed_base
        behind = base + len(log) - entry.synced
        if entry.node_score is None or entry.synced < base or behind > len(cls) // 4:
            missing = entry.stamp[cls] != state.node_stamp
            if np.logical_or.reduce(missing):
                self._refresh(state, req, entry, cls[missing], state.node_stamp[missing])
            entry.node_score, entry.node_pick = entry.score[cls], entry.pick[cls]
        elif behind:
            # only the nodes whose class changed since this kind was last placed (a node may repeat)
            nodes = np.array(log[entry.synced - base :], dtype=np.int64)
            ids = cls[nodes]
            stamps = state.node_stamp[nodes]
            missing = entry.stamp[ids] != stamps
            if np.logical_or.reduce(missing):
                self._refresh(state, req, entry, ids[missing], stamps[missing])
            entry.node_score[nodes] = entry.score[ids]
            assert entry.node_pick is not None
            entry.node_pick[nodes] = entry.pick[ids]
        entry.synced = base + len(log)
        assert entry.node_pick is not None
        return entry.node_score, entry.node_pick

    def _refresh(
        self, state: ClusterState, req: Request, entry: _KindCache, ids: np.ndarray, stamps: np.ndarray
    ) -> None:
        """Score the classes `ids` (repeats allowed) and remember the stamps they were scored at."""
        ids, first = np.unique(ids, return_index=True)
        stamps = stamps[first]
        s, p = self._score_classes(state, ids, req)
        entry.score[ids] = s
        entry.pick[ids] = p
        entry.stamp[ids] = stamps

    def _score_classes(
        self, state: ClusterState, classes: np.ndarray, req: Request
    ) -> tuple[np.ndarray, np.ndarray]:
        view = state.class_view(classes)
        ok_mask, need = feasible(state, view, req, host_memory=False)  # checked per node
        score = np.full(len(classes), -np.inf)
        pick = np.zeros(len(classes), np.int64)
        if np.logical_and.reduce(ok_mask):  # the common case: no rows to take out
            s, p = self.scorer.score(state, view, req, need)
            return s.astype(np.float64, copy=False), self.scorer.pick(view, req, need) if p is None else p
        if np.logical_or.reduce(ok_mask):
            ok = np.flatnonzero(ok_mask)
            sub, sub_need = view.take(ok), _take_need(need, ok)
            s, p = self.scorer.score(state, sub, req, sub_need)
            score[ok] = s
            pick[ok] = self.scorer.pick(sub, req, sub_need) if p is None else p
        return score, pick

    # --- placing ---------------------------------------------------------------------------
    def place(
        self,
        state: ClusterState,
        req: Request,
        *,
        observe: bool = True,
        explain: bool = True,
        within: np.ndarray | None = None,
    ) -> Decision:
        """Decide where `req` goes. The state is left as it was (use `commit` to apply).

        A failed decision carries the reasons per node; `explain=False` skips counting them
        (a simulator that only needs to know it failed) and leaves a one-line reason.
        `within` keeps the placement to those nodes (a preference tier, see constraints.py).
        """
        if observe:
            self.scorer.observe(req)
        if req.tier == Isolation.MIG and req.mig_profile is None:
            return self._place_smallest_mig(state, req, explain, within)
        if req.gang_nodes > 1 and (req.colocate or state.topology_label):
            return place_colocated(self, state, req, explain, within)
        return self._place_members(state, req, explain, within)

    def feasible_nodes(
        self, state: ClusterState, req: Request, within: np.ndarray | None = None
    ) -> np.ndarray:
        """Per node: could one member of `req` go there now (the same test as placing it)?"""
        if self.direct:
            ok = node_feasible(state, req)
        else:
            vals, _ = self._scores_for_nodes(state, req)
            ok = np.isfinite(vals) & state.eligible(req) & (state.mem_free >= req.memory_mib)
        return ok & within if within is not None else ok

    def _place_smallest_mig(
        self, state: ClusterState, req: Request, explain: bool, within: np.ndarray | None
    ) -> Decision:
        """`isolation=mig` without a profile: the smallest profile with a fitting free instance."""
        for profile in state.profiles_by_size():
            d = self._place_members(state, replace(req, mig_profile=profile), False, within)
            if d.ok:
                d.request = req
                return d
        reasons = (
            self._explain(state, req, 0)
            if explain
            else Reasons(state.n_nodes, notes=["no node fits (not explained)"])
        )
        return Decision(request=req, reasons=reasons)

    def place_members(
        self, state: ClusterState, req: Request, explain: bool, within: np.ndarray | None
    ) -> Decision:
        """Members on distinct nodes, best first (the order is the gang's rank order), all or none."""
        return self._place_members(state, req, explain, within)

    def _place_members(
        self, state: ClusterState, req: Request, explain: bool, within: np.ndarray | None
    ) -> Decision:
        decision = Decision(request=req)
        used: list[int] = []
        for _member in range(req.gang_nodes):
            if self.direct:
                best, score, mask = self._best_direct(state, req, used, within)
            else:
                best, score, mask = self._best_cached(state, req, used, within)
            if best < 0 or not np.isfinite(score):
                for pl in reversed(decision.placements):
                    state.undo(pl.change)
                decision.placements = []
                decision.reasons = (
                    self._explain(state, req, len(used))
                    if explain
                    else Reasons(state.n_nodes, notes=["no node fits (not explained)"])
                )
                return decision
            if req.gpu_count > 1 and state.gpu_link is not None and not self.direct:
                mask = pick_on_node(state, best, req) or mask  # devices of one NVLink group first
            pl = self._placement(state, req, best, mask, score)
            decision.placements.append(pl)
            used.append(best)
            if req.gang_nodes > 1:
                state.apply(pl.change)  # later members must see earlier ones
        if req.gang_nodes > 1:
            for pl in reversed(decision.placements):
                state.undo(pl.change)
        return decision

    def _choose(self, vals: np.ndarray) -> int:
        """Highest score, lowest index on ties; a random feasible node for `random`."""
        rng = self.scorer.rng
        if self.scorer.random_node and rng is not None:
            ok = np.flatnonzero(np.isfinite(vals))
            if len(ok):
                return int(ok[rng.integers(len(ok))])
        return int(np.argmax(vals))

    def _explain(self, state: ClusterState, req: Request, placed_members: int) -> Reasons:
        reasons = explain(state, req)
        if req.gang_nodes > 1:
            reasons.notes.append(f"gang needs {req.gang_nodes} nodes, only {placed_members} fit")
        return reasons

    def _placement(self, state: ClusterState, req: Request, node: int, mask: int, score: float) -> Placement:
        devices = mask_to_devices(mask)
        gpu_milli: dict[int, int] = {}
        gpu_mem: dict[int, int] = {}
        for j in devices:
            cap = int(state.gpu_cap[node, j])
            mem_cap = int(state.gpu_mem_cap[node, j])
            if req.whole_devices:
                gpu_milli[j] = cap
                gpu_mem[j] = mem_cap
            else:
                gpu_milli[j] = req.gpu_milli
                gpu_mem[j] = (
                    (mem_cap * req.gpu_milli) // MILLI_PER_DEVICE
                    if req.gpu_memory_mib is None
                    else req.gpu_memory_mib
                )
        change = Change(
            node=node,
            cpu_milli=req.cpu_milli,
            memory_mib=req.memory_mib,
            gpu_milli=gpu_milli,
            gpu_memory_mib=gpu_mem,
            tag=tag_of(req.gpu_count, req.fractional),
            tier=tier_code(req),
            tenant=req.tenant,
        )
        return Placement(node=node, node_name=state.names[node], devices=devices, change=change, score=score)

    @staticmethod
    def commit(state: ClusterState, decision: Decision) -> None:
        for pl in decision.placements:
            state.apply(pl.change)

    @staticmethod
    def release(state: ClusterState, decision: Decision) -> None:
        for pl in decision.placements:
            state.undo(pl.change)

    def schedule(self, state: ClusterState, req: Request, *, explain: bool = True) -> Decision:
        """Place and, when it fits, commit."""
        d = self.place(state, req, explain=explain)
        if d.ok:
            self.commit(state, d)
        return d


def _take_need(need: DeviceNeed, idx: np.ndarray) -> DeviceNeed:
    return DeviceNeed(
        milli=need.milli[idx],
        memory=need.memory[idx],
        allowed=need.allowed[idx],
        usable=need.usable[idx],
    )
