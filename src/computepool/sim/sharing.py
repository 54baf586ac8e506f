"""Static allocation against the pool, on the fill-up protocol.

`static` is how GPUs are handed out without a pool: every GPU request is rounded up to whole
devices and a device is never shared. `pooled` places the actual fractional requests with the
pool's `default` policy. Both see the same pods in the same order on the same cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from computepool.core.quantities import MILLI_PER_DEVICE
from computepool.core.request import Request
from computepool.core.resources import Node
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState
from computepool.sim.alibaba import Pod
from computepool.sim.fill import Progress, arrival_order, node_ranks


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
) -> SharingResult:
    ranks = node_ranks(len(nodes), seed)
    state = ClusterState.from_nodes([nodes[i] for i in np.argsort(ranks)])
    cap = state.gpu_capacity_milli()
    order = arrival_order(pods, seed, tune, cap)
    sched = Scheduler(make_scorer("default", seed=seed))
    arrived = served = placed = 0
    placed_100 = served_100 = -1
    for k, pod in enumerate(order, start=1):
        req = pod.request if mode == "pooled" else whole_devices(pod.request)
        arrived += pod.gpu_milli_total
        if placed_100 < 0 and arrived > cap:
            placed_100, served_100 = placed, served
        d = sched.schedule(state, req, explain=False)
        if d.ok:
            placed += 1
            served += pod.gpu_milli_total
        if progress is not None and (k % 512 == 0 or k == len(order)):
            progress(k, len(order))
    if placed_100 < 0:
        placed_100, served_100 = placed, served
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
    )


def static_vs_pooled(
    nodes: list[Node],
    pods: list[Pod],
    seed: int,
    tune: float = 1.3,
    progress: Progress | None = None,
) -> dict[str, SharingResult]:
    return {m: run_mode(nodes, pods, m, seed, tune, progress) for m in ("static", "pooled")}
