"""`cpool sim report`: rerun every comparison and write report.md, PNG plots and results.json."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table

from computepool.cli.common import console, friendly_errors, progress_bar
from computepool.scheduler.policy_names import POLICIES
from computepool.sim.report_config import (
    DEFAULT_SEEDS,
    DEFAULT_WORKLOADS,
    QUICK_POLICIES,
    QUICK_SEEDS,
    QUICK_WORKLOADS,
    ReportConfig,
)

if TYPE_CHECKING:  # numpy and matplotlib load only when a report is built
    from computepool.sim.report import Report


def _mark(ok: bool | None) -> str:
    return "-" if ok is None else ("✓" if ok else "✗")


def _print_summary(rep: Report) -> None:
    """A compact version of report.md's summary table that fits 80 columns."""
    from computepool.sim.report import DEFAULT_MARGIN_PTS, MATCH_PTS, fmt

    table = Table(
        title="unallocated GPU % at arrived = 100%: ours (mean over seeds) vs published",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption=(
            f"checks: bestfit, fgd within ±{MATCH_PTS} of published; "
            f"default ≤ published fgd + {DEFAULT_MARGIN_PTS}. "
            "FFD: offline first-fit-decreasing; LB: lower bound"
        ),
    )
    for i, h in enumerate(("workload", "pub bf", "bf", "pub fgd", "fgd", "default", "FFD", "LB", "checks")):
        table.add_column(h, justify="right" if 0 < i < 8 else "left", no_wrap=True)
    for r in rep.summary:
        cells = [r.published_bestfit, r.ours_bestfit, r.published_fgd, r.ours_fgd, r.ours_default]
        cells += [r.offline_ffd, r.lower_bound]
        checks = " ".join(_mark(c) for c in (r.bestfit_matches, r.fgd_matches, r.default_within_fgd))
        table.add_row(r.workload, *(fmt(c) for c in cells), checks)
    console.print(table)
    ph = rep.philly
    if ph is not None:
        cal, par = ph["calibration"], ph["parity"]
        st, po = ph["calibrated"]["static"], ph["calibrated"]["pooled"]
        parity = (
            f"parity at {par['nodes']} of {par['static_nodes']} nodes "
            f"({par['gpus_saved_pct']:.1f}% fewer GPUs)"
            if par["nodes"] is not None
            else "no pooled size up to static's matches its average queueing"
        )
        console.print(
            f"Philly at durations x{cal['duration_scale']:.3f}: avg queue static {st['avg_queue_s']:,.0f} s, "
            f"pooled {po['avg_queue_s']:,.0f} s; {parity}",
            highlight=False,
        )
        fair = ph.get("fair_parity")
        if fair and fair["nodes"] is not None:
            console.print(
                f"guaranteed-share: no VC worse off at {fair['nodes']} of {fair['static_nodes']} nodes "
                f"({fair['gpus_saved_pct']:.1f}% fewer GPUs)",
                highlight=False,
            )
    console.print(
        f"report: {rep.markdown}  (raw figures: {rep.results}; {len(rep.plots)} plots)", highlight=False
    )
    console.print(f"took {rep.elapsed_s:,.0f} s", highlight=False)


def register(sim_app: typer.Typer) -> None:
    @sim_app.command("report")
    @friendly_errors
    def report(
        out: Annotated[
            Path, typer.Option("--out", help="Directory for report.md, the plots and results.json.")
        ],
        seeds: Annotated[
            str | None,
            typer.Option(
                "--seeds",
                help=f"Seeds: a range, a list or both, e.g. 42-46 or 42,44 (default {DEFAULT_SEEDS}).",
            ),
        ] = None,
        workloads: Annotated[
            str | None,
            typer.Option(
                "--workloads",
                help=(
                    "Comma-separated pod lists openb_pod_list_<w>.csv "
                    f"(default {','.join(DEFAULT_WORKLOADS)})."
                ),
            ),
        ] = None,
        policies: Annotated[
            str | None,
            typer.Option("--policies", help=f"Comma-separated policies (default {','.join(POLICIES)})."),
        ] = None,
        jobs: Annotated[int, typer.Option("--jobs", help="Worker processes.", min=1)] = 2,
        quick: Annotated[
            bool,
            typer.Option(
                "--quick",
                help=(
                    f"A fast look: seeds {','.join(map(str, QUICK_SEEDS))}, workloads "
                    f"{','.join(QUICK_WORKLOADS)}, policies {','.join(QUICK_POLICIES)} "
                    "(options given explicitly still win)."
                ),
            ),
        ] = False,
        replay: Annotated[
            bool, typer.Option("--replay/--no-replay", help="Include the Philly replay (about 80 s of CPU).")
        ] = True,
    ) -> None:
        """Fill-up vs the FGD paper, static vs pooled, and the Philly replay, in one Markdown report."""
        from computepool.sim.report import build_report

        cfg = ReportConfig.from_options(
            out, seeds=seeds, workloads=workloads, policies=policies, jobs=jobs, quick=quick, replay=replay
        )
        with progress_bar("sim report: runs done", sys.stdout.isatty()) as update:
            rep = build_report(cfg, progress=update)
        _print_summary(rep)
