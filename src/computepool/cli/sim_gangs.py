"""`cpool sim gangs`: gangs in a stream of small jobs, replayed with and without reservation."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from computepool.cli.common import console, friendly_errors, print_json

_ROWS = (
    ("gangs_started", "gangs started in the window"),
    ("gang_wait_p50_min", "gang wait p50 (min)"),
    ("gang_wait_max_min", "gang wait max (min)"),
    ("small_wait_p50_min", "small-job wait p50 (min)"),
    ("small_wait_p95_min", "small-job wait p95 (min)"),
    ("gpu_util_pct", "GPU utilization %"),
    ("jobs_finished", "jobs finished in the window"),
    ("backfilled", "backfilled onto reserved nodes"),
    ("reserved_idle_gpu_h", "GPU-h idle for a reservation"),
)


def register(sim_app: typer.Typer) -> None:
    @sim_app.command("gangs")
    @friendly_errors
    def gangs(
        seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic trace.")] = 1,
        hours: Annotated[
            float, typer.Option("--hours", min=1.0, max=24 * 365, help="Arrival window.")
        ] = 48.0,
        nodes: Annotated[int, typer.Option("--nodes", min=2, max=1024, help="Nodes of the pool.")] = 8,
        gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, max=16)] = 8,
        gang_nodes: Annotated[int, typer.Option("--gang-nodes", min=2, help="Whole nodes per gang.")] = 4,
        gang_every_h: Annotated[
            float, typer.Option("--gang-every-h", min=0.1, help="Mean hours between gangs.")
        ] = 6.0,
        small_load: Annotated[
            float,
            typer.Option(
                "--small-load",
                min=0.05,
                max=2.0,
                help="GPUs the single-GPU jobs ask for, as a share of the pool.",
            ),
        ] = 0.75,
        policy: Annotated[
            str, typer.Option("--policy", help="The scoring policy (the pool's: default).")
        ] = "default",
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Replay single-GPU jobs (with time limits) and gangs of whole nodes on a small pool, twice:
        without reservation, and with reservation and backfill. Deterministic from the seed."""
        from computepool.scheduler.policies import POLICIES  # numpy: only when the command runs
        from computepool.sim.gangs import TraceSpec, compare

        if policy not in POLICIES or policy == "fgd":
            raise ValueError(f"--policy: unknown or offline-only policy {policy!r}")
        if gang_nodes > nodes:
            raise ValueError(f"--gang-nodes: {gang_nodes} is more than the pool's {nodes} nodes")
        spec = TraceSpec(
            seed=seed,
            hours=hours,
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            small_load=small_load,
            gang_nodes=gang_nodes,
            gang_every_h=gang_every_h,
        )
        out = compare(spec, policy)
        if json_out:
            print_json(out)
            return
        trace = out["trace"]
        assert isinstance(trace, dict)
        table = Table(
            title=f"{trace['small_jobs']} single-GPU jobs and {trace['gangs']} gangs of {gang_nodes}×"
            f"{gpus_per_node} GPUs, {hours:g} h on {nodes} nodes, seed {seed}"
        )
        table.add_column("figure")
        table.add_column("without reservation", justify="right")
        table.add_column("with reservation", justify="right")
        without, with_ = out["without_reservation"], out["with_reservation"]
        assert isinstance(without, dict) and isinstance(with_, dict)
        for key, label in _ROWS:
            table.add_row(label, str(without[key]), str(with_[key]))
        console.print(table)
        console.print(
            f"utilization cost of the reservation: {out['utilization_cost_pct_points']} points "
            f"(negative: a gain); {out['reserved_idle_pct']}% of the pool's GPU time held idle for gangs",
            highlight=False,
        )
