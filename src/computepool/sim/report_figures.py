"""Our fill-up figures over seeds, next to the published ones, and the per-workload headline checks."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from computepool.sim.published import ARRIVED, PublishedPolicy

MATCH_PTS = 0.5  # |ours - published| allowed for bestfit and fgd
DEFAULT_MARGIN_PTS = 0.3  # our default may trail published fgd by this much


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over seeds (sd NaN with fewer than two)."""

    mean: float
    sd: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat:
        xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not xs:
            return cls(math.nan, math.nan, 0)
        return cls(statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else math.nan, len(xs))


def _curve(points: list[list[float]]) -> np.ndarray:
    out = np.full(len(ARRIVED), math.nan)
    for a, v in points:
        if 0 <= int(a) < len(out):
            out[int(a)] = v
    return out


def _nanmean_rows(rows: list[np.ndarray]) -> np.ndarray:
    if not rows:
        return np.full(len(ARRIVED), math.nan)
    stack = np.vstack(rows)
    ok = np.isfinite(stack).any(axis=0)
    out = np.full(stack.shape[1], math.nan)
    out[ok] = np.nanmean(stack[:, ok], axis=0)
    return out


@dataclass(frozen=True)
class PolicyFigures:
    """Our figures for one workload and policy over the seeds, with the published ones."""

    workload: str
    policy: str
    unalloc_100: Stat
    unalloc_130: Stat
    frag_rate_90: Stat
    alloc_curve: np.ndarray
    frag_rate_curve: np.ndarray
    published: PublishedPolicy | None

    @property
    def delta_100(self) -> float:
        return self.unalloc_100.mean - self.published.unalloc_100 if self.published else math.nan


@dataclass(frozen=True)
class WorkloadFigures:
    workload: str
    policies: dict[str, PolicyFigures]
    offline_ffd: Stat
    lower_bound: Stat


def aggregate(
    runs: list[dict[str, Any]],
    workloads: Sequence[str],
    policies: Sequence[str],
    published: dict[tuple[str, str], PublishedPolicy],
) -> dict[str, WorkloadFigures]:
    """Means over seeds per workload and policy; offline references from runs that computed them."""
    out: dict[str, WorkloadFigures] = {}
    for w in workloads:
        per: dict[str, PolicyFigures] = {}
        mine = [r for r in runs if r["workload"] == w]
        for p in policies:
            rs = [r for r in mine if r["policy"] == p]
            per[p] = PolicyFigures(
                workload=w,
                policy=p,
                unalloc_100=Stat.of(r["unallocated_pct_at_100"] for r in rs),
                unalloc_130=Stat.of(r["unallocated_pct_at_130"] for r in rs),
                frag_rate_90=Stat.of(r["frag_rate_pct_at_90"] for r in rs),
                alloc_curve=_nanmean_rows([_curve(r["curve"]) for r in rs]),
                frag_rate_curve=_nanmean_rows([_curve(r["frag_rate_curve"]) for r in rs]),
                published=published.get((w, p)),
            )
        out[w] = WorkloadFigures(
            workload=w,
            policies=per,
            offline_ffd=Stat.of(r["offline_ffd_unallocated_pct"] for r in mine),
            lower_bound=Stat.of(r["lower_bound_unallocated_pct"] for r in mine),
        )
    return out


@dataclass(frozen=True)
class SummaryRow:
    """One workload's headline: published vs ours at arrived = 100%, and the pass checks."""

    workload: str
    published_bestfit: float
    ours_bestfit: float
    published_fgd: float
    ours_fgd: float
    ours_default: float
    offline_ffd: float
    lower_bound: float
    bestfit_matches: bool | None
    fgd_matches: bool | None
    default_within_fgd: bool | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(
    figs: dict[str, WorkloadFigures], published: dict[tuple[str, str], PublishedPolicy]
) -> list[SummaryRow]:
    """Headline per workload; published figures are shown even for policies not run here."""
    rows = []
    for w, wf in figs.items():

        def ours(p: str, wf: WorkloadFigures = wf) -> float:
            pf = wf.policies.get(p)
            return pf.unalloc_100.mean if pf else math.nan

        def pub(p: str, w: str = w) -> float:
            pp = published.get((w, p))
            return pp.unalloc_100 if pp else math.nan

        def check(ok: bool, *values: float) -> bool | None:
            return ok if all(math.isfinite(v) for v in values) else None

        pb, ob, pg, og, od = pub("bestfit"), ours("bestfit"), pub("fgd"), ours("fgd"), ours("default")
        rows.append(
            SummaryRow(
                workload=w,
                published_bestfit=pb,
                ours_bestfit=ob,
                published_fgd=pg,
                ours_fgd=og,
                ours_default=od,
                offline_ffd=wf.offline_ffd.mean,
                lower_bound=wf.lower_bound.mean,
                bestfit_matches=check(abs(ob - pb) <= MATCH_PTS, ob, pb),
                fgd_matches=check(abs(og - pg) <= MATCH_PTS, og, pg),
                default_within_fgd=check(od <= pg + DEFAULT_MARGIN_PTS, od, pg),
            )
        )
    return rows
