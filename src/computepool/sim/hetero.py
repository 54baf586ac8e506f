"""A heterogeneous cluster (V100, P100, K80) replayed under the pool's agnostic policy and the aware one.

Jobs arrive, each needs `scale_factor` GPUs of ONE type and runs `total_steps` at the steps/s it has
alone on that type (Gavel's measurements; co-location is not modelled). The GPUs sit on nodes of
`gpus_per_node` devices of one type, placed by the live pool's `Scheduler` with its `default`
policy; a job wider than a node is a gang of whole-node shares.

- `agnostic`, the pool today: every GPU is equal. Waiting jobs are served in the pool's queue order
  (priority, then age), each starts as soon as the scheduler finds it room on any GPUs, and runs to
  the end where it landed (no preemption: the pool preempts only across tenants).
- `aware`: rounds of `round_s` (Gavel's 6 minutes). Each round the pool's shares are Gavel's
  heterogeneity-aware max-min fairness over the jobs present (`scheduler.hetero`), one round's
  type per job follows from them, and the jobs it moves or stops are preempted at the round's
  end. A job (re)starting on a type, and every job's first start under either policy, loses
  `restart_s` to restore its checkpoint and warm up. A job finishing mid-round leaves its GPUs idle
  until the round ends; a job arriving mid-round waits for the next one.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

import numpy as np

from computepool.core.request import Request
from computepool.core.resources import Device, Node
from computepool.scheduler.hetero import HJob, Speeds, assign_round, max_min_shares, queue_order
from computepool.scheduler.placement import Decision, Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.state import ClusterState
from computepool.sim.gavel import GavelDataError, TraceJob

ROUND_S = 360.0
RESTART_S = 10.0


@dataclass(frozen=True)
class SimJob:
    """A trace job ready to replay: its GPUs as placed (gang shape) and its speed on each type."""

    id: int
    line: int
    job_type: str
    steps: int
    arrival: float
    scale_factor: int
    held: int  # GPUs it holds (a gang's shares round up: 20 on nodes of 8 hold 3 × 7)
    request: Request
    speeds: dict[str, float]
    weight: float
    measured: bool  # speeds measured at this scale factor (else scaled from one GPU)

    def hjob(self) -> HJob:
        return HJob(self.id, self.held, self.speeds, self.weight, self.arrival)


@dataclass(frozen=True)
class Segment:
    """A stretch a job held `gpus` GPUs of one type; the first `overhead` seconds did no steps."""

    job: int
    gpu_type: str
    start: float
    end: float
    gpus: int
    overhead: float


@dataclass
class PolicyResult:
    policy: str
    jobs: int
    completed: int
    avg_jct_s: float
    p99_jct_s: float
    makespan_s: float
    utilization: float
    preemptions: int
    finish: dict[int, float] = field(default_factory=dict, repr=False)
    segments: list[Segment] = field(default_factory=list, repr=False)

    def over(self, jobs: list[SimJob]) -> PolicyResult:
        """The JCT figures over `jobs` only (a steady-state window); the rest unchanged."""
        jct = np.array([self.finish[j.id] - j.arrival for j in jobs if j.id in self.finish])
        return replace(
            self,
            avg_jct_s=float(jct.mean()) if jct.size else 0.0,
            p99_jct_s=float(np.percentile(jct, 99)) if jct.size else 0.0,
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "completed": self.completed,
            "avg_jct_s": round(self.avg_jct_s, 1),
            "p99_jct_s": round(self.p99_jct_s, 1),
            "makespan_s": round(self.makespan_s, 1),
            "utilization": round(self.utilization, 4),
            "preemptions": self.preemptions,
        }


def gang_request(gpus: int, gpus_per_node: int, models: frozenset[str] | None = None) -> Request:
    """`gpus` whole GPUs on one node, or a gang of equal shares of whole nodes, of `models`."""
    nodes = math.ceil(gpus / gpus_per_node)
    return Request(gpu_count=math.ceil(gpus / nodes), gpu_milli=1000, gang_nodes=nodes, models=models)


def build_jobs(
    trace: list[TraceJob], where: str, speeds: Speeds, capacity: dict[str, int], gpus_per_node: int
) -> tuple[list[SimJob], int]:
    """The trace's jobs that fit some type of the cluster (ids by arrival), and how many do not."""
    known = speeds.job_types()
    out: list[SimJob] = []
    dropped = 0
    for tj in sorted(trace, key=lambda x: (x.arrival_s, x.line)):
        if tj.job_type not in known:
            raise GavelDataError(f"{where}:{tj.line}: job type {tj.job_type!r} has no measured throughput")
        rates, measured = speeds.of(tj.job_type, tj.scale_factor)
        req = gang_request(tj.scale_factor, gpus_per_node)
        held = req.gpu_count * req.gang_nodes
        fits = [t for t, n in capacity.items() if _room(n, gpus_per_node, req) and rates.get(t, 0.0) > 0]
        if not fits:
            dropped += 1
            continue
        if len(fits) < len(capacity):  # some type cannot hold it (memory: 0 steps/s; or too few nodes)
            req = gang_request(tj.scale_factor, gpus_per_node, frozenset(fits))
            rates = {t: v if t in fits else 0.0 for t, v in rates.items()}
        out.append(
            SimJob(
                len(out), tj.line, tj.job_type, tj.total_steps, tj.arrival_s, tj.scale_factor,
                held, req, rates, tj.priority, measured,
            )
        )  # fmt: skip
    return out, dropped


def _room(gpus: int, gpus_per_node: int, req: Request) -> bool:
    """Whether `gpus` GPUs on nodes of `gpus_per_node` (the last one smaller) can ever hold `req`."""
    sizes = [min(gpus_per_node, gpus - i) for i in range(0, gpus, gpus_per_node)]
    return sum(n >= req.gpu_count for n in sizes) >= req.gang_nodes


def retime(jobs: list[SimJob], rate_per_h: float, seed: int, sample: int | None = None) -> list[SimJob]:
    """The same jobs, in order, arriving as a Poisson stream of `rate_per_h` jobs an hour from 0.

    With `sample`, that many jobs drawn from `jobs` with replacement (a continuous trace of the
    same job mix, as long as asked for), ids renumbered by arrival.
    """
    rng = np.random.default_rng(seed)
    if sample is not None:
        picks = rng.integers(0, len(jobs), size=sample)
        jobs = [SimJob(**{**jobs[int(p)].__dict__, "id": i}) for i, p in enumerate(picks)]
    gaps = rng.exponential(3600.0 / rate_per_h, size=len(jobs))
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    return [SimJob(**{**j.__dict__, "arrival": float(t)}) for j, t in zip(jobs, times, strict=True)]


class _Pool:
    """The cluster as the live scheduler sees it: nodes of one GPU type each."""

    def __init__(self, capacity: dict[str, int], gpus_per_node: int) -> None:
        nodes: list[Node] = []
        self.node_type: list[str] = []
        for t, n in capacity.items():
            for first in range(0, n, gpus_per_node):
                k = min(gpus_per_node, n - first)
                devs = [Device(d, "nvidia", t, 16384, f"{t}-{first + d}") for d in range(k)]
                nodes.append(Node(f"{t}-{first // gpus_per_node:03d}", 64000, 1 << 20, devs))
                self.node_type.append(t)
        self.state = ClusterState.from_nodes(nodes)
        self.sched = Scheduler(make_scorer("default"))
        self.gpus_per_node = gpus_per_node
        self.types = list(capacity)

    def place(self, job: SimJob) -> tuple[Decision, str] | None:
        """Where the scheduler puts the job, blind to speed. A node has one type; a gang, which the
        scheduler would spread over any nodes, is tried on one type at a time, the type with the
        most idle GPUs first (a job never mixes types). A job that cannot run on a type at all
        (Gavel measured 0 steps/s: out of memory) asks for the others, as its memory need would."""
        if job.request.gang_nodes == 1:
            reqs = [job.request]
        else:
            idle = dict.fromkeys(self.types, 0)
            for t, n in zip(self.node_type, self.state.idle_devices, strict=True):
                idle[t] += int(n)
            allowed = [t for t in self.types if job.request.models is None or t in job.request.models]
            order = sorted(allowed, key=lambda t: -idle[t])
            reqs = [gang_request(job.scale_factor, self.gpus_per_node, frozenset({t})) for t in order]
        for req in reqs:
            d = self.sched.place(self.state, req, observe=False, explain=False)
            if d.ok:
                Scheduler.commit(self.state, d)
                types = {self.node_type[p.node] for p in d.placements}
                assert len(types) == 1, "a job's GPUs span device types"
                return d, types.pop()
        return None

    def release(self, d: Decision) -> None:
        Scheduler.release(self.state, d)


class _TypedNodes:
    """Free GPUs per node of each type, for the aware policy's rounds (whole GPUs only, so a count
    per node is the whole state; the rounds re-place thousands of jobs, too many for the live
    `Scheduler`'s scoring): a job takes the nodes of its type with the fewest GPUs left that hold
    its share (best fit)."""

    def __init__(self, capacity: dict[str, int], gpus_per_node: int) -> None:
        self.free = {
            t: [min(gpus_per_node, n - i) for i in range(0, n, gpus_per_node)] for t, n in capacity.items()
        }

    def place(self, job: SimJob, gpu_type: str) -> tuple[tuple[int, int], ...] | None:
        per, k = job.request.gpu_count, job.request.gang_nodes
        free = self.free[gpu_type]
        fits = sorted((f, i) for i, f in enumerate(free) if f >= per)
        if len(fits) < k:
            return None
        taken = tuple((i, per) for _, i in fits[:k])
        for i, c in taken:
            free[i] -= c
        return taken

    def release(self, gpu_type: str, taken: tuple[tuple[int, int], ...]) -> None:
        for i, c in taken:
            self.free[gpu_type][i] += c


def _summary(
    policy: str, jobs: list[SimJob], finish: dict[int, float], segs: list[Segment], total: int, pre: int
) -> PolicyResult:
    jct = np.array([finish[j.id] - j.arrival for j in jobs if j.id in finish])
    start = min((j.arrival for j in jobs), default=0.0)
    end = max(finish.values(), default=start)
    span = end - start
    busy = sum((s.end - s.start) * s.gpus for s in segs)
    return PolicyResult(
        policy=policy,
        jobs=len(jobs),
        completed=len(finish),
        avg_jct_s=float(jct.mean()) if jct.size else 0.0,
        p99_jct_s=float(np.percentile(jct, 99)) if jct.size else 0.0,
        makespan_s=span,
        utilization=busy / (total * span) if span > 0 else 0.0,
        preemptions=pre,
        finish=finish,
        segments=segs,
    )


def run_agnostic(
    jobs: list[SimJob], capacity: dict[str, int], gpus_per_node: int = 8, restart_s: float = RESTART_S
) -> PolicyResult:
    """The pool today: queue order, start where the scheduler finds room, run to the end."""
    pool = _Pool(capacity, gpus_per_node)
    events: list[tuple[float, int, int]] = [(j.arrival, 1, j.id) for j in jobs]  # finish (0) first
    heapq.heapify(events)
    pending: list[SimJob] = []
    held: dict[int, Decision] = {}
    finish: dict[int, float] = {}
    segs: list[Segment] = []
    while events:
        t = events[0][0]
        while events and events[0][0] == t:
            _, kind, jid = heapq.heappop(events)
            if kind == 0:
                pool.release(held.pop(jid))
                finish[jid] = t
            else:
                pending.append(jobs[jid])
        failed: set[tuple[int, int]] = set()
        waiting: list[SimJob] = []
        for hj in queue_order(j.hjob() for j in pending):
            job = jobs[hj.id]
            shape = (job.request.gpu_count, job.request.gang_nodes)
            got = None if shape in failed else pool.place(job)
            if got is None:
                failed.add(shape)
                waiting.append(job)
                continue
            held[job.id], gpu_type = got
            end = t + restart_s + job.steps / job.speeds[gpu_type]
            segs.append(Segment(job.id, gpu_type, t, end, job.held, restart_s))
            heapq.heappush(events, (end, 0, job.id))
        pending = waiting
    return _summary("agnostic", jobs, finish, segs, sum(capacity.values()), 0)


def run_aware(
    jobs: list[SimJob],
    capacity: dict[str, int],
    gpus_per_node: int = 8,
    restart_s: float = RESTART_S,
    round_s: float = ROUND_S,
    *,
    blind: bool = False,
) -> PolicyResult:
    """Rounds of `round_s`: Gavel's max-min shares, one type per job per round, preempt between.

    `blind` (the `fair` policy): the same rounds and shares with every usable type taken to be
    equally fast (max-min fairness in GPU time), each job's type preference drawn at random from
    its id; jobs still run at their real speeds. It shows what preemptive fair sharing alone buys.
    """
    name = "fair" if blind else "aware"
    if not jobs:
        return _summary(name, jobs, {}, [], sum(capacity.values()), 0)
    seen = {j.id: _blind(j, capacity) for j in jobs} if blind else {j.id: j.hjob() for j in jobs}
    pool = _TypedNodes(capacity, gpus_per_node)
    left = {j.id: float(j.steps) for j in jobs}
    received: dict[int, dict[str, float]] = {}
    running: dict[int, tuple[str, tuple[tuple[int, int], ...]]] = {}
    open_seg: dict[int, Segment] = {}
    finish: dict[int, float] = {}
    segs: list[Segment] = []
    shares: dict[int, dict[str, float]] = {}
    shared_for: frozenset[int] = frozenset()
    nxt = 0  # next job to arrive (jobs are by arrival)
    t0 = jobs[0].arrival
    t = t0
    preemptions = 0
    active: dict[int, SimJob] = {}
    while nxt < len(jobs) or active:
        while nxt < len(jobs) and jobs[nxt].arrival <= t:
            active[jobs[nxt].id] = jobs[nxt]
            nxt += 1
        if not active:  # idle: skip to the round the next job arrives in
            t = t0 + math.ceil((jobs[nxt].arrival - t0) / round_s) * round_s
            continue
        hjobs = [seen[jid] for jid in active]
        if frozenset(active) != shared_for:
            shares = max_min_shares(hjobs, capacity)
            shared_for = frozenset(active)
        current = {jid: gt for jid, (gt, _) in running.items()}
        plan = assign_round(hjobs, shares, received, {j.id: t - j.arrival for j in hjobs}, capacity, current)
        for jid in [j for j, gt in current.items() if plan.get(j) != gt]:
            pool.release(current[jid], running.pop(jid)[1])
            segs.append(open_seg.pop(jid))
            preemptions += 1
        for jid in sorted((j for j in plan if j not in running), key=lambda j: (-active[j].held, j)):
            got = pool.place(active[jid], plan[jid])
            if got is not None:
                running[jid] = (plan[jid], got)
                open_seg[jid] = Segment(jid, plan[jid], t, t, active[jid].held, restart_s)
        end = t + round_s
        ended = False
        for jid, (gt, d) in list(running.items()):
            job = active[jid]
            seg = open_seg[jid]
            work_from = max(t, seg.start + seg.overhead)
            need = left[jid] / job.speeds[gt]
            r = received.setdefault(jid, {})
            if work_from + need <= end:
                done = work_from + need
                finish[jid] = done
                segs.append(Segment(jid, gt, seg.start, done, seg.gpus, seg.overhead))
                del open_seg[jid], running[jid], active[jid]
                pool.release(gt, d)
                r[gt] = r.get(gt, 0.0) + done - t
                ended = True
            else:
                left[jid] -= job.speeds[gt] * max(0.0, end - work_from)
                open_seg[jid] = Segment(jid, gt, seg.start, end, seg.gpus, seg.overhead)
                r[gt] = r.get(gt, 0.0) + round_s
        t = end
        settled = (
            not ended
            and len(running) == len(active)
            and all(
                shares.get(jid, {}).get(gt, 0.0) >= sum(shares.get(jid, {}).values()) - 1e-9
                for jid, (gt, _) in running.items()
            )
        )
        if settled:  # nothing can change before the next arrival or completion: skip to it
            until = min(left[jid] / active[jid].speeds[gt] for jid, (gt, _) in running.items())
            m = math.floor(until / round_s)
            if nxt < len(jobs):
                m = min(m, math.ceil((jobs[nxt].arrival - t) / round_s))
            if m >= 1:
                for jid, (gt, _) in running.items():
                    left[jid] -= active[jid].speeds[gt] * round_s * m
                    received[jid][gt] += round_s * m
                    seg = open_seg[jid]
                    open_seg[jid] = Segment(jid, gt, seg.start, t + round_s * m, seg.gpus, seg.overhead)
                t += round_s * m
    return _summary(name, jobs, finish, segs, sum(capacity.values()), preemptions)


def _blind(job: SimJob, capacity: dict[str, int]) -> HJob:
    """The job as a speed-blind policy sees it: 1 on every type it can run on, ties broken at random."""
    rng = np.random.default_rng(job.id)
    ok = {t for t, n in capacity.items() if n >= job.held and job.speeds.get(t, 0.0) > 0}
    speeds = {t: 1.0 + 1e-3 * float(rng.random()) if t in ok else 0.0 for t in capacity}
    return HJob(job.id, job.held, speeds, job.weight, job.arrival)
