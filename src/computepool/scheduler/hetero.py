"""Heterogeneity-aware shares and placement: pure functions over measured speeds, no I/O, no clock.

A job needs `gpus` devices of ONE type and runs at `speeds[type]` steps/s there. The same job can be
several times faster on one type than another, and by different factors for different jobs (a
recommendation model gains little from a V100 over a K80, a ResNet-50 gains 7×), so the pool serves
everyone better by giving each job time on the type it gains most on.

- `max_min_shares` is Gavel's heterogeneity-aware max-min fairness (OSDI 2020): time fractions
  `X[j][t]` (each job's fractions sum to at most 1, each type's GPUs are not oversubscribed) that
  maximize the smallest *normalized effective throughput* `Σ_t speed[j][t]·X[j][t] / norm_j / w_j`,
  where `norm_j` is the job's speed on the cluster-average GPU (its speed per type weighted by the
  type's share of the GPUs) and `w_j` its weight. A second LP keeps every job at that minimum and
  maximizes the sum of normalized throughputs, so capacity the minimum does not need goes where it
  gains most instead of being left idle (the first LP's optimum is rarely unique). Solved with
  HiGHS through `scipy.optimize.linprog`.
- `assign_round` turns the shares into one round's placement as Gavel's round-based mechanism does:
  each (job, type) pair's priority is its share over the fraction of its time it has received on
  that type; pairs are served by priority, a job on one type per round, and GPUs left over go to
  waiting jobs on their fastest type that fits (work conserving).
- `queue_order` is the pool's order within a tenant (priority, then age); with no speed
  knowledge it is the whole policy: every job that fits starts, nothing is preempted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

GPU_TYPES = ("v100", "p100", "k80")


@dataclass(frozen=True)
class Speeds:
    """Measured steps/s per (job type, GPUs) and device type, the job alone on its devices."""

    rates: Mapping[tuple[str, int], Mapping[str, float]]

    def job_types(self) -> set[str]:
        return {k[0] for k in self.rates}

    def of(self, job_type: str, gpus: int) -> tuple[dict[str, float], bool]:
        """The job's steps/s per device type, and whether they were measured at this many GPUs.

        Unmeasured sizes scale the one-GPU figure linearly (ideal data parallelism), the
        optimistic bound; an unknown job type is a KeyError.
        """
        exact = self.rates.get((job_type, gpus))
        if exact is not None:
            return dict(exact), True
        one = self.rates.get((job_type, 1))
        if one is None:
            raise KeyError(job_type)
        return {t: v * gpus for t, v in one.items()}, False


@dataclass(frozen=True)
class HJob:
    """A job as the policy sees it: `gpus` devices of one type, steps/s per type, weight, age."""

    id: int
    gpus: int
    speeds: Mapping[str, float]
    weight: float = 1.0
    arrival: float = 0.0

    def usable(self, capacity: Mapping[str, int]) -> list[str]:
        """Types with enough devices in the whole pool and a positive speed, fastest first."""
        ok = [t for t, n in capacity.items() if n >= self.gpus and self.speeds.get(t, 0.0) > 0]
        return sorted(ok, key=lambda t: (-self.speeds[t], t))


def queue_order(jobs: Iterable[HJob]) -> list[HJob]:
    """The pool's serving order within a tenant: higher priority first, then oldest (then id)."""
    return sorted(jobs, key=lambda j: (-j.weight, j.arrival, j.id))


def _norm(job: HJob, capacity: Mapping[str, int]) -> float:
    total = sum(capacity.values())
    return sum(job.speeds.get(t, 0.0) * n for t, n in capacity.items()) / total if total else 0.0


def max_min_shares(jobs: Sequence[HJob], capacity: Mapping[str, int]) -> dict[int, dict[str, float]]:
    """Per job id, its time fraction on each device type (Gavel's heterogeneity-aware max-min)."""
    from scipy.optimize import linprog  # only the aware policy needs it
    from scipy.sparse import coo_matrix

    types = [t for t, n in capacity.items() if n > 0]
    live = [j for j in jobs if j.usable(capacity)]
    out: dict[int, dict[str, float]] = {j.id: {} for j in jobs}
    if not live or not types:
        return out
    n, k = len(live), len(types)
    nv = n * k + 1  # X[j][t] at j*k + t, then z
    speed = np.array([[j.speeds.get(t, 0.0) for t in types] for j in live])
    allowed = np.array([[capacity[t] >= j.gpus and j.speeds.get(t, 0.0) > 0 for t in types] for j in live])
    scale = np.array([_norm(j, capacity) * j.weight for j in live])
    eff = speed / scale[:, None]  # normalized effective throughput per unit of time fraction
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    jj, tt = np.meshgrid(np.arange(n), np.arange(k), indexing="ij")
    var = (jj * k + tt).ravel()
    # each job's fractions sum to <= 1 (rows 0..n-1)
    rows.append(jj.ravel())
    cols.append(var)
    vals.append(np.ones(n * k))
    # each type's GPUs: sum_j gpus_j X[j][t] <= capacity (rows n..n+k-1)
    gpus = np.array([j.gpus for j in live], dtype=np.float64)
    rows.append(n + tt.ravel())
    cols.append(var)
    vals.append(np.repeat(gpus, k))
    # z - sum_t eff X <= 0 (rows n+k..n+k+n-1)
    rows.append(n + k + jj.ravel())
    cols.append(var)
    vals.append(-eff.ravel())
    rows.append(n + k + np.arange(n))
    cols.append(np.full(n, nv - 1))
    vals.append(np.ones(n))
    a = coo_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(2 * n + k, nv)
    ).tocsr()
    b = np.concatenate([np.ones(n), [float(capacity[t]) for t in types], np.zeros(n)])
    bounds = [(0.0, 1.0 if ok else 0.0) for ok in allowed.ravel()] + [(0.0, None)]
    c = np.zeros(nv)
    c[-1] = -1.0
    first = linprog(c, A_ub=a, b_ub=b, bounds=bounds, method="highs")
    if first.status != 0:
        raise RuntimeError(f"max-min shares: the LP failed ({first.message})")
    zmin = float(first.x[-1]) * (1 - 1e-6)
    # second stage: keep everyone at the minimum, maximize the sum of normalized throughputs
    c2 = np.concatenate([-eff.ravel(), [0.0]])
    bounds[-1] = (zmin, None)
    second = linprog(c2, A_ub=a, b_ub=b, bounds=bounds, method="highs")
    x = (second.x if second.status == 0 else first.x)[:-1].reshape(n, k)
    for i, j in enumerate(live):
        out[j.id] = {t: float(x[i, m]) for m, t in enumerate(types) if x[i, m] > 1e-9}
    return out


def assign_round(
    jobs: Sequence[HJob],
    shares: Mapping[int, Mapping[str, float]],
    received_s: Mapping[int, Mapping[str, float]],
    age_s: Mapping[int, float],
    capacity: Mapping[str, int],
    current: Mapping[int, str],
) -> dict[int, str]:
    """One round's device type per job that runs (absent: it waits this round).

    Priority of (job, type) = share / fraction of the job's age it has run on that type (a pair
    never served yet comes first); ties keep a job on its current type, then go to the type it is
    fastest on (relative to its best), then to the oldest job. Then each
    waiting job, in queue order, takes the fastest type with enough GPUs left.
    """
    pairs: list[tuple[float, bool, float, float, int, str]] = []
    by_id = {j.id: j for j in jobs}
    for j in jobs:
        age = max(age_s.get(j.id, 0.0), 1e-9)
        top = max(j.speeds.values(), default=0.0) or 1.0
        for t, x in shares.get(j.id, {}).items():
            if x <= 1e-9:
                continue
            got = received_s.get(j.id, {}).get(t, 0.0) / age
            prio = x / got if got > 0 else math.inf
            pairs.append((-prio, current.get(j.id) != t, -j.speeds.get(t, 0.0) / top, j.arrival, j.id, t))
    pairs.sort()
    free = dict(capacity)
    plan: dict[int, str] = {}
    for *_, jid, t in pairs:
        g = by_id[jid].gpus
        if jid not in plan and free.get(t, 0) >= g:
            plan[jid] = t
            free[t] -= g
    for j in queue_order(x for x in jobs if x.id not in plan):
        for t in j.usable(capacity):
            if free[t] >= j.gpus:
                plan[j.id] = t
                free[t] -= j.gpus
                break
    return plan
