"""Gangs in a stream of small jobs: what reservation with backfill buys, and what it costs.

A synthetic trace, deterministic from its seed: single-GPU jobs arrive as a Poisson stream, each
with a time limit somewhat above its run time (as users give them: rounded up, with margin), and
every few hours a gang of whole nodes (4 × 8 GPUs by default) arrives with its own limit. The
trace is replayed on a small pool of identical nodes twice, through the scheduler library the
control plane runs (`Scheduler.place`, `scheduler.reservation.reserve`):

- *without reservation*: at each event, every waiting request that fits starts, oldest first
  (the pool before reservation). A gang needs whole nodes free together; with small jobs
  landing on every node as soon as one GPU frees up, it may wait for as long as the stream lasts.
- *with reservation*: the oldest waiting gang gets a reservation (shadow time and nodes from the
  running work's time limits), and other work starts on those nodes only if its limit ends by
  the shadow time.

Figures are over the arrival window (`hours`): waits (gangs: p50 and max; small jobs: p50), GPU
utilization (GPU-seconds busy within the window over the window's capacity) and jobs finished
within it. Jobs still waiting when the window closes are run to the end (the stream has stopped)
so every wait is measured.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from computepool.core.request import Request
from computepool.core.resources import Device, Node
from computepool.scheduler.placement import Scheduler
from computepool.scheduler.policies import make_scorer
from computepool.scheduler.reservation import Held, reserve
from computepool.scheduler.state import Change, ClusterState


@dataclass(frozen=True)
class TraceSpec:
    """The synthetic trace and the pool it is replayed on."""

    seed: int = 1
    hours: float = 48.0
    nodes: int = 8
    gpus_per_node: int = 8
    small_load: float = 0.75  # mean GPUs the small jobs ask for, as a share of the pool's
    small_median_min: float = 40.0  # median run time of a small job (lognormal)
    gang_nodes: int = 4
    gang_every_h: float = 6.0  # mean hours between gangs (exponential)
    gang_hours: tuple[float, float] = (1.0, 3.0)  # a gang's run time, uniform

    def check(self) -> None:
        for name in ("hours", "small_load", "small_median_min", "gang_every_h"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("nodes and gpus_per_node must be at least 1")
        if not 2 <= self.gang_nodes <= self.nodes:
            raise ValueError(f"gang_nodes must be between 2 and nodes ({self.nodes}), got {self.gang_nodes}")


@dataclass(frozen=True)
class Job:
    id: int
    submit: float  # seconds
    runtime: float
    limit: float | None  # seconds; None: no time limit
    request: Request

    @property
    def gang(self) -> bool:
        return self.request.gang_nodes > 1

    @property
    def gpus(self) -> int:
        return self.request.gpu_count * self.request.gang_nodes


def _round_up(s: float, step: float) -> float:
    return math.ceil(s / step) * step


def synthetic_trace(spec: TraceSpec) -> list[Job]:
    """Small jobs and gangs, by submit time; the same list for the same spec."""
    spec.check()
    rng = np.random.default_rng(spec.seed)
    end = spec.hours * 3600.0
    median = spec.small_median_min * 60.0
    sigma = 0.8
    mean_run = median * math.exp(sigma**2 / 2)
    rate = spec.small_load * spec.nodes * spec.gpus_per_node / mean_run
    raw: list[tuple[float, float, float | None, Request]] = []
    t = float(rng.exponential(1 / rate))
    small = Request(gpu_count=1, gpu_milli=1000, cpu_milli=1000, memory_mib=1024)
    while t < end:
        run = float(min(rng.lognormal(math.log(median), sigma), 12 * 3600.0))
        limit = _round_up(run * float(rng.uniform(1.1, 2.0)), 900.0)  # a quarter hour, with margin
        raw.append((t, run, limit, small))
        t += float(rng.exponential(1 / rate))
    gang = Request(
        gpu_count=spec.gpus_per_node,
        gpu_milli=1000,
        cpu_milli=8000,
        memory_mib=8192,
        gang_nodes=spec.gang_nodes,
    )
    t = float(rng.exponential(spec.gang_every_h * 3600.0))
    while t < end:
        run = float(rng.uniform(*spec.gang_hours)) * 3600.0
        raw.append((t, run, _round_up(run * 1.25, 3600.0), gang))
        t += float(rng.exponential(spec.gang_every_h * 3600.0))
    raw.sort(key=lambda x: x[0])
    return [Job(i, s, r, lim, req) for i, (s, r, lim, req) in enumerate(raw)]


@dataclass
class Outcome:
    """One replay's figures (waits in minutes, utilization in percent of the pool's GPUs)."""

    reservation: bool
    gangs: int
    gangs_started: int
    gang_wait_p50_min: float
    gang_wait_max_min: float
    small_jobs: int
    small_wait_p50_min: float
    small_wait_p95_min: float
    gpu_util_pct: float
    jobs_finished: int
    backfilled: int  # jobs that started on reserved nodes (their limit ended in time)
    reserved_idle_gpu_h: float  # GPU-hours idle on reserved nodes while a small job waited
    waits: list[float] = field(default_factory=list, repr=False)  # per job, seconds

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.pop("waits")
        return d


class _Replay:
    def __init__(self, spec: TraceSpec, jobs: list[Job], reservation: bool, policy: str) -> None:
        self.spec = spec
        self.jobs = jobs
        self.reservation = reservation
        nodes = [
            Node(
                f"n{i:02d}",
                256000,
                1 << 21,
                [
                    Device(j, "sim", "A100", 81920, f"n{i}-{j}", link_group=f"nvl{j // 4}")
                    for j in range(spec.gpus_per_node)
                ],
            )
            for i in range(spec.nodes)
        ]
        self.state = ClusterState.from_nodes(nodes)
        self.sched = Scheduler(make_scorer(policy))
        self.start = [math.nan] * len(jobs)
        self.finish = [math.nan] * len(jobs)
        self.held: dict[int, Held] = {}
        self.pending: list[int] = []
        self.backfilled = 0
        self.idle_gpu_s = 0.0  # reserved, idle, while small work waits (within the window)
        self._idle_now = 0

    def run(self) -> Outcome:
        events: list[tuple[float, int, int]] = []  # (time, 0 = finish first / 1 = arrival, job)
        for j in self.jobs:
            heapq.heappush(events, (j.submit, 1, j.id))
        last = 0.0
        end = self.spec.hours * 3600.0
        while events:
            t = events[0][0]
            self.idle_gpu_s += self._idle_now * max(0.0, min(t, end) - min(last, end))
            last = t
            while events and events[0][0] == t:
                _, what, jid = heapq.heappop(events)
                if what == 0:
                    for ch in reversed(self.held.pop(jid).changes):
                        self.state.undo(ch)
                    self.finish[jid] = t
                else:
                    self.pending.append(jid)
            for jid in self._pass(t):
                heapq.heappush(events, (t + self.jobs[jid].runtime, 0, jid))
        return self._outcome()

    def _pass(self, t: float) -> list[int]:
        """Start what may start at `t`, oldest first; the started jobs' ids."""
        if not self.pending:
            return []
        res = None
        if self.reservation:
            gang = next((j for j in self.pending if self.jobs[j].gang), None)
            if gang is not None:
                held = list(self.held.values())
                res = reserve(self.sched, self.state, gang, self.jobs[gang].request, held, t)
        started: list[int] = []
        failed: set[tuple[int, bool]] = set()
        self._idle_now = 0
        for jid in self.pending:
            job = self.jobs[jid]
            ends = None if job.limit is None else t + job.limit
            keep_off = None if res is None or jid == res.gang else res.within(ends)
            kind = (job.request.gang_nodes, keep_off is not None)
            if kind in failed:
                continue
            d = self.sched.place(self.state, job.request, observe=False, explain=False, within=keep_off)
            if not d.ok:
                failed.add(kind)
                continue
            Scheduler.commit(self.state, d)
            changes: tuple[Change, ...] = tuple(p.change for p in d.placements)
            self.held[jid] = Held(jid, ends, changes)
            if res is not None and jid != res.gang and any(res.mask[p.node] for p in d.placements):
                self.backfilled += 1
            self.start[jid] = t
            started.append(jid)
        if started:
            done = set(started)
            self.pending = [j for j in self.pending if j not in done]
        if res is not None and (1, True) in failed:  # small work kept off the reserved nodes
            self._idle_now = int(self.state.idle_devices[res.mask].sum())
        return started

    def _outcome(self) -> Outcome:
        end = self.spec.hours * 3600.0
        submit = np.array([j.submit for j in self.jobs])
        start = np.array(self.start)
        finish = np.array(self.finish)
        gang = np.array([j.gang for j in self.jobs], dtype=bool)
        gpus = np.array([j.gpus for j in self.jobs], dtype=np.float64)
        wait = start - submit
        busy = (np.clip(finish, 0, end) - np.clip(start, 0, end)) * gpus
        cap = self.spec.nodes * self.spec.gpus_per_node * end

        def minutes(x: np.ndarray, q: float) -> float:
            return round(float(np.percentile(x, q)) / 60.0, 1) if x.size else 0.0

        return Outcome(
            reservation=self.reservation,
            gangs=int(gang.sum()),
            gangs_started=int((gang & (start < end)).sum()),
            gang_wait_p50_min=minutes(wait[gang], 50),
            gang_wait_max_min=minutes(wait[gang], 100),
            small_jobs=int((~gang).sum()),
            small_wait_p50_min=minutes(wait[~gang], 50),
            small_wait_p95_min=minutes(wait[~gang], 95),
            gpu_util_pct=round(100.0 * float(busy.sum()) / cap, 2),
            jobs_finished=int((finish <= end).sum()),
            backfilled=self.backfilled,
            reserved_idle_gpu_h=round(self.idle_gpu_s / 3600.0, 1),
            waits=wait.tolist(),
        )


def replay_jobs(spec: TraceSpec, jobs: list[Job], *, reservation: bool, policy: str = "default") -> Outcome:
    """Replay `jobs` (ids 0.., by submit time) on the spec's pool, with or without reservation."""
    return _Replay(spec, jobs, reservation, policy).run()


def compare(spec: TraceSpec, policy: str = "default") -> dict[str, object]:
    """Both replays of one trace, and what the reservation changes."""
    jobs = synthetic_trace(spec)
    without = _Replay(spec, jobs, False, policy).run()
    with_ = _Replay(spec, jobs, True, policy).run()
    capacity_h = spec.nodes * spec.gpus_per_node * spec.hours
    return {
        "spec": {**asdict(spec), "gang_hours": list(spec.gang_hours), "policy": policy},
        "trace": {"small_jobs": without.small_jobs, "gangs": without.gangs},
        "without_reservation": without.as_dict(),
        "with_reservation": with_.as_dict(),
        "gang_wait_p50_saved_min": round(without.gang_wait_p50_min - with_.gang_wait_p50_min, 1),
        "gang_wait_max_saved_min": round(without.gang_wait_max_min - with_.gang_wait_max_min, 1),
        "utilization_cost_pct_points": round(without.gpu_util_pct - with_.gpu_util_pct, 2),
        "reserved_idle_pct": round(100.0 * with_.reserved_idle_gpu_h / capacity_h, 2),
    }
