"""The published figures the report compares against.

- FGD paper (Alibaba 2023 trace, fill-up protocol): per workload and policy, the means over its
  seeds and the mean allocation and fragmentation-rate curves (`traces/fgd-published/`);
- Helios SC'21 (Philly trace): static-partition FIFO queueing and JCT per VC
  (`traces/philly/helios_static_vc_published.csv`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from computepool.sim.csvread import float_field, read_rows
from computepool.sim.philly import PUBLISHED_AVG_QUEUE_S, Published, load_published
from computepool.sim.report_config import PHILLY_DIR, POD_PREFIX

HELIOS_FILE = "helios_static_vc_published.csv"
# Our policy name -> the published simulator's name; `default` (the pool's own) has none.
PUBLISHED_POLICY = {
    "random": "01-Random",
    "dotprod": "02-DotProd",
    "clustering": "03-GpuClustering",
    "packing": "04-GpuPacking",
    "bestfit": "05-BestFit",
    "fgd": "06-FGD",
}
ARRIVED = np.arange(131)  # the arrived-% grid (0..130) of every fill-up curve


@dataclass(frozen=True)
class PublishedPolicy:
    """The FGD paper's means over its seeds for one workload and policy."""

    n_seeds: int
    unalloc_100: float
    alloc_100_sd: float
    unalloc_130: float
    frag_rate_90: float
    alloc_curve: np.ndarray  # mean allocation % at arrived 0..130 (NaN where missing)
    frag_rate_curve: np.ndarray


def _mean_curves(path: Path) -> dict[tuple[str, str], np.ndarray]:
    """Per (workload, policy) mean over seeds of a discretised curve file (columns 0..130)."""
    cols = ["workload", "sc_policy"] + [str(a) for a in ARRIVED]
    sums: dict[tuple[str, str], list[np.ndarray]] = {}
    for _, row in read_rows(path, cols):
        key = (row["workload"].removeprefix(POD_PREFIX), row["sc_policy"])
        vals = np.array([float(row[str(a)]) if row[str(a)] else math.nan for a in ARRIVED])
        sums.setdefault(key, []).append(vals)
    return {k: np.nanmean(np.vstack(v), axis=0) for k, v in sums.items()}


def _mean_curves_if_present(path: Path) -> dict[tuple[str, str], np.ndarray]:
    return _mean_curves(path) if path.is_file() else {}


def load_published_fgd(base: Path) -> dict[tuple[str, str], PublishedPolicy]:
    """Read `fgd-published/` keyed by (workload without prefix, our policy name); {} if absent."""
    summary = base / "summary_by_workload_policy.csv"
    if not summary.is_file():
        return {}
    alloc = _mean_curves_if_present(base / "analysis_allo_discrete.csv")
    frag = _mean_curves_if_present(base / "analysis_frag_ratio_discrete.csv")
    ours = {v: k for k, v in PUBLISHED_POLICY.items()}
    nan_curve = np.full(len(ARRIVED), math.nan)
    out: dict[tuple[str, str], PublishedPolicy] = {}
    cols = ["workload", "policy", "n_seeds", "alloc_pct_at_arr100_sd", "unalloc_pct_at_arr100"]
    cols += ["unalloc_pct_at_arr130", "frag_over_idle_pct_at_arr90"]
    for where, row in read_rows(summary, cols):
        policy = ours.get(row["policy"])
        if policy is None:
            continue
        w = row["workload"].removeprefix(POD_PREFIX)
        out[(w, policy)] = PublishedPolicy(
            n_seeds=int(float_field(row, "n_seeds", where)),
            unalloc_100=float_field(row, "unalloc_pct_at_arr100", where),
            alloc_100_sd=float_field(row, "alloc_pct_at_arr100_sd", where),
            unalloc_130=float_field(row, "unalloc_pct_at_arr130", where),
            frag_rate_90=float_field(row, "frag_over_idle_pct_at_arr90", where),
            alloc_curve=alloc.get((w, row["policy"]), nan_curve),
            frag_rate_curve=frag.get((w, row["policy"]), nan_curve),
        )
    return out


def load_published_helios(traces: Path) -> dict[str, Published]:
    """Helios' static-partition FIFO figures keyed by VC (and `all`); {} if the file is absent."""
    path = traces / PHILLY_DIR / HELIOS_FILE
    return load_published(path) if path.is_file() else {}


def helios_target_avg_queue_s(pubs: dict[str, Published]) -> float:
    """The overall average queueing delay the Philly load is calibrated to."""
    return pubs["all"].queue_avg_s if "all" in pubs else PUBLISHED_AVG_QUEUE_S
