"""`cpool sim fill` and `cpool sim static-vs-pooled`: the fill-up protocol on the Alibaba trace."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from computepool.cli.common import console, friendly_errors, print_json, progress_bar
from computepool.sim.csvread import traces_dir
from computepool.sim.prices import DEFAULT_GPU_HOUR_PRICE, DEFAULT_KWH_PRICE

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
GpuPriceOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--gpu-price",
        help="Price per GPU-hour of one model, MODEL=AMOUNT (repeatable), e.g. V100M32=2.5.",
        metavar="MODEL=AMOUNT",
    ),
]
GpuPriceDefaultOpt = Annotated[
    float,
    typer.Option("--gpu-price-default", help="Price per GPU-hour of models not given (placeholder 1.0)."),
]
KwhPriceOpt = Annotated[float, typer.Option("--kwh-price", help="Price per kWh (placeholder 0.15).")]
EmptyOpt = Annotated[
    bool,
    typer.Option(
        "--empty-powered/--empty-off",
        help="Count devices holding nothing as powered on at idle draw (default), or as off.",
    ),
]


def energy_table(title: str, columns: dict[str, Any]) -> Table:
    """Energy and cost figures side by side, one column per run (e.g. static, pooled)."""
    table = Table(title=title)
    table.add_column("figure")
    for name in columns:
        table.add_column(name, justify="right")
    keys = next(iter(columns.values())).keys()
    for key in keys:
        table.add_row(key, *(str(c[key]) for c in columns.values()))
    return table


def print_power_model(model: dict[str, Any]) -> None:
    """The idle/peak watts per model and the assumptions, under any energy figure."""
    models = model["models"]
    assert isinstance(models, dict)
    for name, m in models.items():
        console.print(
            f"  {name}: idle {m['idle_w']} W, peak {m['peak_w']} W ({m['source']})", highlight=False
        )
    for key in ("utilization", "empty_devices", "cost"):
        console.print(f"  {key}: {model[key]}", highlight=False)


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
        gpu_price: GpuPriceOpt = None,
        gpu_price_default: GpuPriceDefaultOpt = DEFAULT_GPU_HOUR_PRICE,
        kwh_price: KwhPriceOpt = DEFAULT_KWH_PRICE,
        empty_powered: EmptyOpt = True,
        curve: Annotated[
            bool,
            typer.Option(
                "--curve/--no-curve",
                help="Include the curves (allocation, fragmentation amount and rate by arrived %).",
            ),
        ] = True,
        cpu_only_scale: Annotated[
            float,
            typer.Option(
                "--cpu-only-scale",
                help="Multiply the workload's CPU-only pods by this (≥ 1; the fractional part is a fixed "
                "sample of them), for mixes heavier in CPU-only work than the published lists.",
            ),
        ] = 1.0,
    ) -> None:
        """Fill the cluster with the workload's pods (no departures) and measure what is left."""
        from computepool.scheduler.policies import POLICIES  # numpy: only when the command runs
        from computepool.sim.alibaba import load_nodes, load_pods
        from computepool.sim.fill import run_fill
        from computepool.sim.prices import Prices

        prices = Prices.parse(gpu_price or [], gpu_price_default, kwh_price)
        if policy not in POLICIES:
            raise ValueError(f"--policy: unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
        cluster = cluster or default_cluster()
        workload = workload or default_workload()
        nodes = load_nodes(cluster)
        pods = load_pods(workload)
        name = workload_name(workload)
        if cpu_only_scale != 1.0:
            from computepool.sim.variants import scale_cpu_only

            pods = scale_cpu_only(pods, cpu_only_scale)
            name = f"{name}-cpu-only-x{cpu_only_scale:g}"
        with progress_bar(f"fill {name} with {policy}", not json_out) as update:
            res = run_fill(
                nodes,
                pods,
                policy,
                seed,
                tune=tune,
                workload=name,
                progress=update,
                prices=prices,
                empty_powered=empty_powered,
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
        en: dict[str, Any] = res.energy
        console.print(
            energy_table(
                "energy and cost per hour of the placement",
                {"at 100%": en["at_100"], "at end": en["at_end"]},
            )
        )
        print_power_model(en["power_model"])

    @sim_app.command("static-vs-pooled")
    @friendly_errors
    def static_pooled(
        cluster: ClusterOpt = None,
        workload: WorkloadOpt = None,
        seed: SeedOpt = 42,
        tune: TuneOpt = 1.3,
        json_out: JsonOpt = False,
        gpu_price: GpuPriceOpt = None,
        gpu_price_default: GpuPriceDefaultOpt = DEFAULT_GPU_HOUR_PRICE,
        kwh_price: KwhPriceOpt = DEFAULT_KWH_PRICE,
        empty_powered: EmptyOpt = True,
    ) -> None:
        """Whole-device static allocation against fractional pooling, same pods, same order."""
        from computepool.sim.alibaba import load_nodes, load_pods
        from computepool.sim.prices import Prices
        from computepool.sim.sharing import static_vs_pooled

        prices = Prices.parse(gpu_price or [], gpu_price_default, kwh_price)
        cluster = cluster or default_cluster()
        workload = workload or default_workload()
        nodes = load_nodes(cluster)
        pods = load_pods(workload)
        with progress_bar("static vs pooled", not json_out) as update:
            res = static_vs_pooled(
                nodes, pods, seed, tune, progress=update, prices=prices, empty_powered=empty_powered
            )
        out: dict[str, Any] = {k: dataclasses.asdict(v) for k, v in res.items()}
        out["savings"] = savings_at(out)
        if json_out:
            print_json(out)
            return
        table = Table(title=f"static vs pooled: {workload_name(workload)}, seed {seed}")
        table.add_column("figure")
        table.add_column("static", justify="right")
        table.add_column("pooled", justify="right")
        for key in out["static"]:
            if key in ("mode", "energy"):
                continue
            table.add_row(key, str(out["static"][key]), str(out["pooled"][key]))
        console.print(table)
        energy = {m: out[m]["energy"] for m in ("static", "pooled")}
        for at, label in (("at_100", "at arrived = 100%"), ("at_end", "at the end")):
            cols = {m: e[at] for m, e in energy.items()}
            console.print(energy_table(f"energy and cost per hour {label}", cols))
        console.print(f"pooled vs static: {out['savings']}", highlight=False)
        print_power_model(energy["static"]["power_model"])


def savings_at(out: dict[str, Any]) -> dict[str, object]:
    """Per served GPU-hour, what pooling saves against static (the fair figure: static serves less)."""
    res: dict[str, object] = {}
    for at in ("at_100", "at_end"):
        st = out["static"]["energy"][at]
        po = out["pooled"]["energy"][at]
        per = {}
        for key in ("kwh_per_served_gpu_hour", "cost_per_served_gpu_hour"):
            a, b = float(st[key]), float(po[key])
            per[key + "_saved_pct"] = round(100.0 * (a - b) / a, 2) if a else 0.0
        per["served_gpu_hours_static"] = st["served_gpu_hours"]
        per["served_gpu_hours_pooled"] = po["served_gpu_hours"]
        res[at] = per
    return res
