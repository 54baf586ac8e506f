"""The fill-up protocol of the FGD study: pods arrive, never leave, and fail if they do not fit.

Order: pods sorted by name, shuffled with the seed; then copies drawn at random from the
name-sorted list are appended until the GPU request reaches `tune × capacity` (the reference
compares the running total plus the copy's per-device milli against the target, which we
keep). Nodes get a random rank from the same seed; ties between equal scores go to the lowest
rank, as the reference renames nodes with a random prefix and picks the smallest name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from computepool.core.resources import Node
from computepool.scheduler.fragmentation import TypicalPods, frag_amount
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState
from computepool.sim.alibaba import Pod
from computepool.sim.energy import power_model, snapshot_energy
from computepool.sim.prices import Prices

Progress = Callable[[int, int], None]


def arrival_order(pods: list[Pod], seed: int, tune: float, capacity_milli: int) -> list[Pod]:
    """Seeded shuffle of the name-sorted pods, inflated with random copies to `tune × capacity`."""
    rng = np.random.default_rng(seed)
    ordered = sorted(pods, key=lambda p: p.name)
    shuffled = [ordered[i] for i in rng.permutation(len(ordered))]
    total = sum(p.gpu_milli_total for p in ordered)
    target = tune * capacity_milli
    while total > 0:  # a workload without GPU requests cannot be inflated by GPU demand
        cand = ordered[int(rng.integers(len(ordered)))]
        if total + cand.request.gpu_milli > target:
            break
        shuffled.append(cand)
        total += cand.gpu_milli_total
    return shuffled


def node_ranks(n: int, seed: int) -> np.ndarray:
    """A random rank per node (the tie-break order), drawn after the arrival order."""
    rng = np.random.default_rng([seed, 1])
    return rng.permutation(n)


def discretise(arrived: np.ndarray, values: np.ndarray, upto: int = 130) -> list[float | None]:
    """Mean of `values` over events whose arrived % rounds to each integer 0..upto.

    An integer with no event takes the mean over events within ±1 of it (as published).
    """
    ratio = np.round(arrived)
    out: list[float | None] = []
    for a in range(upto + 1):
        sel = ratio == a
        if not sel.any():
            sel = (ratio >= a - 1) & (ratio <= a + 1)
        out.append(round(float(values[sel].mean()), 2) if sel.any() else None)
    return out


@dataclass
class FillResult:
    policy: str
    seed: int
    tune: float
    workload: str
    unallocated_pct_at_100: float
    unallocated_pct_at_130: float
    frag_rate_pct_at_90: float
    pods_arrived: int
    pods_failed: int
    offline_ffd_unallocated_pct: float
    lower_bound_unallocated_pct: float
    elapsed_s: float
    curve: list[list[float]]
    frag_curve: list[list[float]] = field(default_factory=list)
    frag_rate_curve: list[list[float]] = field(default_factory=list)
    first_failure: str = ""
    energy: dict[str, object] = field(default_factory=dict)

    def summary(self) -> dict[str, object]:
        """Every figure; `frag_curve` (fragmentation, % of capacity) and `frag_rate_curve` (% of
        idle GPU milli) are, like `curve`, lists of [arrived %, value]."""
        return dict(self.__dict__)


class _FragMeter:
    """Cluster fragmentation against fixed typical pods, kept per node and updated per change."""

    def __init__(self, state: ClusterState, typical: TypicalPods) -> None:
        self.state = state
        self.typical = typical
        self.table = typical.access(state.models).T
        self.per_node = self._frag(np.arange(state.n_nodes))
        self.total = float(self.per_node.sum())

    def _frag(self, nodes: np.ndarray) -> np.ndarray:
        st = self.state
        return frag_amount(
            st.cpu_free[nodes], st.gpu_free[nodes], self.table[st.gpu_model[nodes]], self.typical
        )

    def update(self, nodes: list[int]) -> None:
        idx = np.array(nodes, dtype=np.int64)
        new = self._frag(idx)
        self.total += float(new.sum() - self.per_node[idx].sum())
        self.per_node[idx] = new


def offline_ffd_milli(pods: list[Pod], nodes: list[Node]) -> int:
    """GPU milli a clairvoyant first-fit-decreasing packer places, knowing all pods up front.

    Like the published reference point it ignores CPU, memory and arrival order: whole-device
    pods take idle devices, then fractional pods go largest first onto the first device that
    still has room.
    """
    free = np.array([d.compute_milli for n in nodes for d in n.devices], dtype=np.int64)
    placed = 0
    whole = sorted(
        (p.request.gpu_count for p in pods if p.gpu_milli_total and not p.request.fractional),
        reverse=True,
    )
    idle = len(free)
    for k in whole:
        if k <= idle:
            idle -= k
            placed += k * 1000
    free = free[:idle].copy()
    frac = sorted((p.request.gpu_milli for p in pods if p.request.fractional), reverse=True)
    for m in frac:
        if len(free) == 0:
            break
        j = int(np.argmax(free >= m))
        if free[j] >= m:
            free[j] -= m
            placed += m
    return placed


def lower_bound_unallocated_milli(pods: list[Pod], capacity_milli: int) -> int:
    """A floor on the GPU milli that must stay unallocated once these pods have arrived.

    A pod of m > 500 milli sits alone on its device and leaves a gap g = 1000 − m that only
    pods of at most g milli can fill. Take the big pods whose gap is at most t, and the small
    pods of at most t milli (total F). If the big pods in a set U are left out, unallocated
    capacity is at least max(Σ_placed g − F, C − D + Σ_U m), where C is capacity and D demand
    (unallocated = C − D + unplaced demand). Leaving out the pods with the largest gaps first is
    the cheapest way to lower the first term, and allowing a fraction of a pod out only lowers
    the minimum, so the minimum over that relaxation, maximised over t, is a valid floor.
    """
    frac = np.array([p.request.gpu_milli for p in pods if p.request.fractional], dtype=np.int64)
    demand = sum(p.gpu_milli_total for p in pods)
    slack = capacity_milli - demand
    big_gaps = np.sort(1000 - frac[frac > 500])[::-1]  # largest gap first
    small = np.sort(frac[frac <= 500])
    best = float(max(0, slack))
    for t in np.unique(big_gaps):
        gaps = big_gaps[big_gaps <= t]  # still largest first
        fill = float(small[small <= t].sum())
        a = float(gaps.sum()) - fill  # unfilled gaps if all are placed
        b = float(slack)  # unallocated from slack if none is left out
        if a <= b:
            best = max(best, b)
            continue
        # leave out pods one by one: a drops by g, b rises by m = 1000 − g; stop where they cross
        da = np.cumsum(gaps).astype(float)
        db = np.cumsum(1000 - gaps).astype(float)
        a_k = a - da
        b_k = b + db
        k = int(np.searchsorted(-(a_k - b_k), 0))  # first k where a_k <= b_k
        if k >= len(gaps):
            best = max(best, float(max(a_k[-1], b_k[-1])))
            continue
        a_prev = a if k == 0 else a_k[k - 1]
        b_prev = b if k == 0 else b_k[k - 1]
        g = float(gaps[k])
        frac_x = (a_prev - b_prev) / (g + (1000.0 - g))  # share of pod k left out at the crossing
        best = max(best, a_prev - frac_x * g)
    return max(0, int(np.floor(best)))


def device_models(state: ClusterState) -> list[str]:
    """The model of every device of `state`, in the row-major order of its device arrays."""
    present = state.gpu_cap > 0
    return [state.models[int(i)] for i in state.gpu_model[present]]


def fill_energy(
    state: ClusterState,
    snapshots: dict[str, tuple[np.ndarray, np.ndarray]],
    prices: Prices,
    empty_powered: bool,
) -> dict[str, object]:
    """Energy and cost per hour of each snapshot (held, used milli per device), and the model."""
    present = state.gpu_cap > 0
    models = device_models(state)
    out: dict[str, object] = {
        "power_model": power_model(models, empty_powered),
        "prices": prices.as_dict(models),
    }
    for name, (held, used) in snapshots.items():
        e = snapshot_energy(
            models, state.gpu_cap[present], held[present], used[present], prices, empty_powered=empty_powered
        )
        out[name] = e.as_dict()
    return out


def run_fill(
    nodes: list[Node],
    pods: list[Pod],
    policy: str,
    seed: int,
    *,
    tune: float = 1.3,
    workload: str = "",
    progress: Progress | None = None,
    offline: bool = True,
    prices: Prices | None = None,
    empty_powered: bool = True,
) -> FillResult:
    """Run the fill-up protocol once and measure allocation and fragmentation as pods arrive.

    Energy and cost are per hour of the placement at arrived = 100% and at the end (pods never
    leave, so a placement is a steady state); a device draws at the share its pods hold.
    """
    t0 = time.perf_counter()
    typical = TypicalPods.from_requests(p.request for p in pods)
    ranks = node_ranks(len(nodes), seed)
    ranked = [nodes[i] for i in np.argsort(ranks)]
    state = ClusterState.from_nodes(ranked)
    cap = state.gpu_capacity_milli()
    order = arrival_order(pods, seed, tune, cap)
    sched = Scheduler(make_scorer(policy, seed=seed, typical=typical))
    meter = _FragMeter(state, typical)

    n = len(order)
    arrived = np.zeros(n + 1)
    alloc = np.zeros(n + 1)
    frag = np.zeros(n + 1)
    idle = np.zeros(n + 1)
    arrived_milli = 0
    placed_milli = 0
    failed = 0
    first_failure = ""
    idle[0] = cap
    frag[0] = meter.total
    upto_100 = n
    held_100: np.ndarray | None = None
    for k, pod in enumerate(order, start=1):
        req = pod.request
        arrived_milli += pod.gpu_milli_total
        if held_100 is None and np.round(100.0 * arrived_milli / cap) > 100:
            held_100 = state.gpu_cap - state.gpu_free  # before this pod: the state at 100%
        d = sched.place(state, req, explain=not first_failure)
        if d.ok:
            sched.commit(state, d)
            placed_milli += pod.gpu_milli_total
            meter.update([pl.node for pl in d.placements])
        else:
            failed += 1
            if not first_failure and d.reasons is not None:
                first_failure = f"{pod.name}: {d.reasons}"
        arrived[k] = 100.0 * arrived_milli / cap
        alloc[k] = 100.0 * placed_milli / cap
        frag[k] = meter.total
        idle[k] = cap - placed_milli
        if upto_100 == n and np.round(arrived[k]) > 100:
            upto_100 = k - 1
        if progress is not None and (k % 256 == 0 or k == n):
            progress(k, n)
    elapsed = time.perf_counter() - t0
    held_end = state.gpu_cap - state.gpu_free
    if held_100 is None:
        held_100 = held_end
    energy = fill_energy(
        state,
        {"at_100": (held_100, held_100), "at_end": (held_end, held_end)},
        prices or Prices(),
        empty_powered,
    )

    alloc_curve = discretise(arrived, alloc)
    frag_pct = 100.0 * frag / cap
    rate = np.divide(100.0 * frag, idle, out=np.zeros_like(frag), where=idle > 0)
    frag_curve = discretise(arrived, frag_pct)
    rate_curve = discretise(arrived, rate)

    ffd = lb = float("nan")
    if offline:
        arrived_pods = order[:upto_100]
        ffd = 100.0 - 100.0 * offline_ffd_milli(arrived_pods, ranked) / cap
        lb = 100.0 * lower_bound_unallocated_milli(arrived_pods, cap) / cap

    def at(curve: list[float | None], a: int) -> float:
        v = curve[a]
        return float("nan") if v is None else float(v)

    return FillResult(
        policy=policy,
        seed=seed,
        tune=tune,
        workload=workload,
        unallocated_pct_at_100=round(100.0 - at(alloc_curve, 100), 2),
        unallocated_pct_at_130=round(100.0 - at(alloc_curve, 130), 2),
        frag_rate_pct_at_90=round(at(rate_curve, 90), 2),
        pods_arrived=n,
        pods_failed=failed,
        offline_ffd_unallocated_pct=round(ffd, 2),
        lower_bound_unallocated_pct=round(lb, 2),
        elapsed_s=round(elapsed, 3),
        curve=[[a, v] for a, v in enumerate(alloc_curve) if v is not None],
        frag_curve=[[a, v] for a, v in enumerate(frag_curve) if v is not None],
        frag_rate_curve=[[a, v] for a, v in enumerate(rate_curve) if v is not None],
        first_failure=first_failure,
        energy=energy,
    )
