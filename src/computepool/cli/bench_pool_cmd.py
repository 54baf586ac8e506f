"""`cpool bench starts` and `cpool bench agents`: job start latency and heartbeat load on a live pool."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from computepool.cli.common import console, err_console, print_json
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, pool_command
from computepool.client import resolve_config
from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerArg

if TYPE_CHECKING:  # aiohttp and friends load only when a benchmark runs
    from computepool.client.bench_pool import LocalProcess

JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
AllowRemote = Annotated[bool, typer.Option("--allow-remote", help="Allow a server that is not on loopback.")]


def _target(
    server: ServerArg, token: str | None, allow_remote: bool, local: LocalProcess | None
) -> tuple[str, str]:
    from computepool.client.bench import is_loopback

    if local is not None:
        return local.url, local.token
    cfg = resolve_config(server, token)
    if not cfg.token:
        raise InvalidInput("--token", "the benchmark needs a token (--token, $CPOOL_TOKEN or `cpool login`)")
    if not allow_remote and not is_loopback(cfg.server):
        raise InvalidInput("--server", f"{cfg.server} is not loopback; pass --allow-remote to load it")
    return cfg.server, cfg.token


def _publish_here(url: str, token: str, image: str) -> None:
    """Publish `image` (as this machine's podman has it) on the pool the benchmark started."""
    from computepool.client import PoolClient
    from computepool.client.config import ClientConfig
    from computepool.client.images import local_image_id

    found = local_image_id(image)
    if found is None:
        raise InvalidInput("--image", f"no image {image} in this machine's podman")
    with PoolClient.from_config(ClientConfig(server=url, token=token)) as pool:
        pool.publish_image(image, found)


def _run_with(
    kind: str | None, run: Callable[[LocalProcess | None], dict[str, Any]], json_out: bool
) -> dict[str, Any]:
    from computepool.client.bench_pool import LocalProcess

    if kind is None:
        return run(None)
    if not json_out:
        err_console.print(f"starting `cpool {kind}` on a free loopback port …", highlight=False)
    try:
        local = LocalProcess(kind)
        with local:
            return run(local)
    except RuntimeError as e:
        raise InvalidInput(f"--start-{'pool' if kind == 'up' else 'server'}", str(e)) from None


def _show(title: str, out: dict[str, Any], json_out: bool) -> None:
    if json_out:
        print_json(out)
        return
    t = Table(title=title)
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k, v in out.items():
        t.add_row(k, str(v))
    console.print(t)


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("starts")
    @pool_command
    def starts(
        count: Annotated[int, typer.Option("--count", min=1, max=100_000, help="Jobs to run.")] = 200,
        concurrency: Annotated[
            int, typer.Option("--concurrency", min=1, max=1000, help="Jobs in flight.")
        ] = 10,
        cpus: Annotated[float, typer.Option("--cpus", min=0.001, max=64, help="CPU share per job.")] = 0.1,
        job_timeout: Annotated[
            float, typer.Option("--job-timeout", min=1, max=3600, help="Seconds a job may take to end.")
        ] = 60.0,
        hold: Annotated[
            float,
            typer.Option(
                "--hold", min=0, max=3600, help="Seconds each job runs (sleeps); 0: `python -c pass`."
            ),
        ] = 0.0,
        start_pool: Annotated[
            bool,
            typer.Option(
                "--start-pool",
                help="Run against a fresh `cpool up --simulate 1xA100-80GB` (temp dir, free port).",
            ),
        ] = False,
        image: Annotated[
            str | None,
            typer.Option(
                "--image",
                help="Run each job in a container of this image (on the node already; needs python3).",
            ),
        ] = None,
        allow_remote: AllowRemote = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOut = False,
    ) -> None:
        """Submit --count short CPU-only jobs (python printing the time, gpus=0), --concurrency in flight.

        start_latency_* is created_at → started_at on the server's clock (when the agent launched
        the job); workload_start_* is created_at → the time the job printed (its first instruction
        ran: for --image, after podman made the container); end_to_end_* is submit → ended as the
        client saw it; failed counts jobs that did not end `released`; peak_running is the most
        jobs whose recorded runs overlapped (with --hold, how many one agent ran at once).
        `executor` says which sandbox ran the jobs: process, or container (--image).
        """

        def run(local: LocalProcess | None) -> dict[str, Any]:
            from computepool.client.bench_pool import JobsSettings, run_jobs_bench

            url, tok = _target(server, token, allow_remote, local)
            if local is not None and image:
                _publish_here(url, tok, image)
            s = JobsSettings(
                server=url,
                token=tok,
                count=count,
                concurrency=concurrency,
                cpu_milli=max(1, round(cpus * 1000)),
                job_timeout_s=max(job_timeout, hold + 30),
                hold_s=hold,
                image=image or None,
            )
            if not json_out:
                err_console.print(f"{count} jobs, {concurrency} in flight, against {url} …", highlight=False)
            return asyncio.run(run_jobs_bench(s))

        out = _run_with("up" if start_pool else None, run, json_out)
        _show(f"Job benchmark: {count} jobs, {concurrency} in flight", out, json_out)

    @bench_app.command("agents")
    @pool_command
    def agents(
        count: Annotated[int, typer.Option("--count", min=1, max=10_000, help="Simulated agents.")] = 1000,
        seconds: Annotated[float, typer.Option("--seconds", min=0.1, max=3600, help="Run time.")] = 60.0,
        interval: Annotated[
            float, typer.Option("--interval", min=0.05, max=600, help="Heartbeat interval per agent.")
        ] = 5.0,
        connections: Annotated[
            int,
            typer.Option("--connections", min=1, max=2000, help="HTTP connections (heartbeats in flight)."),
        ] = 100,
        keep_nodes: Annotated[
            bool, typer.Option("--keep-nodes", help="Leave the bench-agent-* nodes in the pool afterwards.")
        ] = False,
        start_server: Annotated[
            bool,
            typer.Option("--start-server", help="Run against a fresh `cpool server` (temp dir, free port)."),
        ] = False,
        server_pid: Annotated[
            int | None, typer.Option("--server-pid", help="Measure this server process's CPU use.")
        ] = None,
        allow_remote: AllowRemote = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOut = False,
    ) -> None:
        """Join --count simulated nodes (bench-agent-NNNN, one device each) and heartbeat each every
        --interval s for --seconds, spread evenly; heartbeat_lag_* is (send − scheduled) + response time.

        Needs an admin token (join tokens, node deletion). server_cpu_pct is null unless the server
        was started here (--start-server) or --server-pid names it.
        """

        def run(local: LocalProcess | None) -> dict[str, Any]:
            from computepool.client.bench_pool import AgentsSettings, run_agents_bench

            url, tok = _target(server, token, allow_remote, local)
            pid = local.server_pid() if local is not None else server_pid
            s = AgentsSettings(
                server=url,
                token=tok,
                count=count,
                seconds=seconds,
                interval_s=interval,
                keep_nodes=keep_nodes,
                server_pid=pid,
                connections=connections,
            )
            if not json_out:
                err_console.print(
                    f"{count} agents every {interval:g} s for {seconds:g} s against {url} …", highlight=False
                )
            return asyncio.run(run_agents_bench(s))

        out = _run_with("server" if start_server else None, run, json_out)
        _show(f"Agent benchmark: {count} agents, {interval:g} s interval, {seconds:g} s", out, json_out)
