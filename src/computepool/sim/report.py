"""One report that reruns every comparison the pool's claims rest on, and writes what a reader needs.

Three studies, each against published figures where there are any:

1. the fill-up protocol on the Alibaba 2023 trace (`sim.fill`), every workload x policy x
   seed, next to the FGD paper's per-policy results, with the offline references;
2. static whole-device allocation against the pool on the same protocol (`sim.sharing`);
3. the Philly replay with queues (`sim.replay`): static VC partitions against one pooled
   cluster at the trace's own load, at the load calibrated to the published queueing delay,
   and the smallest pooled cluster that matches static.

Everything runs in worker processes (`--jobs`); the output is `report.md`, PNG plots and
`results.json` with every raw figure.

This module is the orchestrator; the parts live in small modules, and every name the CLI and
the tests use is re-exported here:

- `report_config`: trace layout, defaults, option parsing and `ReportConfig`;
- `report_runs`: the tasks run in worker processes and `run_all`;
- `published`: the FGD paper's and Helios' published figures and curves;
- `report_figures`: means over seeds, the summary rows and their checks;
- `report_plots`: the PNG plots (matplotlib's object API, no pyplot);
- `report_markdown`: report.md;
- `report_results`: results.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from computepool.sim.published import (
    ARRIVED,
    PUBLISHED_POLICY,
    PublishedPolicy,
    load_published_fgd,
    load_published_helios,
)
from computepool.sim.report_config import (
    ALIBABA_DIR,
    DEFAULT_SEEDS,
    DEFAULT_WORKLOADS,
    NODE_LIST,
    PHILLY_DIR,
    POD_PREFIX,
    PUBLISHED_DIR,
    QUICK_POLICIES,
    QUICK_SEEDS,
    QUICK_WORKLOADS,
    SHARING_SEED,
    SHARING_WORKLOAD,
    ReportConfig,
    available_workloads,
    check_writable,
    parse_names,
    parse_seeds,
    parse_workloads,
)
from computepool.sim.report_figures import (
    DEFAULT_MARGIN_PTS,
    MATCH_PTS,
    PolicyFigures,
    Stat,
    SummaryRow,
    WorkloadFigures,
    aggregate,
    summarise,
)
from computepool.sim.report_markdown import SUMMARY_HEADERS, fmt, md_table, render_markdown, summary_cells
from computepool.sim.report_plots import (
    POLICY_COLOUR,
    ZERO_DELAY_S,
    plot_alloc,
    plot_frag,
    plot_queue_cdf,
    write_plots,
)
from computepool.sim.report_results import jsonable, results_json, write_json
from computepool.sim.report_runs import (
    FillTask,
    PhillyOutcome,
    Progress,
    RunOutcome,
    fill_tasks,
    run_all,
    run_fill_task,
    run_philly_task,
    run_sharing_task,
)

__all__ = [
    "ALIBABA_DIR",
    "ARRIVED",
    "DEFAULT_MARGIN_PTS",
    "DEFAULT_SEEDS",
    "DEFAULT_WORKLOADS",
    "MATCH_PTS",
    "NODE_LIST",
    "PHILLY_DIR",
    "POD_PREFIX",
    "POLICY_COLOUR",
    "PUBLISHED_DIR",
    "PUBLISHED_POLICY",
    "QUICK_POLICIES",
    "QUICK_SEEDS",
    "QUICK_WORKLOADS",
    "SHARING_SEED",
    "SHARING_WORKLOAD",
    "SUMMARY_HEADERS",
    "ZERO_DELAY_S",
    "FillTask",
    "PhillyOutcome",
    "PolicyFigures",
    "Progress",
    "PublishedPolicy",
    "Report",
    "ReportConfig",
    "RunOutcome",
    "Stat",
    "SummaryRow",
    "WorkloadFigures",
    "aggregate",
    "available_workloads",
    "build_report",
    "check_writable",
    "fill_tasks",
    "fmt",
    "jsonable",
    "load_published_fgd",
    "load_published_helios",
    "md_table",
    "parse_names",
    "parse_seeds",
    "parse_workloads",
    "plot_alloc",
    "plot_frag",
    "plot_queue_cdf",
    "render_markdown",
    "results_json",
    "run_all",
    "run_fill_task",
    "run_philly_task",
    "run_sharing_task",
    "summarise",
    "summary_cells",
]


@dataclass(frozen=True)
class Report:
    """What `build_report` wrote, and the headline for the terminal."""

    out: Path
    markdown: Path
    results: Path
    plots: tuple[Path, ...]
    summary: tuple[SummaryRow, ...]
    philly: dict[str, Any] | None
    elapsed_s: float


def build_report(cfg: ReportConfig, progress: Progress | None = None) -> Report:
    """Run every study in `cfg.jobs` processes, then write report.md, the plots and results.json."""
    t0 = time.perf_counter()
    done = run_all(cfg, progress)
    philly = done.philly
    published = load_published_fgd(cfg.traces / PUBLISHED_DIR)
    figs = aggregate(done.runs, cfg.workloads, cfg.policies, published)
    summary = summarise(figs, published)
    out = cfg.out
    plots, paths = write_plots(
        figs,
        out,
        len(cfg.seeds),
        philly.delays if philly else None,
        philly.figures["calibration"]["duration_scale"] if philly else 1.0,
    )
    elapsed = time.perf_counter() - t0
    md = render_markdown(
        cfg, figs, summary, done.sharing, philly.figures if philly else None, plots, elapsed, done.cpu_s
    )
    md_path = out / "report.md"
    md_path.write_text(md, encoding="utf-8")
    data = results_json(cfg, done.runs, figs, summary, done.sharing, philly, elapsed, done.cpu_s)
    res_path = write_json(out / "results.json", data)
    return Report(
        out=out,
        markdown=md_path,
        results=res_path,
        plots=tuple(paths),
        summary=tuple(summary),
        philly=philly.figures if philly else None,
        elapsed_s=elapsed,
    )
