"""The `cpool` command: one Typer app; each command group lives in its own module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="ComputePool: one pool of GPUs and CPUs.")
sim_app = typer.Typer(no_args_is_help=True, help="Replay real cluster traces through the scheduler.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON figures.")
app.add_typer(sim_app, name="sim")
app.add_typer(bench_app, name="bench")


@app.callback()
def _root(
    ca: Annotated[
        Path | None,
        typer.Option(
            "--ca",
            envvar="CPOOL_CA",
            help="PEM file an https server's certificate must chain to (else what `cpool login` saved).",
        ),
    ] = None,
) -> None:
    """ComputePool: one pool of GPUs and CPUs."""
    if ca is not None:
        os.environ["CPOOL_CA"] = str(ca.expanduser().absolute())  # read by every client this run makes


def _register() -> None:
    from computepool.cli import (
        access_cmd,
        agent_cmd,
        alloc_cmd,
        audit_cmd,
        bench_api_cmd,
        bench_cmd,
        bench_cycle_cmd,
        bench_pool_cmd,
        nodes_cmd,
        quota_cmd,
        run_cmd,
        server_cmd,
        sim_fill,
        sim_replay,
        sim_report,
        tenants_cmd,
        up_cmd,
    )

    sim_fill.register(sim_app)
    sim_replay.register(sim_app)
    sim_report.register(sim_app)
    bench_cmd.register(bench_app)
    server_cmd.register(app)
    agent_cmd.register(app)
    up_cmd.register(app)
    access_cmd.register_login(app)  # the order of `cpool --help`
    tenants_cmd.register(app)
    access_cmd.register_tokens(app)
    quota_cmd.register(app)
    access_cmd.register_join_token(app)
    audit_cmd.register(app)
    nodes_cmd.register(app)
    alloc_cmd.register(app)
    run_cmd.register(app)
    bench_api_cmd.register(bench_app)
    bench_cycle_cmd.register(bench_app)
    bench_pool_cmd.register(bench_app)


def main() -> None:
    _register()
    app()


if __name__ == "__main__":
    main()
