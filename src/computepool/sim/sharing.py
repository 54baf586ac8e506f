"""Static allocation against the pool, on the fill-up protocol.

`static` is how GPUs are handed out without a pool: every GPU request is rounded up to whole
devices and a device is never shared. `pooled` places the actual fractional requests with the
pool's `default` policy. Both see the same pods in the same order on the same cluster.

Energy and cost per hour of each placement (at arrived = 100% and at the end) come from
`sim.energy`: a static device holding a 300-milli request is held whole but works at 30%.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import Request
from computepool.core.resources import Node
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState
from computepool.sim.alibaba import Pod
from computepool.sim.fill import Progress, arrival_order, fill_energy, node_ranks
from computepool.sim.prices import Prices


@dataclass
class SharingResult:
    mode: str
    pods_arrived: int
    pods_placed: int
    pods_failed: int
    requested_gpu_milli_placed: int
    allocated_gpu_milli: int
    idle_gpus: int
    capacity_serving_requests_pct: float
    pods_placed_at_100: int
    capacity_serving_requests_pct_at_100: float
    energy: dict[str, object] = field(default_factory=dict)


def whole_devices(req: Request) -> Request:
    """The static-allocation view of a request: whole devices, never shared."""
    if req.gpu_count == 0 or req.gpu_milli >= MILLI_PER_DEVICE:
        return req
    return dataclasses.replace(req, gpu_milli=MILLI_PER_DEVICE, gpu_memory_mib=None)


def run_mode(
    nodes: list[Node],
    pods: list[Pod],
    mode: str,
    seed: int,
    tune: float = 1.3,
    progress: Progress | None = None,
    prices: Prices | None = None,
    empty_powered: bool = True,
) -> SharingResult:
    ranks = node_ranks(len(nodes), seed)
    state = ClusterState.from_nodes([nodes[i] for i in np.argsort(ranks)])
    cap = state.gpu_capacity_milli()
    order = arrival_order(pods, seed, tune, cap)
    sched = Scheduler(make_scorer("default", seed=seed))
    arrived = served = placed = 0
    placed_100 = served_100 = -1
    used = np.zeros_like(state.gpu_cap)  # milli the requests asked, per device
    snap_100: tuple[np.ndarray, np.ndarray] | None = None
    for k, pod in enumerate(order, start=1):
        req = pod.request if mode == "pooled" else whole_devices(pod.request)
        arrived += pod.gpu_milli_total
        if placed_100 < 0 and arrived > cap:
            placed_100, served_100 = placed, served
            snap_100 = (state.gpu_cap - state.gpu_free, used.copy())
        d = sched.schedule(state, req, explain=False)
        if d.ok:
            placed += 1
            served += pod.gpu_milli_total
            for pl in d.placements:
                for j in pl.devices:
                    used[pl.node, j] += pod.request.gpu_milli
        if progress is not None and (k % 512 == 0 or k == len(order)):
            progress(k, len(order))
    held_end = state.gpu_cap - state.gpu_free
    if placed_100 < 0:
        placed_100, served_100 = placed, served
    if snap_100 is None:
        snap_100 = (held_end, used)
    energy = fill_energy(
        state, {"at_100": snap_100, "at_end": (held_end, used)}, prices or Prices(), empty_powered
    )
    idle = int(((state.gpu_free == state.gpu_cap) & (state.gpu_cap > 0)).sum())
    return SharingResult(
        mode=mode,
        pods_arrived=len(order),
        pods_placed=placed,
        pods_failed=len(order) - placed,
        requested_gpu_milli_placed=served,
        allocated_gpu_milli=state.gpu_allocated_milli(),
        idle_gpus=idle,
        capacity_serving_requests_pct=round(100.0 * served / cap, 2),
        pods_placed_at_100=placed_100,
        capacity_serving_requests_pct_at_100=round(100.0 * served_100 / cap, 2),
        energy=energy,
    )


def static_vs_pooled(
    nodes: list[Node],
    pods: list[Pod],
    seed: int,
    tune: float = 1.3,
    progress: Progress | None = None,
    prices: Prices | None = None,
    empty_powered: bool = True,
) -> dict[str, SharingResult]:
    return {
        m: run_mode(nodes, pods, m, seed, tune, progress, prices, empty_powered) for m in ("static", "pooled")
    }
