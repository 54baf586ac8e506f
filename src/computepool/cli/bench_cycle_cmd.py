"""`cpool bench cycle`: the control plane's scheduling cycle on a large pool, with its database."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from computepool.cli.common import console, err_console, friendly_errors, print_json


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("cycle")
    @friendly_errors
    def cycle(
        nodes: Annotated[int, typer.Option("--nodes", min=1, max=20_000)] = 1000,
        gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, max=16)] = 8,
        pending: Annotated[int, typer.Option("--pending", min=1, max=200_000)] = 10_000,
        cycles: Annotated[int, typer.Option("--cycles", min=1, max=100, help="Steady and churn cycles.")] = 3,
        churn: Annotated[
            int,
            typer.Option("--churn", min=0, max=100_000, help="Releases and new requests per churn cycle."),
        ] = 100,
        db: Annotated[
            str | None,
            typer.Option(
                "--db",
                help="PostgreSQL URL whose server gets a scratch database (created and dropped); "
                "default SQLite in a temporary directory.",
            ),
        ] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Fill a fresh database with NODES x GPUS and PENDING requests, then time the real
        controller's cycles: the first (many binds), steady ones, and ones after churn."""
        from computepool.server.bench_cycle import CycleBenchSettings, run_cycle_bench  # the server

        s = CycleBenchSettings(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            pending=pending,
            steady_cycles=cycles,
            churn=churn,
            db_url=db,
        )
        if not json_out:
            err_console.print(f"filling {nodes} nodes and {pending} requests …", highlight=False)
        out = run_cycle_bench(s)
        if json_out:
            print_json(out)
            return
        t = Table(title=f"scheduling cycle: {nodes} nodes x {gpus_per_node} GPUs, {pending} pending")
        for col in ("cycle", "seconds", "snapshot_s", "decide_s", "commit_s", "pending", "binds"):
            t.add_column(col, justify="right")
        rows = [("first", out["first"])]
        rows += [(f"steady {i + 1}", r) for i, r in enumerate(out["steady"])]
        rows += [(f"churn {i + 1}", r) for i, r in enumerate(out["churn"])]
        for name, r in rows:
            t.add_row(
                name,
                *(str(r[k]) for k in ("seconds", "snapshot_s", "decide_s", "commit_s", "pending", "binds")),
            )
        console.print(t)
