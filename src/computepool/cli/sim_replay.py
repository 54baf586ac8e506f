"""`cpool sim replay`: replay the Philly trace with queues, static partitions versus pooled."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from computepool.core.errors import InvalidInput
from computepool.sim.prices import DEFAULT_GPU_HOUR_PRICE, DEFAULT_KWH_PRICE

if TYPE_CHECKING:  # numpy loads only when a replay runs
    from computepool.sim.philly import Published
    from computepool.sim.replay import FairParity, Parity, ReplayResult

REPLAY_POLICIES = ("proportional", "guaranteed-share")  # as sim.replay.POLICIES, without numpy
CRITERIA = ("overall", "every-vc")

_PER = (
    ("avg_queue_s", "queue s"),
    ("p99_queue_s", "p99 s"),
    ("avg_jct_s", "JCT s"),
    ("gpu_alloc_pct", "alloc %"),
    ("preemptions", "preempt"),
    ("lost_work_pct", "lost %"),
)
_FIGURES = (
    ("avg_queue_s", "avg queue s"),
    ("p50_queue_s", "p50 queue s"),
    ("p99_queue_s", "p99 queue s"),
    ("avg_jct_s", "avg JCT s"),
    ("gpu_alloc_pct", "GPU alloc %"),
    ("preemptions", "preempt"),
    ("lost_gpu_hours", "lost GPU-h"),
    ("lost_work_pct", "lost %"),
)


@contextmanager
def _progress(show: bool, what: str) -> Iterator[Callable[[str], None] | None]:
    """A Rich progress line on stderr for long searches; nothing when output is JSON."""
    if not show:
        yield None
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=None, last="")

        def step(msg: str) -> None:
            bar.update(task, last=msg)
            bar.console.log(msg)

        yield step


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def _report(res: ReplayResult, published: dict[str, Published]) -> dict[str, object]:
    out = res.as_dict()
    parts = out["per_partition"]
    assert isinstance(parts, list)
    if res.mode == "static":
        for p in parts:
            pub = published.get(p["partition"])
            if pub is not None:
                p["published_queue_s"] = pub.queue_avg_s
                p["published_jct_s"] = pub.jct_avg_s
        if "all" in published:
            out["published_queue_s"] = published["all"].queue_avg_s
            out["published_jct_s"] = published["all"].jct_avg_s
    return out


def _parity_report(p: Parity) -> dict[str, object]:
    pooled = p.pooled.overall if p.pooled is not None else None
    return {
        "parity_nodes": p.nodes,
        "parity_gpus_saved_pct": p.gpus_saved_pct,
        "parity": {
            "nodes": p.nodes,
            "static_nodes": p.static.nodes,
            "static_avg_queue_s": p.static.overall.avg_queue_s,
            "avg_queue_s": pooled.avg_queue_s if pooled else None,
            "avg_jct_s": pooled.avg_jct_s if pooled else None,
            "gpu_alloc_pct": pooled.gpu_alloc_pct if pooled else None,
            "preemptions": pooled.preemptions if pooled else None,
            "lost_gpu_hours": pooled.lost_gpu_hours if pooled else None,
            "lost_work_pct": pooled.lost_work_pct if pooled else None,
            "probes": [{"nodes": n, "avg_queue_s": q} for n, q in p.probes],
            "per_partition": [c.as_dict() for c in p.per_vc()],
        },
    }


def _fair_report(p: FairParity) -> dict[str, object]:
    from computepool.sim.replay import CRITERION

    pooled = p.pooled.overall if p.pooled is not None else None
    return {
        "parity_nodes": p.nodes,
        "parity_gpus_saved_pct": p.gpus_saved_pct,
        "parity": {
            "criterion": CRITERION,
            "policy": p.policy,
            "nodes": p.nodes,
            "static_nodes": p.static.nodes,
            "static_avg_queue_s": p.static.overall.avg_queue_s,
            "avg_queue_s": pooled.avg_queue_s if pooled else None,
            "avg_jct_s": pooled.avg_jct_s if pooled else None,
            "gpu_alloc_pct": pooled.gpu_alloc_pct if pooled else None,
            "preemptions": pooled.preemptions if pooled else None,
            "lost_gpu_hours": pooled.lost_gpu_hours if pooled else None,
            "lost_work_pct": pooled.lost_work_pct if pooled else None,
            "probes": [{"nodes": n, "vcs_worse_off": w} for n, w in p.probes],
            "per_partition": [v.as_dict() for v in p.per_vc()],
            "vcs_worse_off": sum(v.worse for v in p.per_vc()),
        },
    }


def _tables(out: dict[str, object], console: Console) -> None:
    scale = float(str(out["duration_scale"]))
    head = Table(title=f"replay: {out['mode']}, {out['nodes']} nodes, duration x{scale:.4g}")
    head.add_column("figure")
    head.add_column("value", justify="right")
    for key, label in _FIGURES:
        head.add_row(label, _fmt(out[key]))
    for key in ("published_queue_s", "published_jct_s", "published_avg_queue_s", "elapsed_s"):
        if key in out:
            head.add_row(key, _fmt(out[key]))
    console.print(head)
    per = Table(title="per partition")
    per.add_column("VC")
    per.add_column("jobs", justify="right")
    for _, label in _PER:
        per.add_column(label, justify="right")
    static = out["mode"] == "static"
    if static:
        per.add_column("pub. queue s", justify="right")
        per.add_column("pub. JCT s", justify="right")
    for p in out["per_partition"]:  # type: ignore[attr-defined]
        row = [p["partition"], _fmt(p["jobs"])] + [_fmt(p[k]) for k, _ in _PER]
        if static:
            row += [_fmt(p.get("published_queue_s", "")), _fmt(p.get("published_jct_s", ""))]
        per.add_row(*row)
    console.print(per)
    parity = out.get("parity")
    if isinstance(parity, dict):
        console.print(
            f"parity: {out['parity_nodes']} nodes (static {parity['static_nodes']}), "
            f"{_fmt(out['parity_gpus_saved_pct'])}% fewer GPUs, avg queue "
            f"{_fmt(parity['avg_queue_s'])} s vs static {_fmt(parity['static_avg_queue_s'])} s, "
            f"lost work {_fmt(parity['lost_work_pct'])}%"
        )
        cmp = Table(title="per partition at parity")
        fair = "criterion" in parity
        second = (
            (("static p95 s", "static_p95_queue_s"), ("pooled p95 s", "pooled_p95_queue_s"))
            if fair
            else (("static JCT s", "static_avg_jct_s"), ("pooled JCT s", "pooled_avg_jct_s"))
        )
        cols = (("static queue s", "static_avg_queue_s"), ("pooled queue s", "pooled_avg_queue_s"), *second)
        cmp.add_column("VC")
        for label, _ in cols:
            cmp.add_column(label, justify="right")
        cmp.add_column("")
        for c in parity["per_partition"]:
            verdict = ("worse off" if c["worse_off"] else "no worse") if fair else c["verdict"]
            cmp.add_row(c["partition"], *(_fmt(c[k]) for _, k in cols), verdict)
        console.print(cmp)
        if fair:
            console.print(f"criterion: {parity['criterion']}", highlight=False)
    energy = out.get("energy")
    if isinstance(energy, dict):
        runs = [k for k, v in energy.items() if isinstance(v, dict) and "energy_kwh" in v]
        et = Table(title=f"energy and cost over {energy['horizon_hours']} h")
        et.add_column("figure")
        for r in runs:
            et.add_column(r, justify="right")
        for key in energy[runs[0]]:
            et.add_row(key, *(_fmt(energy[r][key]) for r in runs))
        console.print(et)
        for k, v in energy.items():
            if "_vs_" in k:
                console.print(f"{k}: {v}", highlight=False)
        pm = energy["power_model"]
        for name, m in pm["models"].items():
            console.print(
                f"power model {name}: idle {m['idle_w']} W, peak {m['peak_w']} W ({m['source']}); "
                f"{pm['utilization']}; empty devices {pm['empty_devices']}",
                highlight=False,
            )


def register(app: typer.Typer) -> None:
    """Add the `replay` command to `app` (mounted as `cpool sim replay`)."""

    @app.command("replay")
    def replay_cmd(
        jobs: Annotated[Path | None, typer.Option(help="philly_jobs.csv")] = None,
        partitions: Annotated[
            Path | None, typer.Option(help="philly_vc.csv (VC sizes in 8-GPU nodes)")
        ] = None,
        published: Annotated[Path | None, typer.Option(help="helios_static_vc_published.csv")] = None,
        mode: Annotated[str, typer.Option(help="static | pooled")] = "static",
        policy: Annotated[
            str,
            typer.Option(
                help=(
                    "pooled guarantees: proportional (static sizes scaled down to the pool) or "
                    "guaranteed-share (every VC keeps its whole static size; borrowing above it "
                    "is preemptible)"
                )
            ),
        ] = "proportional",
        parity_criterion: Annotated[
            str | None,
            typer.Option(
                help=(
                    "what --find-parity matches: overall (average queueing over all jobs) or "
                    "every-vc (every VC's mean and p95 queueing at most its static figures); "
                    "default overall for proportional, every-vc for guaranteed-share"
                )
            ),
        ] = None,
        gpu_model: Annotated[
            str | None, typer.Option(help="GPU model for energy (the trace names none; default P100)")
        ] = None,
        gpu_price: Annotated[
            list[str] | None,
            typer.Option(help="price per GPU-hour, MODEL=AMOUNT (repeatable)", metavar="MODEL=AMOUNT"),
        ] = None,
        gpu_price_default: Annotated[
            float, typer.Option(help="price per GPU-hour of models not given (placeholder)")
        ] = DEFAULT_GPU_HOUR_PRICE,
        kwh_price: Annotated[float, typer.Option(help="price per kWh (placeholder)")] = DEFAULT_KWH_PRICE,
        empty_powered: Annotated[
            bool,
            typer.Option(
                "--empty-powered/--empty-off",
                help="count GPUs running nothing as powered on at idle draw (default), or off",
            ),
        ] = True,
        nodes: Annotated[int | None, typer.Option(help="pooled cluster size in 8-GPU nodes")] = None,
        duration_scale: Annotated[
            float | None, typer.Option(help="multiply every duration (default 1)")
        ] = None,
        calibrate_: Annotated[
            bool,
            typer.Option("--calibrate", help="find the scale matching the published queueing"),
        ] = False,
        parity: Annotated[
            bool, typer.Option("--find-parity", help="smallest pooled cluster matching static")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    ) -> None:
        """Replay the Philly trace with queues: static VC partitions or one pooled cluster."""
        from computepool.sim.energy import compare_replays
        from computepool.sim.philly import (
            ASSUMED_GPU_MODEL,
            PUBLISHED_AVG_QUEUE_S,
            load_jobs,
            load_published,
            load_vcs,
            traces_dir,
        )
        from computepool.sim.prices import Prices
        from computepool.sim.replay import calibrate, find_fair_parity, find_parity, replay

        def fail(msg: str) -> NoReturn:
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(2)

        if mode not in ("static", "pooled"):
            fail(f"--mode {mode!r} must be static or pooled")
        if nodes is not None and (mode != "pooled" or nodes <= 0):
            fail("--nodes needs --mode pooled and a positive count")
        if duration_scale is not None and calibrate_:
            fail("give --duration-scale or --calibrate, not both")
        if duration_scale is not None and not duration_scale > 0:
            fail(f"--duration-scale {duration_scale} must be positive")
        if policy not in REPLAY_POLICIES:
            fail(f"--policy {policy!r} must be one of {', '.join(REPLAY_POLICIES)}")
        criterion = parity_criterion or ("every-vc" if policy == "guaranteed-share" else "overall")
        if criterion not in CRITERIA:
            fail(f"--parity-criterion {criterion!r} must be one of {', '.join(CRITERIA)}")
        if criterion == "overall" and policy != "proportional":
            fail("--parity-criterion overall searches the proportional policy; use every-vc")
        model = gpu_model or ASSUMED_GPU_MODEL
        if not model.strip():
            fail("--gpu-model must not be empty")
        try:
            prices = Prices.parse(gpu_price or [], gpu_price_default, kwh_price)
        except InvalidInput as e:
            fail(str(e))
        base = traces_dir() / "philly"
        try:
            vcs = load_vcs(partitions or base / "philly_vc.csv")
            trace = load_jobs(jobs or base / "philly_jobs.csv", vcs)
            pub_path = published or base / "helios_static_vc_published.csv"
            pubs = load_published(pub_path) if published or pub_path.exists() else {}
        except InvalidInput as e:
            fail(str(e))
        except OSError as e:
            fail(f"{e.filename or ''}: {e.strerror or e}")
        console = Console()
        t0 = time.perf_counter()
        scale = duration_scale if duration_scale is not None else 1.0
        static_res: ReplayResult | None = None
        if calibrate_:
            with _progress(not as_json, "calibrating duration scale") as step:
                cal = calibrate(trace, progress=step)
            scale = cal.duration_scale
            static_res = cal.result
        reuse = mode == "static" and static_res is not None
        res = (
            static_res
            if static_res is not None and reuse
            else replay(trace, "static" if mode == "static" else "pooled", scale, nodes, policy=policy)
        )
        if mode == "static":
            static_res = res
        out = _report(res, pubs)
        if calibrate_:
            out["calibrated"] = True
            out["published_avg_queue_s"] = pubs["all"].queue_avg_s if "all" in pubs else PUBLISHED_AVG_QUEUE_S
        runs: dict[str, ReplayResult] = {res.mode: res}
        if parity:
            with _progress(not as_json, "searching parity node count") as step:
                if criterion == "overall":
                    par = find_parity(trace, scale, static=static_res, progress=step)
                    out.update(_parity_report(par))
                    static_res, at_parity = par.static, par.pooled
                else:
                    fair = find_fair_parity(trace, scale, policy, static=static_res, progress=step)
                    out.update(_fair_report(fair))
                    static_res, at_parity = fair.static, fair.pooled
            runs = {"static": static_res}
            if at_parity is not None:
                runs[f"pooled_{at_parity.nodes}_nodes"] = at_parity
        out["energy"] = compare_replays(runs, model, prices, empty_powered=empty_powered)
        out["elapsed_s"] = round(time.perf_counter() - t0, 2)
        if as_json:
            typer.echo(json.dumps(out))
        else:
            _tables(out, console)
