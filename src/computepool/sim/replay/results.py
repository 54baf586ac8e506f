"""Result types of a Philly replay: per-partition figures, recorded runs, the whole result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from computepool.sim.philly import GPUS_PER_NODE

Mode = Literal["static", "pooled"]
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Figures:
    """Queueing, JCT, allocation and preemption figures of one partition (or `all`).

    Queueing is first submit to final start; JCT is submit to finish. `gpu_alloc_pct` is
    GPU-time held (lost runs included) over GPUs x the window from first submit to last
    finish; per partition the GPUs are its static size, or its guarantee when pooled (so a
    borrowing VC can exceed 100%). `lost_work_pct` is lost over useful GPU-time.
    """

    partition: str
    jobs: int
    unplaceable: int
    avg_queue_s: float
    p50_queue_s: float
    p95_queue_s: float
    p99_queue_s: float
    avg_jct_s: float
    gpu_alloc_pct: float
    preemptions: int
    lost_gpu_hours: float
    lost_work_pct: float

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Run:
    """One run of a job (recorded when asked): where, when, and whether it was preempted."""

    job: int
    partition: int
    start: float
    end: float
    nodes: tuple[int, ...]
    gpus_per_node: int
    preempted: bool


@dataclass(frozen=True)
class ReplayResult:
    """Figures of one replay, plus per-job arrays (NaN where a job was unplaceable)."""

    mode: Mode
    duration_scale: float
    nodes: int
    overall: Figures
    per_partition: tuple[Figures, ...]
    start: np.ndarray  # final start, s
    finish: np.ndarray  # s
    preemptions: np.ndarray  # per job
    runs: tuple[Run, ...] = ()
    policy: str = "proportional"  # pooled only: how guarantees were set (`engine.POLICIES`)
    window_s: float = 0.0  # first submit to last finish
    used_gpu_s: float = 0.0  # GPU-seconds jobs asked for while running (lost runs included)
    held_gpu_s: float = 0.0  # GPU-seconds held (a gang holds whole nodes)
    lost_used_gpu_s: float = 0.0  # the part of `used_gpu_s` spent on preempted runs

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode,
            "duration_scale": self.duration_scale,
            "nodes": self.nodes,
        }
        if self.mode == "pooled":
            out["policy"] = self.policy
        o = self.overall.as_dict()
        del o["partition"]
        out.update(o)
        out["per_partition"] = [f.as_dict() for f in self.per_partition]
        return out
