"""A synthetic heterogeneous pool and request mix, for the scheduler benchmark.

Requests keep arriving and the oldest allocations leave once the pool is ~85% allocated, so
the benchmark measures decisions on a busy pool in steady state rather than on an empty or a
full one.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from computepool.core.request import Request
from computepool.core.resources import Device, Node
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState

# (model, memory MiB, host cores, host memory MiB)
NODE_TYPES = [
    ("A100-80GB", 80 * 1024, 128, 1024 * 1024),
    ("H100-80GB", 80 * 1024, 192, 2048 * 1024),
    ("L40S-48GB", 48 * 1024, 64, 512 * 1024),
    ("T4-16GB", 16 * 1024, 48, 256 * 1024),
]


def synthetic_nodes(n: int, gpus_per_node: int, seed: int = 0, link_group_size: int = 0) -> list[Node]:
    """Nodes of the NODE_TYPES at random; with `link_group_size`, devices in NVLink groups of that many."""
    rng = np.random.default_rng(seed)
    nodes = []
    for i in range(n):
        model, mem, cores, host_mem = NODE_TYPES[int(rng.integers(len(NODE_TYPES)))]
        devices = [
            Device(
                index=j,
                vendor="nvidia",
                model=model,
                memory_mib=mem,
                uuid=f"n{i}-g{j}",
                link_group=f"nvl{j // link_group_size}" if link_group_size else "",
            )
            for j in range(gpus_per_node)
        ]
        nodes.append(Node(name=f"node-{i:05d}", cpu_milli=cores * 1000, memory_mib=host_mem, devices=devices))
    return nodes


def synthetic_requests(count: int, seed: int = 1) -> list[Request]:
    """60% fractional, 22% one whole device, 10% 2–8 devices, 5% CPU only, 3% pinned to a model."""
    rng = np.random.default_rng(seed)
    fractions = [100, 200, 250, 300, 500, 700, 800]
    models = [t[0] for t in NODE_TYPES]
    out: list[Request] = []
    kinds = rng.random(count)
    for i in range(count):
        r = kinds[i]
        cpu = int(rng.choice([1000, 2000, 4000, 8000]))
        mem = int(rng.choice([4096, 8192, 16384, 32768]))
        if r < 0.60:
            milli = int(rng.choice(fractions))
            out.append(Request(gpu_count=1, gpu_milli=milli, cpu_milli=cpu, memory_mib=mem, name=f"r{i}"))
        elif r < 0.82:
            out.append(Request(gpu_count=1, gpu_milli=1000, cpu_milli=cpu, memory_mib=mem, name=f"r{i}"))
        elif r < 0.92:
            k = int(rng.choice([2, 4, 8]))
            out.append(
                Request(gpu_count=k, gpu_milli=1000, cpu_milli=cpu * k, memory_mib=mem * k, name=f"r{i}")
            )
        elif r < 0.97:
            out.append(Request(cpu_milli=cpu, memory_mib=mem, name=f"r{i}"))
        else:
            model = str(rng.choice(models))
            out.append(
                Request(
                    gpu_count=1,
                    gpu_milli=1000,
                    cpu_milli=cpu,
                    memory_mib=mem,
                    models=frozenset({model}),
                    name=f"r{i}",
                )
            )
    return out


@dataclass
class BenchResult:
    policy: str
    nodes: int
    gpus_per_node: int
    requests: int
    placed: int
    failed: int
    released: int
    placements_per_s: float
    decisions_per_s: float
    p50_decision_ms: float
    p99_decision_ms: float
    elapsed_s: float
    final_gpu_alloc_pct: float
    link_group_size: int = 0
    # placed requests of 2..link_group_size devices whose devices span several NVLink groups
    multi_gpu_split: int = 0


def run_bench(
    n_nodes: int,
    gpus_per_node: int,
    n_requests: int,
    policy: str,
    seed: int = 0,
    target_alloc: float = 0.85,
    progress: Callable[[int, int], None] | None = None,
    link_group_size: int = 0,
) -> BenchResult:
    nodes = synthetic_nodes(n_nodes, gpus_per_node, seed, link_group_size)
    reqs = synthetic_requests(n_requests, seed + 1)
    state = ClusterState.from_nodes(nodes)
    sched = Scheduler(make_scorer(policy, seed=seed))
    cap = state.gpu_capacity_milli()
    live: deque[Decision] = deque()
    allocated = 0
    lat = np.zeros(n_requests)
    placed = released = split = 0
    t_start = time.perf_counter()
    for i, req in enumerate(reqs):
        while live and allocated > target_alloc * cap:
            old = live.popleft()
            sched.release(state, old)
            allocated -= old.request.total_gpu_milli
            released += 1
        t0 = time.perf_counter()
        d = sched.schedule(state, req)
        lat[i] = time.perf_counter() - t0
        if d.ok:
            placed += 1
            live.append(d)
            allocated += req.total_gpu_milli
            if 1 < req.gpu_count <= link_group_size:
                split += len({j // link_group_size for j in d.placements[0].devices}) > 1
        if progress is not None and (i % 1000 == 0 or i == n_requests - 1):
            progress(i + 1, n_requests)
    elapsed = time.perf_counter() - t_start
    decide = float(lat.sum())
    return BenchResult(
        policy=policy,
        nodes=n_nodes,
        gpus_per_node=gpus_per_node,
        requests=n_requests,
        placed=placed,
        failed=n_requests - placed,
        released=released,
        placements_per_s=round(n_requests / decide, 1),
        decisions_per_s=round(n_requests / elapsed, 1),
        p50_decision_ms=round(float(np.percentile(lat, 50)) * 1000, 3),
        p99_decision_ms=round(float(np.percentile(lat, 99)) * 1000, 3),
        elapsed_s=round(elapsed, 2),
        final_gpu_alloc_pct=round(100.0 * state.gpu_allocated_milli() / cap, 2),
        link_group_size=link_group_size,
        multi_gpu_split=split,
    )
