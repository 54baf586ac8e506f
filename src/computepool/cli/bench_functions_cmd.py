"""`cpool bench functions`: remote function call latency (warm, cold) and `map` throughput."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from computepool.cli.common import err_console
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, pool_command


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("functions")
    @pool_command
    def functions(
        warm_calls: Annotated[
            int, typer.Option("--warm-calls", min=1, max=100_000, help="Sequential calls on a warm worker.")
        ] = 200,
        cold_calls: Annotated[
            int, typer.Option("--cold-calls", min=1, max=1000, help="Sequential calls, a new worker each.")
        ] = 10,
        map_calls: Annotated[
            int, typer.Option("--map-calls", min=1, max=1_000_000, help="Inputs of the timed `map`.")
        ] = 1000,
        workers: Annotated[
            int, typer.Option("--workers", min=1, max=256, help="Warm workers serving the `map`.")
        ] = 8,
        ray: Annotated[
            bool,
            typer.Option("--ray/--no-ray", help="Also time the same calls as Ray tasks, when ray imports."),
        ] = True,
        ray_python: Annotated[
            str | None,
            typer.Option("--ray-python", help="The Python whose ray to time (default: this one)."),
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Time no-op remote calls: on a warm worker (warm_*), each on a new worker with no pip
        (cold_*: scheduling, the agent's start, Python's start), and a `map` over --map-calls inputs
        with --workers warm workers (map_calls_per_s). Against --server/--token, else $CPOOL_SERVER/
        $CPOOL_TOKEN; with none of them it starts its own `cpool up --simulate 1xA100-80GB` on a free
        loopback port, in a temp dir. ray: the warm calls and the map as Ray tasks on a local Ray with
        --workers CPUs (null when ray does not import)."""
        from computepool.cli.bench_pool_cmd import _run_with, _show
        from computepool.client.bench_pool import LocalProcess
        from computepool.client.config import ENV_SERVER, ENV_TOKEN
        from computepool.sdk.bench import FunctionsBench, run_functions_bench, run_ray_side
        from computepool.sdk.pool import Pool

        settings = FunctionsBench(
            warm_calls=warm_calls, cold_calls=cold_calls, map_calls=map_calls, workers=workers
        )

        def run(local: LocalProcess | None) -> dict[str, Any]:
            with Pool(server=local.url if local else server, token=local.token if local else token) as pool:
                if not json_out:
                    err_console.print(f"timing functions against {pool.server} …", highlight=False)
                out = run_functions_bench(pool, settings)
            return {"server": "local `cpool up`" if local else pool.server, **out}

        local_pool = not (server or token or os.environ.get(ENV_SERVER) or os.environ.get(ENV_TOKEN))
        out = _run_with("up" if local_pool else None, run, json_out)
        if ray:
            if not json_out:
                err_console.print("timing the same calls as Ray tasks …", highlight=False)
            try:
                out["ray"] = run_ray_side(settings, ray_python)
            except RuntimeError as e:  # the pool's figures stand; say why Ray's are missing
                out["ray"] = None
                out["ray_error"] = str(e)
        else:
            out["ray"] = None
        _show("Function benchmark", out, json_out)
