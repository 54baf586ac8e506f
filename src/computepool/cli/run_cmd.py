"""`cpool run -- CMD …`: run a command on pooled capacity and behave like the command itself.

Submit a job (an allocation with a command), show why it waits while it is pending, stream
its output, and exit with its exit code — so `cpool run` drops into scripts where the command
used to be. Ctrl-C cancels the job (or, with --detach, leaves it running).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Annotated, Any

import typer
from rich.live import Live
from rich.markup import escape

from computepool.cli.alloc_cmd import (
    CpusOpt,
    ExclusiveOpt,
    GpuMemOpt,
    GpusOpt,
    ImageOpt,
    IsolationOpt,
    MemOpt,
    MigOpt,
    ModelOpt,
    PortOpt,
    SelectorOpt,
    TimeLimitOpt,
    TolerationOpt,
    request_from_options,
    request_text,
    wait_for_binding,
)
from computepool.cli.common import err_console, fail
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, gpus_text, open_client, pool_command, table
from computepool.client import PoolClient, PoolError
from computepool.client.http import ENDED_STATES
from computepool.core.allocation import LIVE
from computepool.core.errors import InvalidInput
from computepool.core.quantities import format_mib

LOG_WAIT_S = 10.0


def _stream_until_ended(pool: PoolClient, alloc_id: str) -> dict[str, Any]:
    """Print the job's output as it comes; return the allocation once it ended and all is out."""
    offset = 0
    while True:
        out = pool.allocation_logs(alloc_id, offset=offset, wait=LOG_WAIT_S)
        data = out.get("data") or ""
        if data:
            sys.stdout.write(data)
            sys.stdout.flush()
        offset = int(out.get("next_offset", offset))
        if out.get("ended") and not data:
            alloc = pool.get_allocation(alloc_id)
            if alloc.get("state") in ENDED_STATES:
                return alloc
        if not data and not out.get("ended"):
            alloc = pool.get_allocation(alloc_id)
            if alloc.get("state") in ENDED_STATES:
                # the end is recorded; one more read drains what the agent sent last
                rest = pool.allocation_logs(alloc_id, offset=offset)
                sys.stdout.write(rest.get("data") or "")
                sys.stdout.flush()
                return alloc
            time.sleep(0.2)  # a server that answered at once instead of long-polling


def _exit_code(alloc: dict[str, Any]) -> int:
    code = alloc.get("exit_code")
    if isinstance(code, int):
        return code if 0 <= code < 256 else 1
    return 0 if alloc.get("state") == "released" else 1


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @pool_command
    def run(
        ctx: typer.Context,
        gpus: GpusOpt = "0",
        gpu_mem: GpuMemOpt = None,
        cpus: CpusOpt = "0",
        mem: MemOpt = "0",
        exclusive: ExclusiveOpt = False,
        model: ModelOpt = None,
        isolation: IsolationOpt = None,
        image: ImageOpt = None,
        port: PortOpt = None,
        mig: MigOpt = None,
        node_selector: SelectorOpt = None,
        toleration: TolerationOpt = None,
        time_limit: TimeLimitOpt = None,
        restartable: Annotated[
            bool,
            typer.Option(
                "--restartable",
                help="Start it again from the beginning (a new attempt, queued again) when it is "
                "preempted, its node is lost, drained or removed, or the agent loses its process; "
                "its node also stops it when cut off from the control plane, so only one copy ever "
                "runs. Without it, preemption or node loss ends the job (preempted/failed) and a "
                "drained node lets it finish. A failing exit or a time limit is never retried.",
            ),
        ] = False,
        name: Annotated[str | None, typer.Option("--name", help="A name for people.")] = None,
        detach: Annotated[
            bool, typer.Option("--detach", "-d", help="Submit and return; Ctrl-C never cancels.")
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Run CMD on the pool: `cpool run --gpus 0.5 -- python train.py`. Exits with CMD's exit code."""
        command = list(ctx.args)
        if not command:
            raise InvalidInput(
                "CMD", "nothing to run: put the command after `--`, e.g. cpool run -- nvidia-smi"
            )
        req = request_from_options(
            gpus, gpu_mem, cpus, mem, exclusive, model, isolation,
            image=image, ports=port, mig=mig, node_selector=node_selector, time_limit=time_limit,
            tolerations=toleration, name=name, command=command, restartable=restartable,
        )  # fmt: skip
        with open_client(server, token, timeout=60.0) as pool:
            job = pool.create_allocation(req)
            job_id = str(job["id"])
            if detach:
                err_console.print(
                    f"job {job_id} submitted ({job['state']}); `cpool logs -f {job_id}` follows it",
                    highlight=False,
                )
                return
            try:
                job = wait_for_binding(pool, job, None, quiet=False)
                if job["state"] not in ENDED_STATES:
                    err_console.print(
                        f"job {job_id} {job['state']} on {', '.join(map(str, job.get('nodes') or []))}: "
                        f"{escape(request_text(job.get('request') or {}))}",
                        highlight=False,
                        style="dim",
                    )
                    job = _stream_until_ended(pool, job_id)
            except KeyboardInterrupt:
                with contextlib.suppress(PoolError):
                    pool.cancel_allocation(job_id)
                raise fail(f"cancelled job {job_id}", code=130) from None
        code = _exit_code(job)
        if job["state"] != "released" or code != 0:
            err_console.print(
                f"job {job_id} {job['state']}: {job.get('reason') or 'no reason given'}",
                highlight=False,
                style="dim" if job["state"] in ("released", "failed") else None,
            )
        raise typer.Exit(code)

    @app.command("top")
    @pool_command
    def top(
        interval: Annotated[
            float, typer.Option("--interval", min=0.2, help="Seconds between refreshes.")
        ] = 2.0,
        iterations: Annotated[
            int, typer.Option("--iterations", min=0, help="Stop after N (0: forever).")
        ] = 0,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """A live view of the pool: each device's allocated share and the work queued and running."""
        with open_client(server, token) as pool, Live(console=err_console, auto_refresh=False) as live:
            n = 0
            while True:
                live.update(_top_view(pool), refresh=True)
                n += 1
                if iterations and n >= iterations:
                    return
                try:
                    time.sleep(interval)
                except KeyboardInterrupt:
                    return


def _bar(share: float, width: int = 20) -> str:
    full = max(0, min(width, round(share * width)))
    return "█" * full + "·" * (width - full)


def _top_view(pool: PoolClient) -> Any:
    from rich.console import Group

    nodes = pool.list_nodes()
    allocs = [a for s in LIVE for a in pool.list_allocations(s)]
    used: dict[tuple[str, int], list[int]] = {}
    for a in allocs:
        if a.get("state") == "pending":
            continue
        for s in a.get("slices") or []:
            u = used.setdefault((s["node"], int(s["device_index"])), [0, 0])
            u[0] += int(s.get("compute_milli") or 0)
            u[1] += int(s.get("memory_mib") or 0)
    dev_table = table("devices", "node", "state", "device", "model", "allocated", "compute", "memory")
    for nd in nodes:
        for d in nd.get("devices") or []:
            c, m = used.get((nd["name"], int(d["index"])), [0, 0])
            cap = int(d.get("compute_milli") or 1000)
            dev_table.add_row(
                escape(nd["name"]),
                str(nd.get("state", "")),
                str(d["index"]),
                escape(str(d.get("model", ""))),
                _bar(c / cap if cap else 0.0),
                f"{gpus_text(c)}/{gpus_text(cap)}",
                f"{format_mib(m)}/{format_mib(int(d.get('memory_mib') or 0))}",
            )
    work = table("work", "id", "tenant", "state", "request", "nodes")
    for a in allocs:
        work.add_row(
            str(a["id"]),
            str(a.get("tenant", "")),
            str(a.get("state", "")),
            escape(request_text(a.get("request") or {})),
            escape(",".join(map(str, a.get("nodes") or []))),
        )
    return Group(dev_table, work)
