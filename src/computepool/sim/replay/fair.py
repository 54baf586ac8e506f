"""Parity where no VC is worse off: the smallest pool in which every VC waits no longer than alone.

A team that waits longer in the pool than on its own partition will not agree to pool, so the
average over all jobs (`search.find_parity`) is not enough. Here a VC counts as *no worse off*
when both its mean and its 95th-percentile queueing delay (submit to final start, so a
preempted run's time counts as waiting) are at most those of its static partition.

The search steps down from static's size by a tenth of it while every VC stays no worse, then
bisects the last step. Like `find_parity` it assumes fewer nodes never make a VC better off,
which holds in practice; the probes are returned so a reader can see the path.
"""

from __future__ import annotations

from dataclasses import dataclass

from computepool.sim.philly import JobTrace
from computepool.sim.replay.cluster import gang_shape
from computepool.sim.replay.engine import replay
from computepool.sim.replay.results import Progress, ReplayResult

CRITERION = (
    "every VC's mean and 95th-percentile queueing delay (submit to final start, preempted runs "
    "included) at most those of its own static partition"
)


@dataclass(frozen=True)
class VcVerdict:
    """One VC's queueing delay alone and in the pool, and whether it is worse off."""

    partition: str
    static_avg_queue_s: float
    pooled_avg_queue_s: float
    static_p95_queue_s: float
    pooled_p95_queue_s: float

    @property
    def worse(self) -> bool:
        return (
            self.pooled_avg_queue_s > self.static_avg_queue_s
            or self.pooled_p95_queue_s > self.static_p95_queue_s
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "partition": self.partition,
            "static_avg_queue_s": self.static_avg_queue_s,
            "pooled_avg_queue_s": self.pooled_avg_queue_s,
            "static_p95_queue_s": self.static_p95_queue_s,
            "pooled_p95_queue_s": self.pooled_p95_queue_s,
            "worse_off": self.worse,
        }


def verdicts(static: ReplayResult, pooled: ReplayResult) -> tuple[VcVerdict, ...]:
    """Per VC: static against pooled, mean and p95 queueing."""
    return tuple(
        VcVerdict(s.partition, s.avg_queue_s, p.avg_queue_s, s.p95_queue_s, p.p95_queue_s)
        for s, p in zip(static.per_partition, pooled.per_partition, strict=True)
    )


@dataclass(frozen=True)
class FairParity:
    """The smallest pool (nodes) under `policy` where no VC is worse off, or None if none is."""

    policy: str
    nodes: int | None
    static: ReplayResult
    pooled: ReplayResult | None
    probes: tuple[tuple[int, int], ...]  # (nodes, VCs worse off) in search order

    @property
    def gpus_saved_pct(self) -> float:
        if self.nodes is None:
            return 0.0
        return 100.0 * (1 - self.nodes / self.static.nodes)

    def per_vc(self) -> tuple[VcVerdict, ...]:
        return verdicts(self.static, self.pooled) if self.pooled is not None else ()


def find_fair_parity(
    trace: JobTrace,
    duration_scale: float = 1.0,
    policy: str = "guaranteed-share",
    static: ReplayResult | None = None,
    progress: Progress | None = None,
) -> FairParity:
    """The smallest pooled node count under `policy` at which no VC is worse off than static."""
    if static is None:
        static = replay(trace, "static", duration_scale)
    seen: dict[int, ReplayResult] = {}
    probes: list[tuple[int, int]] = []

    def ok(nodes: int) -> bool:
        r = replay(trace, "pooled", duration_scale, nodes, policy=policy)
        seen[nodes] = r
        losers = [v.partition for v in verdicts(static, r) if v.worse]
        probes.append((nodes, len(losers)))
        if progress is not None:
            worse = ", ".join(losers) if losers else "none"
            progress(f"{nodes} nodes ({policy}): VCs worse off: {worse}")
        return not losers

    hi = static.nodes
    floor = max(1, max((gang_shape(int(g))[1] for g in trace.gpus), default=1))
    if not ok(hi):
        return FairParity(policy, None, static, seen[hi], tuple(probes))
    step = max(1, hi // 10)
    lo = hi
    while lo > floor:
        cand = max(floor, hi - step)
        if ok(cand):
            hi = cand
            lo = cand
        else:
            lo = cand + 1
            break
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return FairParity(policy, hi, static, seen[hi], tuple(probes))
