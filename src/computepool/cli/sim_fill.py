"""`cpool sim fill` and `cpool sim static-vs-pooled`: the fill-up protocol on the Alibaba trace."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from computepool.cli.common import console, friendly_errors, print_json, progress_bar
from computepool.sim.csvread import traces_dir

POLICY_HELP = (
    "Scoring policy: random, dotprod, clustering, packing, bestfit, fgd (as published: it learns "
    "the workload's typical requests from the whole trace in advance, i.e. future knowledge), or "
    "default (the pool's policy: learns the request distribution online, past requests only)."
)


def default_cluster() -> Path:
    return traces_dir() / "alibaba-v2023" / "openb_node_list_gpu_node.csv"


def default_workload() -> Path:
    return traces_dir() / "alibaba-v2023" / "openb_pod_list_default.csv"


def workload_name(path: Path) -> str:
    stem = path.stem
    return stem.removeprefix("openb_pod_list_")


ClusterOpt = Annotated[
    Path | None, typer.Option("--cluster", help="Node list CSV (default: the trace's GPU nodes).")
]
WorkloadOpt = Annotated[
    Path | None, typer.Option("--workload", help="Pod list CSV (default: openb default).")
]
SeedOpt = Annotated[
    int, typer.Option("--seed", help="Seed of the shuffle, the inflation and the node ranks.")
]
TuneOpt = Annotated[
    float, typer.Option("--tune", help="Inflate arrivals to TUNE × capacity.", min=0.1, max=5.0)
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def register(sim_app: typer.Typer) -> None:
    @sim_app.command("fill")
    @friendly_errors
    def fill(
        cluster: ClusterOpt = None,
        workload: WorkloadOpt = None,
        policy: Annotated[str, typer.Option("--policy", help=POLICY_HELP)] = "default",
        seed: SeedOpt = 42,
        tune: TuneOpt = 1.3,
        json_out: JsonOpt = False,
        curve: Annotated[
            bool,
            typer.Option(
                "--curve/--no-curve",
                help="Include the curves (allocation, fragmentation amount and rate by arrived %).",
            ),
        ] = True,
    ) -> None:
        """Fill the cluster with the workload's pods (no departures) and measure what is left."""
        from computepool.scheduler.policies import POLICIES  # numpy: only when the command runs
        from computepool.sim.alibaba import load_nodes, load_pods
        from computepool.sim.fill import run_fill

        if policy not in POLICIES:
            raise ValueError(f"--policy: unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
        cluster = cluster or default_cluster()
        workload = workload or default_workload()
        nodes = load_nodes(cluster)
        pods = load_pods(workload)
        with progress_bar(f"fill {workload_name(workload)} with {policy}", not json_out) as update:
            res = run_fill(
                nodes,
                pods,
                policy,
                seed,
                tune=tune,
                workload=workload_name(workload),
                progress=update,
            )
        out = res.summary()
        if not curve:
            for key in ("curve", "frag_curve", "frag_rate_curve"):
                out.pop(key)
        if json_out:
            print_json(out)
            return
        table = Table(title=f"fill-up: {res.workload}, policy {policy}, seed {seed}, tune {tune}")
        table.add_column("figure")
        table.add_column("value", justify="right")
        for key in (
            "unallocated_pct_at_100",
            "unallocated_pct_at_130",
            "frag_rate_pct_at_90",
            "offline_ffd_unallocated_pct",
            "lower_bound_unallocated_pct",
            "pods_arrived",
            "pods_failed",
            "elapsed_s",
        ):
            table.add_row(key, str(out[key]))
        console.print(table)
        if res.first_failure:
            console.print(f"first failure: {res.first_failure}", highlight=False)

    @sim_app.command("static-vs-pooled")
    @friendly_errors
    def static_pooled(
        cluster: ClusterOpt = None,
        workload: WorkloadOpt = None,
        seed: SeedOpt = 42,
        tune: TuneOpt = 1.3,
        json_out: JsonOpt = False,
    ) -> None:
        """Whole-device static allocation against fractional pooling, same pods, same order."""
        from computepool.sim.alibaba import load_nodes, load_pods
        from computepool.sim.sharing import static_vs_pooled

        cluster = cluster or default_cluster()
        workload = workload or default_workload()
        nodes = load_nodes(cluster)
        pods = load_pods(workload)
        with progress_bar("static vs pooled", not json_out) as update:
            res = static_vs_pooled(nodes, pods, seed, tune, progress=update)
        out = {k: dataclasses.asdict(v) for k, v in res.items()}
        if json_out:
            print_json(out)
            return
        table = Table(title=f"static vs pooled: {workload_name(workload)}, seed {seed}")
        table.add_column("figure")
        table.add_column("static", justify="right")
        table.add_column("pooled", justify="right")
        for key in out["static"]:
            if key == "mode":
                continue
            table.add_row(key, str(out["static"][key]), str(out["pooled"][key]))
        console.print(table)
