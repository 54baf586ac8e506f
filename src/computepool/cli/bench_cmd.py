"""`cpool bench scheduler`: placement throughput and decision latency on a synthetic pool."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import typer
from rich.table import Table

from computepool.cli.common import console, friendly_errors, print_json, progress_bar


def register(bench_app: typer.Typer) -> None:
    from computepool.cli import (
        bench_coop_cmd,
        bench_failover_cmd,
        bench_functions_cmd,
        bench_jobs_cmd,
        bench_serve_cmd,
    )

    bench_jobs_cmd.register(bench_app)  # `cpool bench jobs`
    bench_functions_cmd.register(bench_app)  # `cpool bench functions`
    bench_serve_cmd.register(bench_app)  # `cpool bench serve`
    bench_coop_cmd.register(bench_app)  # `cpool bench coop`
    bench_failover_cmd.register(bench_app)  # `cpool bench failover`

    @bench_app.command("scheduler")
    @friendly_errors
    def scheduler(
        nodes: Annotated[int, typer.Option("--nodes", min=1, max=100_000)] = 1000,
        gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, max=16)] = 8,
        requests: Annotated[int, typer.Option("--requests", min=1, max=10_000_000)] = 100_000,
        policy: Annotated[str, typer.Option("--policy")] = "default",
        seed: Annotated[int, typer.Option("--seed")] = 0,
        json_out: Annotated[bool, typer.Option("--json")] = False,
        link_group_size: Annotated[
            int,
            typer.Option(
                "--link-group-size",
                min=0,
                max=16,
                help="Devices per NVLink group on every node (0: no groups).",
            ),
        ] = 0,
    ) -> None:
        """Place a mix of fractional, whole and multi-GPU requests on a busy heterogeneous pool.

        placements_per_s counts place+commit decisions per second of scheduler time; releases of
        old allocations (to hold the pool near 85% allocated) are not counted in it.
        """
        from computepool.scheduler.policies import POLICIES  # numpy: only when the command runs
        from computepool.sim.synthetic import run_bench

        if policy not in POLICIES or policy == "fgd":
            raise ValueError(f"--policy: choose from {', '.join(p for p in POLICIES if p != 'fgd')}")
        with progress_bar("placing", not json_out) as update:
            res = run_bench(
                nodes, gpus_per_node, requests, policy, seed, progress=update, link_group_size=link_group_size
            )
        out = dataclasses.asdict(res)
        if json_out:
            print_json(out)
            return
        table = Table(title=f"scheduler benchmark: {nodes} nodes × {gpus_per_node} GPUs, {policy}")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for k, v in out.items():
            table.add_row(k, str(v))
        console.print(table)
