"""Searches over many replays: calibrating the load to a published delay, and pooled parity.

Both treat `replay` as a black box and rely on the delay being monotone in what they vary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from computepool.sim.philly import PUBLISHED_AVG_QUEUE_S, JobTrace
from computepool.sim.replay.cluster import gang_shape
from computepool.sim.replay.engine import replay
from computepool.sim.replay.results import Progress, ReplayResult


@dataclass(frozen=True)
class Calibration:
    """The duration scale at which static FIFO's average queueing matches the target."""

    duration_scale: float
    target_avg_queue_s: float
    result: ReplayResult
    iterations: int


def calibrate(
    trace: JobTrace,
    target_avg_queue_s: float = PUBLISHED_AVG_QUEUE_S,
    tolerance: float = 0.005,
    max_iterations: int = 40,
    progress: Progress | None = None,
) -> Calibration:
    """Find the scale where static FIFO's average queueing delay hits the target.

    Static queueing grows monotonically with the scale, so the root is bracketed by doubling
    and then found by regula falsi (Illinois variant) on log(queue) against log(scale).
    """
    runs = 0

    def measure(scale: float) -> tuple[float, ReplayResult]:
        nonlocal runs
        runs += 1
        r = replay(trace, "static", scale)
        if progress is not None:
            progress(f"scale {scale:.4f}: avg queue {r.overall.avg_queue_s:,.0f} s")
        return r.overall.avg_queue_s, r

    def err(q: float) -> float:
        return math.log(max(q, 1e-9) / target_avg_queue_s)

    lo, (qlo, rlo) = 1.0, measure(1.0)
    if abs(err(qlo)) <= tolerance:
        return Calibration(lo, target_avg_queue_s, rlo, runs)
    hi, (qhi, rhi) = lo, (qlo, rlo)
    step = 2.0 if qlo < target_avg_queue_s else 0.5
    while (qhi < target_avg_queue_s) == (qlo < target_avg_queue_s):
        if runs >= max_iterations:
            raise RuntimeError("could not bracket the target queueing delay")
        lo, qlo, rlo = hi, qhi, rhi
        hi *= step
        qhi, rhi = measure(hi)
    a, fa, ra = math.log(lo), err(qlo), rlo
    b, fb, rb = math.log(hi), err(qhi), rhi
    side = 0
    while runs < max_iterations:
        c = (a * fb - b * fa) / (fb - fa) if fb != fa else (a + b) / 2
        qc, rc = measure(math.exp(c))
        fc = err(qc)
        if abs(fc) <= tolerance:
            return Calibration(math.exp(c), target_avg_queue_s, rc, runs)
        if (fc > 0) == (fb > 0):
            b, fb, rb = c, fc, rc
            if side == -1:
                fa /= 2
            side = -1
        else:
            a, fa, ra = c, fc, rc
            if side == 1:
                fb /= 2
            side = 1
    best = min(((fa, a, ra), (fb, b, rb)), key=lambda x: abs(x[0]))
    return Calibration(math.exp(best[1]), target_avg_queue_s, best[2], runs)


@dataclass(frozen=True)
class VcComparison:
    """One VC's average queueing delay and JCT: static partition versus pooled."""

    partition: str
    static_avg_queue_s: float
    pooled_avg_queue_s: float
    static_avg_jct_s: float
    pooled_avg_jct_s: float

    @property
    def verdict(self) -> str:
        if self.pooled_avg_queue_s < self.static_avg_queue_s:
            return "gains"
        return "loses" if self.pooled_avg_queue_s > self.static_avg_queue_s else "same"

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "verdict": self.verdict}


def compare(static: ReplayResult, pooled: ReplayResult) -> tuple[VcComparison, ...]:
    """Per-VC comparison of two replays of the same trace."""
    return tuple(
        VcComparison(s.partition, s.avg_queue_s, p.avg_queue_s, s.avg_jct_s, p.avg_jct_s)
        for s, p in zip(static.per_partition, pooled.per_partition, strict=True)
    )


@dataclass(frozen=True)
class Parity:
    """The smallest pooled cluster whose average queueing delay is at most static's."""

    nodes: int | None
    static: ReplayResult
    pooled: ReplayResult | None
    probes: tuple[tuple[int, float], ...]  # (nodes, pooled avg queue) in search order

    @property
    def gpus_saved_pct(self) -> float:
        if self.nodes is None:
            return 0.0
        return 100.0 * (1 - self.nodes / self.static.nodes)

    def per_vc(self) -> tuple[VcComparison, ...]:
        return compare(self.static, self.pooled) if self.pooled is not None else ()


def find_parity(
    trace: JobTrace,
    duration_scale: float = 1.0,
    static: ReplayResult | None = None,
    progress: Progress | None = None,
) -> Parity:
    """Binary-search the node count of a pooled cluster matching static's average queueing.

    The search runs from the biggest gang (so every job can run) to static's node count,
    assuming the pooled delay falls as nodes are added (true in practice, not in theory).
    """
    if static is None:
        static = replay(trace, "static", duration_scale)
    target = static.overall.avg_queue_s
    seen: dict[int, ReplayResult] = {}

    def ok(nodes: int) -> bool:
        r = replay(trace, "pooled", duration_scale, nodes)
        seen[nodes] = r
        if progress is not None:
            progress(f"{nodes} nodes: avg queue {r.overall.avg_queue_s:,.0f} s")
        return r.overall.avg_queue_s <= target

    hi = static.nodes
    lo = max(1, max((gang_shape(int(g))[1] for g in trace.gpus), default=1))
    if not ok(hi):
        return Parity(None, static, seen[hi], ((hi, seen[hi].overall.avg_queue_s),))
    probes: list[int] = [hi]
    while lo < hi:
        mid = (lo + hi) // 2
        probes.append(mid)
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    best = hi
    return Parity(best, static, seen[best], tuple((n, seen[n].overall.avg_queue_s) for n in probes))
