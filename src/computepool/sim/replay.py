"""Replay a job trace with queues: static per-VC partitions versus one pooled cluster.

Event-driven: jobs arrive at their submit time, wait in their VC's queue, run for
`duration x duration_scale` on whole GPUs, and leave. A job of up to 8 GPUs takes them on one
8-GPU node; a larger one is a gang of ceil(n/8) whole nodes, bound all-or-nothing (it holds,
and is accounted for, all GPUs of those nodes). Placement consolidates: the node with the
fewest free GPUs that still fits, lowest index on ties (numpy over the free-GPU array).

- `static`: each VC owns its listed nodes; strict FIFO per VC (head-of-line blocking).
- `pooled`: one cluster; each VC is guaranteed its static size (scaled down proportionally,
  largest remainder, when the cluster has fewer GPUs than the VCs' sum; kept as is when it
  has more). Per pass, VCs whose head fits within their guarantee are served first (lowest
  usage/guarantee share first) and may preempt borrowed jobs (`scheduler.queueing`); then
  every other VC may borrow idle GPUs, lowest share first. Inside a VC the order is strict
  FIFO (no backfill: run times are not known in advance in a live pool); a blocked VC never
  blocks another. A preempted job goes back to the head of its VC queue and later restarts
  from scratch; its run so far is lost work.

Jobs that can never fit (bigger than their VC in static, than the cluster in pooled) are
counted as `unplaceable` and left out of every other figure.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

from computepool.scheduler.queueing import (
    Claim,
    Holding,
    Quota,
    QuotaLedger,
    proportional_guarantees,
    select_victims,
)
from computepool.sim.philly import GPUS_PER_NODE, PUBLISHED_AVG_QUEUE_S, JobTrace

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

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            "mode": self.mode,
            "duration_scale": self.duration_scale,
            "nodes": self.nodes,
        }
        o = self.overall.as_dict()
        del o["partition"]
        out.update(o)
        out["per_partition"] = [f.as_dict() for f in self.per_partition]
        return out


class _Nodes:
    """Free GPUs per node (numpy) plus a histogram by free count for O(1) "does it fit"."""

    def __init__(self, count: int, offset: int = 0) -> None:
        self.free = np.full(count, GPUS_PER_NODE, dtype=np.int64)
        self.hist = [0] * GPUS_PER_NODE + [count]
        self.offset = offset

    def fits(self, per_node: int, k: int) -> bool:
        return sum(self.hist[per_node:]) >= k

    def choose(self, per_node: int, k: int) -> tuple[int, ...] | None:
        """Consolidate: nodes with the fewest free GPUs that fit, lowest index on ties."""
        if not self.fits(per_node, k):
            return None
        key = np.where(self.free >= per_node, self.free, GPUS_PER_NODE + 1)
        if k == 1:
            return (int(key.argmin()),)
        return tuple(int(i) for i in np.sort(np.argsort(key, kind="stable")[:k]))

    def take(self, nodes: Iterable[int], per_node: int) -> None:
        for n in nodes:
            f = int(self.free[n])
            if f < per_node:
                raise AssertionError(f"node {n} has {f} free GPUs, needs {per_node}")
            self.hist[f] -= 1
            self.hist[f - per_node] += 1
            self.free[n] = f - per_node

    def give(self, nodes: Iterable[int], per_node: int) -> None:
        for n in nodes:
            f = int(self.free[n])
            self.hist[f] -= 1
            self.hist[f + per_node] += 1
            self.free[n] = f + per_node


def _shape(gpus: int) -> tuple[int, int]:
    """(GPUs per node, nodes): one node up to 8 GPUs, else whole 8-GPU nodes."""
    if gpus <= GPUS_PER_NODE:
        return gpus, 1
    return GPUS_PER_NODE, -(-gpus // GPUS_PER_NODE)


class _Sim:
    """State of one replay; `run()` drives the event loop and returns the result."""

    def __init__(
        self, trace: JobTrace, mode: Mode, duration_scale: float, nodes: int | None, record: bool
    ) -> None:
        if duration_scale <= 0 or not math.isfinite(duration_scale):
            raise ValueError(f"duration_scale {duration_scale} must be a positive number")
        self.trace = trace
        self.mode = mode
        self.scale = duration_scale
        self.record = record
        self.names = [v.name for v in trace.vcs]
        nv = len(self.names)
        self.submit: list[float] = trace.submit.tolist()
        self.dur: list[float] = (trace.duration * duration_scale).tolist()
        self.vc: list[int] = trace.vc.tolist()
        shapes = [_shape(g) for g in trace.gpus.tolist()]
        self.per_node = [s[0] for s in shapes]
        self.k = [s[1] for s in shapes]
        self.held = [a * b for a, b in shapes]
        n = len(self.submit)
        self.start: list[float] = [math.nan] * n
        self.finish: list[float] = [math.nan] * n
        self.npreempt = [0] * n
        self.attempt = [0] * n
        self.where: dict[int, tuple[int, ...]] = {}
        self.queues: list[deque[int]] = [deque() for _ in range(nv)]
        self.busy = [0.0] * nv  # GPU-seconds held, lost runs included
        self.lost = [0.0] * nv
        self.runs: list[Run] = []
        self.heap: list[tuple[float, int, int]] = []
        if mode == "static":
            self.total_nodes = trace.total_nodes
            self.parts: list[_Nodes] = []
            off = 0
            for v in trace.vcs:
                self.parts.append(_Nodes(v.nodes, off))
                off += v.nodes
            self.cap_nodes = [v.nodes for v in trace.vcs]
            self.dirty: set[int] = set()
        elif mode == "pooled":
            self.total_nodes = trace.total_nodes if nodes is None else nodes
            if self.total_nodes <= 0:
                raise ValueError(f"nodes {self.total_nodes} must be positive")
            self.pool = _Nodes(self.total_nodes)
            self.guarantee = proportional_guarantees(
                {v.name: v.gpus for v in trace.vcs}, self.total_nodes * GPUS_PER_NODE
            )
            self.ledger = QuotaLedger({t: Quota(g) for t, g in self.guarantee.items()})
            self.running: list[dict[int, Holding]] = [{} for _ in range(nv)]
            self.cap_nodes = [self.total_nodes] * nv
            self.version = 0
            self.failed: dict[int, tuple[int, int]] = {}
        else:
            raise ValueError(f"mode {mode!r} is not 'static' or 'pooled'")

    # -- state changes ---------------------------------------------------------------------

    def _begin(self, j: int, t: float, nodes: tuple[int, ...]) -> None:
        v = self.vc[j]
        self.queues[v].popleft()
        self.start[j] = t
        self.where[j] = nodes
        self.attempt[j] += 1
        heapq.heappush(self.heap, (t + self.dur[j], j, self.attempt[j]))
        if self.mode == "static":
            self.parts[v].take(nodes, self.per_node[j])
        else:
            self.pool.take(nodes, self.per_node[j])
            self.ledger.allocate(self.names[v], self.held[j])
            pn = self.per_node[j]
            self.running[v][j] = Holding(j, self.names[v], tuple((n, pn) for n in nodes), t)
            self.version += 1

    def _end(self, j: int, t: float, preempted: bool) -> None:
        v = self.vc[j]
        nodes = self.where.pop(j)
        ran = t - self.start[j]
        self.busy[v] += self.held[j] * ran
        if self.record:
            off = self.parts[v].offset if self.mode == "static" else 0
            self.runs.append(
                Run(
                    j,
                    v,
                    self.start[j],
                    t,
                    tuple(n + off for n in nodes),
                    self.per_node[j],
                    preempted,
                )
            )
        if self.mode == "static":
            self.parts[v].give(nodes, self.per_node[j])
            self.dirty.add(v)
        else:
            self.pool.give(nodes, self.per_node[j])
            self.ledger.release(self.names[v], self.held[j])
            del self.running[v][j]
            self.version += 1
        if preempted:
            self.attempt[j] += 1  # its pending finish event is now stale
            self.npreempt[j] += 1
            self.lost[v] += self.held[j] * ran
            self.start[j] = math.nan
        else:
            self.finish[j] = t

    # -- scheduling passes -------------------------------------------------------------------

    def _static_pass(self, t: float) -> None:
        for v in self.dirty:
            q = self.queues[v]
            part = self.parts[v]
            while q:
                j = q[0]
                nodes = part.choose(self.per_node[j], self.k[j])
                if nodes is None:
                    break  # head-of-line blocking: the rest of this VC waits
                self._begin(j, t, nodes)
        self.dirty.clear()

    def _reclaim(self, j: int, t: float) -> tuple[int, ...] | None:
        """Preempt borrowed jobs so that j (within its VC's guarantee) fits; None if it can't."""
        v = self.vc[j]
        key = (j, self.version)
        if self.failed.get(v) == key:
            return None
        budgets = self.ledger.reclaimable(self.names[v], self.held[j])
        cands = [h for u, run in enumerate(self.running) if self.names[u] in budgets for h in run.values()]
        plan = select_victims(
            Claim(self.names[v], self.per_node[j], self.k[j]),
            self.pool.free.tolist(),
            cands,
            budgets,
            t,
        )
        if plan is None:
            self.failed[v] = key
            return None
        for h in sorted(plan.victims, key=lambda h: -h.job):
            self._end(h.job, t, preempted=True)
            self.queues[self.vc[h.job]].appendleft(h.job)
        return plan.nodes

    def _pooled_pass(self, t: float) -> None:
        ledger = self.ledger
        waiting = {v for v, q in enumerate(self.queues) if q}
        if not waiting:
            return
        # Phase 1: VCs whose head fits within their guarantee; they may preempt borrowers.
        blocked: set[int] = set()
        for v in sorted(waiting, key=lambda v: (ledger.share(self.names[v]), v)):
            q = self.queues[v]
            name = self.names[v]
            while q and ledger.within_guarantee(name, self.held[q[0]]):
                j = q[0]
                nodes = self.pool.choose(self.per_node[j], self.k[j])
                if nodes is None:
                    nodes = self._reclaim(j, t)
                    if nodes is None:
                        blocked.add(v)
                        break
                self._begin(j, t, nodes)
        # Phase 2: borrow idle GPUs, lowest share first; a VC that cannot place its head
        # stops (FIFO inside a VC) without stopping the others.
        active = [v for v in waiting if v not in blocked and self.queues[v]]
        while active:
            v = min(active, key=lambda v: (ledger.share(self.names[v]), v))
            j = self.queues[v][0]
            nodes = None
            if ledger.can_admit(self.names[v], self.held[j]):
                nodes = self.pool.choose(self.per_node[j], self.k[j])
            if nodes is None:
                active.remove(v)
                continue
            self._begin(j, t, nodes)
            if not self.queues[v]:
                active.remove(v)

    # -- event loop --------------------------------------------------------------------------

    def run(self) -> ReplayResult:
        n = len(self.submit)
        heap = self.heap
        static = self.mode == "static"
        i = 0
        unplaceable = [False] * n
        while i < n or heap:
            t = min(self.submit[i] if i < n else math.inf, heap[0][0] if heap else math.inf)
            while heap and heap[0][0] <= t:
                _, j, att = heapq.heappop(heap)
                if att == self.attempt[j]:
                    self._end(j, t, preempted=False)
            while i < n and self.submit[i] <= t:
                v = self.vc[i]
                if self.k[i] > self.cap_nodes[v]:
                    unplaceable[i] = True
                else:
                    self.queues[v].append(i)
                    if static:
                        self.dirty.add(v)
                i += 1
            if static:
                self._static_pass(t)
            else:
                self._pooled_pass(t)
        return self._result(np.array(unplaceable, dtype=bool))

    def _result(self, unplaceable: np.ndarray) -> ReplayResult:
        submit = self.trace.submit
        start = np.array(self.start)
        finish = np.array(self.finish)
        npre = np.array(self.npreempt, dtype=np.int64)
        held = np.array(self.held, dtype=np.float64)
        dur = np.array(self.dur)
        vc = self.trace.vc
        done = ~unplaceable
        window = (np.nanmax(finish) - submit.min()) if done.any() else 0.0
        if self.mode == "static":
            cap = [v.gpus for v in self.trace.vcs]
        else:
            cap = [self.guarantee[name] for name in self.names]

        def figures(name: str, mask: np.ndarray, gpus: float, busy: float, lost: float) -> Figures:
            ok = mask & done
            q = start[ok] - submit[ok]
            jct = finish[ok] - submit[ok]
            useful = float((held[ok] * dur[ok]).sum())
            has = q.size > 0
            return Figures(
                partition=name,
                jobs=int(ok.sum()),
                unplaceable=int((mask & unplaceable).sum()),
                avg_queue_s=float(q.mean()) if has else 0.0,
                p50_queue_s=float(np.percentile(q, 50)) if has else 0.0,
                p99_queue_s=float(np.percentile(q, 99)) if has else 0.0,
                avg_jct_s=float(jct.mean()) if has else 0.0,
                gpu_alloc_pct=100.0 * busy / (gpus * window) if gpus and window else 0.0,
                preemptions=int(npre[mask].sum()),
                lost_gpu_hours=lost / 3600.0,
                lost_work_pct=100.0 * lost / useful if useful else 0.0,
            )

        per = tuple(
            figures(name, vc == v, cap[v], self.busy[v], self.lost[v]) for v, name in enumerate(self.names)
        )
        overall = figures(
            "all",
            np.ones(len(vc), dtype=bool),
            self.total_nodes * GPUS_PER_NODE,
            sum(self.busy),
            sum(self.lost),
        )
        return ReplayResult(
            mode=self.mode,
            duration_scale=self.scale,
            nodes=self.total_nodes,
            overall=overall,
            per_partition=per,
            start=start,
            finish=finish,
            preemptions=npre,
            runs=tuple(self.runs),
        )


def replay(
    trace: JobTrace,
    mode: Mode,
    duration_scale: float = 1.0,
    nodes: int | None = None,
    *,
    record: bool = False,
) -> ReplayResult:
    """Replay `trace` in `mode`; `nodes` sizes the pooled cluster (default: same GPUs).

    With `record`, every run (also the preempted ones) is kept in `ReplayResult.runs`.
    """
    if nodes is not None and mode == "static":
        raise ValueError("nodes applies to pooled mode only; static uses the VC sizes")
    return _Sim(trace, mode, duration_scale, nodes, record).run()


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
    lo = max(1, max((_shape(int(g))[1] for g in trace.gpus), default=1))
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
