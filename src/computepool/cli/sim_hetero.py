"""`cpool sim hetero`: a V100/P100/K80 cluster under the pool's agnostic policy and the speed-aware one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from computepool.cli.common import console, friendly_errors, print_json

_ROWS = (
    ("completed", "jobs completed"),
    ("avg_jct_s", "average JCT (h)"),
    ("p99_jct_s", "p99 JCT (h)"),
    ("makespan_s", "makespan (h)"),
    ("utilization", "GPU utilization"),
    ("preemptions", "preemptions"),
)


def register(sim_app: typer.Typer) -> None:
    @sim_app.command("hetero")
    @friendly_errors
    def hetero(
        trace: Annotated[Path, typer.Option("--trace", help="A Gavel job trace (.trace, tab-separated).")],
        cluster: Annotated[
            str, typer.Option("--cluster", help="V100:P100:K80 GPU counts, e.g. 36:36:36.")
        ] = "36:36:36",
        policy: Annotated[
            str,
            typer.Option(
                "--policy", help="agnostic, aware, both, fair (aware's rounds blind to speed) or all."
            ),
        ] = "both",
        throughputs: Annotated[
            Path | None,
            typer.Option(
                "--throughputs", help="Gavel's simulation_throughputs.json (default: beside the trace)."
            ),
        ] = None,
        jobs: Annotated[int | None, typer.Option("--jobs", help="Only the first N jobs by arrival.")] = None,
        rate: Annotated[
            float | None,
            typer.Option("--rate", help="Re-time arrivals as a Poisson stream of this many jobs an hour."),
        ] = None,
        sample: Annotated[
            int | None,
            typer.Option(
                "--sample", help="With --rate: draw this many jobs from the trace (with replacement)."
            ),
        ] = None,
        window: Annotated[
            str | None, typer.Option("--window", help="A:B — JCT figures over jobs A..B-1 by arrival only.")
        ] = None,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the --rate arrivals and --sample.")] = 0,
        gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node (one type).")] = 8,
        round_s: Annotated[float, typer.Option("--round-s", help="Round of the aware policy (s).")] = 360.0,
        restart_s: Annotated[
            float, typer.Option("--restart-s", help="Seconds lost at each start or restart of a job.")
        ] = 10.0,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Replay a Gavel trace on V100/P100/K80 GPUs: the pool's heterogeneity-agnostic policy (queue
        order, any free GPUs, no preemption) and the aware one (Gavel's max-min shares in effective
        throughput, 6-minute rounds). Steps/s per job and GPU type are Gavel's measurements."""
        from computepool.sim.hetero_run import HeteroSpec, run  # numpy/scipy: only when it runs

        spec = HeteroSpec(
            trace=trace,
            cluster=cluster,
            throughputs=throughputs,
            policy=policy,
            jobs=jobs,
            rate_per_h=rate,
            sample=sample,
            window=window,
            seed=seed,
            gpus_per_node=gpus_per_node,
            round_s=round_s,
            restart_s=restart_s,
        )
        out = run(spec)
        if json_out:
            print_json(out)
            return
        policies = [p for p in ("agnostic", "fair", "aware") if p in out]
        table = Table(title=f"{out['jobs']} jobs of {trace.name} on {cluster} (V100:P100:K80)")
        table.add_column("figure")
        for p in policies:
            table.add_column(p, justify="right")
        for key, label in _ROWS:
            cells = []
            for p in policies:
                figures = out[p]
                assert isinstance(figures, dict)
                v = figures[key]
                cells.append(f"{v / 3600:.1f}" if key.endswith("_s") else str(v))
            table.add_row(label, *cells)
        console.print(table)
        if "avg_jct_ratio" in out:
            console.print(f"average JCT, agnostic / aware: {out['avg_jct_ratio']}×", highlight=False)
