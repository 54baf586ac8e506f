"""The replay's event loop: arrivals, finishes, static FIFO and pooled passes with preemption.

Pooled policies (how each VC's guarantee is set; everything else is the same):

- `proportional`: guarantees are the VCs' static sizes scaled down to the pool (largest
  remainder), so they sum to the pool's GPUs;
- `guaranteed-share`: every VC keeps its whole static size as its guarantee however small the
  pool, so guarantees may sum to more than the pool. A VC using less than its static share is
  served before any borrower and may preempt work held above another VC's static share; only
  when VCs within their shares together want more than the pool do they wait (lowest share
  first). Preemption never takes a VC below its static share.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from computepool.scheduler.queueing import (
    Claim,
    Holding,
    Quota,
    QuotaLedger,
    proportional_guarantees,
    select_victims,
)
from computepool.sim.philly import GPUS_PER_NODE, JobTrace
from computepool.sim.replay.cluster import Nodes, gang_shape
from computepool.sim.replay.results import Figures, Mode, ReplayResult, Run

POLICIES = ("proportional", "guaranteed-share")


class _Sim:
    """State of one replay; `run()` drives the event loop and returns the result."""

    def __init__(
        self,
        trace: JobTrace,
        mode: Mode,
        duration_scale: float,
        nodes: int | None,
        record: bool,
        policy: str = "proportional",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
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
        shapes = [gang_shape(g) for g in trace.gpus.tolist()]
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
        self.asked = [int(g) for g in trace.gpus.tolist()]
        self.used_s = 0.0  # GPU-seconds asked while running, lost runs included
        self.lost_used_s = 0.0
        self.runs: list[Run] = []
        self.heap: list[tuple[float, int, int]] = []
        if mode == "static":
            self.total_nodes = trace.total_nodes
            self.parts: list[Nodes] = []
            off = 0
            for v in trace.vcs:
                self.parts.append(Nodes(v.nodes, off))
                off += v.nodes
            self.cap_nodes = [v.nodes for v in trace.vcs]
            self.dirty: set[int] = set()
        elif mode == "pooled":
            self.total_nodes = trace.total_nodes if nodes is None else nodes
            if self.total_nodes <= 0:
                raise ValueError(f"nodes {self.total_nodes} must be positive")
            self.pool = Nodes(self.total_nodes)
            sizes = {v.name: v.gpus for v in trace.vcs}
            if policy == "guaranteed-share":
                self.guarantee = sizes
            else:
                self.guarantee = proportional_guarantees(sizes, self.total_nodes * GPUS_PER_NODE)
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
        used = min(self.asked[j], self.held[j]) * ran
        self.used_s += used
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
            self.lost_used_s += used
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
                p95_queue_s=float(np.percentile(q, 95)) if has else 0.0,
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
            policy=self.policy if self.mode == "pooled" else "",
            window_s=float(window),
            used_gpu_s=self.used_s,
            held_gpu_s=float(sum(self.busy)),
            lost_used_gpu_s=self.lost_used_s,
        )


def replay(
    trace: JobTrace,
    mode: Mode,
    duration_scale: float = 1.0,
    nodes: int | None = None,
    *,
    record: bool = False,
    policy: str = "proportional",
) -> ReplayResult:
    """Replay `trace` in `mode`; `nodes` sizes the pooled cluster (default: same GPUs).

    `policy` sets the pooled guarantees (see the module docstring). With `record`, every run
    (also the preempted ones) is kept in `ReplayResult.runs`.
    """
    if nodes is not None and mode == "static":
        raise ValueError("nodes applies to pooled mode only; static uses the VC sizes")
    return _Sim(trace, mode, duration_scale, nodes, record, policy).run()
