"""results.json: every raw figure of a report as plain JSON (no NaN: missing values are null)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from computepool.sim.report_config import SHARING_SEED, SHARING_WORKLOAD, ReportConfig
from computepool.sim.report_figures import DEFAULT_MARGIN_PTS, MATCH_PTS, SummaryRow, WorkloadFigures
from computepool.sim.report_runs import PhillyOutcome


def jsonable(o: Any) -> Any:
    """Plain JSON values: numpy to Python, NaN and infinities to null."""
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return jsonable(o.tolist())
    if isinstance(o, np.generic):
        return jsonable(o.item())
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return o


def results_json(
    cfg: ReportConfig,
    runs: list[dict[str, Any]],
    figs: dict[str, WorkloadFigures],
    summary: list[SummaryRow],
    sharing: dict[str, Any] | None,
    philly: PhillyOutcome | None,
    elapsed_s: float,
    cpu_s: float,
) -> dict[str, Any]:
    per_policy = []
    for wf in figs.values():
        for pf in wf.policies.values():
            pp = pf.published
            per_policy.append(
                {
                    "workload": pf.workload,
                    "policy": pf.policy,
                    "unallocated_pct_at_100": asdict(pf.unalloc_100),
                    "unallocated_pct_at_130": asdict(pf.unalloc_130),
                    "frag_rate_pct_at_90": asdict(pf.frag_rate_90),
                    "delta_at_100": pf.delta_100,
                    "mean_alloc_curve": pf.alloc_curve,
                    "mean_frag_rate_curve": pf.frag_rate_curve,
                    "published": None
                    if pp is None
                    else {
                        "n_seeds": pp.n_seeds,
                        "unallocated_pct_at_100": pp.unalloc_100,
                        "alloc_pct_at_100_sd": pp.alloc_100_sd,
                        "unallocated_pct_at_130": pp.unalloc_130,
                        "frag_rate_pct_at_90": pp.frag_rate_90,
                        "mean_alloc_curve": pp.alloc_curve,
                        "mean_frag_rate_curve": pp.frag_rate_curve,
                    },
                }
            )
    philly_out: dict[str, Any] | None = None
    if philly is not None:
        pct = np.arange(101)
        philly_out = {
            **philly.figures,
            "queue_delay_percentiles_s": {
                "percent": pct,
                **{k: np.percentile(v, pct) if v.size else [] for k, v in philly.delays.items()},
            },
        }
    return jsonable(
        {
            "config": {
                "seeds": cfg.seeds,
                "workloads": cfg.workloads,
                "policies": cfg.policies,
                "jobs": cfg.jobs,
                "replay": cfg.replay,
                "tune": cfg.tune,
                "traces": cfg.traces,
                "reference_policy": cfg.reference_policy,
                "match_pts": MATCH_PTS,
                "default_margin_pts": DEFAULT_MARGIN_PTS,
            },
            "elapsed_s": round(elapsed_s, 2),
            "cpu_s_of_runs": round(cpu_s, 2),
            "summary": [r.as_dict() for r in summary],
            "fill": {"per_policy": per_policy, "runs": runs},
            "static_vs_pooled": None
            if sharing is None
            else {"workload": SHARING_WORKLOAD, "seed": SHARING_SEED, **sharing},
            "philly": philly_out,
        }
    )


def write_json(path: Path, data: Any) -> Path:
    """Write `data` strictly (NaN is an error) via a temporary file, so a reader never sees half of it."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
