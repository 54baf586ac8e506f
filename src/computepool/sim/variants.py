"""Workload variants of the Alibaba pod lists: more CPU-only demand than the published ones.

The published `cpuNNN` lists change the share of CPU-only pods; `scale_cpu_only` goes further
from one of them, so a policy can be tried on a mix heavier in CPU-only work than any published
figure covers. Each CPU-only pod is kept `floor(factor)` times, and a seeded sample of them
(without replacement) once more for the fractional part, so CPU-only demand grows by `factor`
(up to one pod) while the GPU pods stay as they are. Copies get names of their own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from computepool.core.errors import InvalidInput
from computepool.sim.alibaba import Pod


def scale_cpu_only(pods: list[Pod], factor: float, seed: int = 0) -> list[Pod]:
    """`pods` with the CPU-only pods' count (and so their demand) multiplied by `factor` ≥ 1."""
    if not np.isfinite(factor) or factor < 1.0:
        raise InvalidInput("--cpu-only-scale", f"must be a number ≥ 1, got {factor}")
    cpu_only = [p for p in pods if p.request.gpu_count == 0]
    whole = int(np.floor(factor))
    extra = int(round((factor - whole) * len(cpu_only)))
    rng = np.random.default_rng(seed)
    picked = sorted(rng.choice(len(cpu_only), size=extra, replace=False).tolist()) if extra else []
    out = list(pods)
    for copy in range(1, whole):
        out += [_renamed(p, f"x{copy}") for p in cpu_only]
    out += [_renamed(cpu_only[i], f"x{whole}") for i in picked]
    return out


def _renamed(pod: Pod, suffix: str) -> Pod:
    name = f"{pod.name}-{suffix}"
    return Pod(name=name, request=replace(pod.request, name=name))
