"""`cpool bench api`: allocate-and-release cycles from many concurrent clients against a live server."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.table import Table

from computepool.cli.common import console, err_console, print_json
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, pool_command
from computepool.client import resolve_config
from computepool.core.errors import InvalidInput


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("api")
    @pool_command
    def api(
        clients: Annotated[int, typer.Option("--clients", min=1, max=1000, help="Concurrent clients.")] = 50,
        seconds: Annotated[float, typer.Option("--seconds", min=0.1, max=3600, help="Run time.")] = 30.0,
        nodes: Annotated[
            int, typer.Option("--nodes", min=1, max=1000, help="Simulated nodes to join for the run.")
        ] = 20,
        gpus: Annotated[
            float, typer.Option("--gpus", min=0.001, max=1.0, help="GPU share per cycle.")
        ] = 0.25,
        keep_nodes: Annotated[
            bool, typer.Option("--keep-nodes", help="Leave the simulated nodes in the pool afterwards.")
        ] = False,
        allow_remote: Annotated[
            bool, typer.Option("--allow-remote", help="Allow a server that is not on loopback.")
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    ) -> None:
        """Each cycle: submit a fractional allocation, wait until bound, release it.

        p50_ms/p99_ms time the submit (POST round trip); cycle_* the whole cycle; ops_per_s counts
        completed cycles per second. With an admin token it joins --nodes simulated nodes of its
        own for the run; other tokens use the pool's ready nodes.
        """
        from computepool.client.bench import BenchSettings, is_loopback, run_api_bench  # aiohttp

        cfg = resolve_config(server, token)
        if not cfg.token:
            raise InvalidInput(
                "--token", "the benchmark needs a token (--token, $CPOOL_TOKEN or `cpool login`)"
            )
        if not allow_remote and not is_loopback(cfg.server):
            raise InvalidInput("--server", f"{cfg.server} is not loopback; pass --allow-remote to load it")
        settings = BenchSettings(
            server=cfg.server,
            token=cfg.token,
            clients=clients,
            seconds=seconds,
            nodes=nodes,
            gpu_milli=max(1, round(gpus * 1000)),
            keep_nodes=keep_nodes,
            bind_timeout_s=max(5.0, min(30.0, seconds)),
        )
        if not json_out:
            err_console.print(f"{clients} clients for {seconds:g} s against {cfg.server} …", highlight=False)
        out = asyncio.run(run_api_bench(settings))
        if json_out:
            print_json(out)
            return
        t = Table(title=f"API benchmark: {clients} clients, {seconds:g} s")
        t.add_column("figure")
        t.add_column("value", justify="right")
        for k, v in out.items():
            t.add_row(k, str(v))
        console.print(t)
