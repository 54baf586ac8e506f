"""`cpool bench chaos`: a real pool under random faults, judged by an oracle (computepool/chaos)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from computepool.cli.common import err_console, fail, friendly_errors, print_json


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("chaos")
    @friendly_errors
    def chaos(
        minutes: Annotated[
            float, typer.Option("--minutes", min=0.5, max=24 * 60, help="How long to fault.")
        ] = 6.0,
        seed: Annotated[int, typer.Option("--seed", help="Draws the workload and the faults.")] = 1,
        faults: Annotated[
            str | None,
            typer.Option(
                "--faults",
                help="Comma-separated fault kinds (default all: leader_kill, leader_freeze, standby_kill, "
                "agent_kill, agent_freeze, freeze_node, database_stop, disk_full).",
            ),
        ] = None,
        keep: Annotated[
            Path | None, typer.Option("--keep", help="Run under this directory and keep its logs.")
        ] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Start two server replicas on a PostgreSQL of the run's own and three root agents with
        simulated GPUs, run a random workload for MINUTES while injecting faults one at a time,
        then check what the API acknowledged against what happened: nothing lost, no attempt
        running twice, no device over capacity, no healthy job failed, the audit chain intact."""
        from computepool.chaos.postgres import PostgresUnavailable
        from computepool.chaos.run import FAULTS, run_chaos

        kinds = tuple(k.strip() for k in faults.split(",") if k.strip()) if faults else FAULTS
        unknown = [k for k in kinds if k not in FAULTS]
        if unknown or not kinds:
            raise fail(f"--faults: unknown kind {', '.join(unknown) or '(none)'}; kinds: {', '.join(FAULTS)}")
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
        say = (lambda _: None) if json_out else (lambda m: err_console.print(m, highlight=False))
        try:
            out = run_chaos(minutes, seed, kinds=kinds, root=keep, say=say)
        except PostgresUnavailable as e:
            raise fail(str(e)) from None
        if json_out:
            print_json(out)
            return
        err_console.print(
            f"{out['operations']} operations, faults {out['faults']}, failover {out['failover_s']}, "
            f"lost {out['lost']}, duplicates {out['duplicates']}",
            highlight=False,
        )
        for v in out["violations"]:
            err_console.print(f"violation: {v}", highlight=False)
        if out["violations"]:
            raise typer.Exit(1)
