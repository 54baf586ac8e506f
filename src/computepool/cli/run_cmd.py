"""`cpool run -- CMD …`: run a command on pooled capacity and behave like the command itself.

Submit a job (an allocation with a command), show why it waits while it is pending, stream
its output, and exit with its exit code — so `cpool run` drops into scripts where the command
used to be. Ctrl-C cancels the job (or, with --detach, leaves it running).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from computepool.cli.alloc_cmd import (
    AcceleratorOpt,
    ColocateOpt,
    CpusOpt,
    ExclusiveOpt,
    GpuMemOpt,
    GpusOpt,
    ImageOpt,
    IsolationOpt,
    JobTypeOpt,
    MemOpt,
    MigOpt,
    MinGpuMemOpt,
    ModelOpt,
    NameOpt,
    NodesOpt,
    PortOpt,
    PriorityOpt,
    SelectorOpt,
    StackOpt,
    TenantOpt,
    TimeLimitOpt,
    TolerationOpt,
    VendorOpt,
    request_from_options,
    request_text,
    wait_for_binding,
)
from computepool.cli.common import console, err_console, fail
from computepool.cli.logstream import copy_output, ended_line, exit_code
from computepool.cli.pool_cmd import (
    PIPE_WIDTH,
    ServerOpt,
    TokenOpt,
    gpus_text,
    open_client,
    pool_command,
    table,
)
from computepool.cli.secrets_cmd import SecretOpt, secret_uses
from computepool.cli.ship_opts import EnvFileOpt, EnvOpt, NoCodeOpt, NoStdinOpt, OutputOpt, WorkdirOpt
from computepool.cli.strict_opts import TrailingCommand
from computepool.client import PoolClient, PoolError, ServerUnreachable
from computepool.client.http import ENDED_STATES
from computepool.core.allocation import LIVE
from computepool.core.errors import InvalidInput
from computepool.core.quantities import format_mib


class _Hangup(Exception):
    """SIGTERM or SIGHUP arrived: the caller is going away, as with Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_CALLER_GONE = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def _ends_with_caller(mask: set[int | signal.Signals]) -> Iterator[None]:
    """Turn SIGTERM (e.g. from `timeout`) and SIGHUP (a closed terminal) into `_Hangup`, so the job
    is cancelled as with Ctrl-C instead of starting later with no one watching; then restore the
    signal mask `mask` (signals held while the job was created arrive here)."""

    def raise_hangup(signum: int, _frame: object) -> None:
        raise _Hangup(signum)

    before = {s: signal.signal(s, raise_hangup) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _cancel(pool: PoolClient, job_id: str, code: int) -> typer.Exit:
    """Cancel the job; no further signal interrupts the cancel itself."""
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    with contextlib.suppress(PoolError, ServerUnreachable):
        pool.cancel_allocation(job_id)
    return fail(f"cancelled job {job_id}", code=code)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for a closed pipe must not fail the exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run_array(pool: PoolClient, array_id: int) -> int:
    """Follow every member of a job array; Ctrl-C cancels those still live."""
    from computepool.cli import array_run

    try:
        return array_run.follow_array(pool, array_id)
    except KeyboardInterrupt:
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        for m in array_run.members(pool, array_id):
            if m["state"] in LIVE:
                with contextlib.suppress(PoolError, ServerUnreachable):
                    pool.cancel_allocation(str(m["id"]))
        raise fail(f"cancelled array {array_id}", code=130) from None


def register(app: typer.Typer) -> None:
    @app.command(
        "run",
        cls=TrailingCommand,
        context_settings={
            "allow_extra_args": True,
            "ignore_unknown_options": True,
            "allow_interspersed_args": False,
        },
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
        vendor: VendorOpt = None,
        min_gpu_mem: MinGpuMemOpt = None,
        accelerator: AcceleratorOpt = None,
        stack: StackOpt = None,
        job_type: JobTypeOpt = None,
        isolation: IsolationOpt = None,
        image: ImageOpt = None,
        port: PortOpt = None,
        mig: MigOpt = None,
        node_selector: SelectorOpt = None,
        toleration: TolerationOpt = None,
        time_limit: TimeLimitOpt = None,
        gang_nodes: NodesOpt = 1,
        colocate: ColocateOpt = None,
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
        array: Annotated[
            str | None,
            typer.Option(
                "--array",
                help="A job array: one job per index (0-99, 1,3,5 or 0-20:2), %N running at most N at "
                "once; each sees CPOOL_ARRAY_INDEX and CPOOL_ARRAY_COUNT. The array's id is its first "
                "job's: `cpool cancel ID` and `cpool logs ID` act on all, ID_INDEX on one.",
            ),
        ] = None,
        after: Annotated[
            list[str] | None,
            typer.Option(
                "--after",
                help="Start only after allocation ID ended: ID or ID:ok (exit 0), ID:failed, ID:any "
                "(repeatable). One that can never be met ends this job unstarted (failed).",
            ),
        ] = None,
        retries: Annotated[
            int,
            typer.Option(
                "--retries", min=0, max=20, help="Run the job again up to N times when it exits non-zero."
            ),
        ] = 0,
        retry_on_exit: Annotated[
            str | None,
            typer.Option("--retry-on-exit", help="Retry only these exit codes (e.g. 1,137)."),
        ] = None,
        name: NameOpt = None,
        priority: PriorityOpt = 0,
        tenant: TenantOpt = None,
        detach: Annotated[
            bool, typer.Option("--detach", "-d", help="Submit and return; Ctrl-C never cancels.")
        ] = False,
        pty: Annotated[
            bool,
            typer.Option(
                "--pty",
                "-t",
                help="Run CMD on a terminal (`cpool run --pty -- bash`): the job holds its resources "
                "while CMD runs in it as `cpool exec -t` would, and ends with it (docs/exec.md).",
            ),
        ] = False,
        workdir: WorkdirOpt = None,
        no_code: NoCodeOpt = False,
        no_stdin: NoStdinOpt = False,
        env: EnvOpt = None,
        env_file: EnvFileOpt = None,
        secret: SecretOpt = None,
        output: OutputOpt = None,
        task_file: Annotated[
            Path | None,
            typer.Option(
                "--file",
                "-f",
                help="A task file (YAML): command, resources, env, secrets, code, array, after, "
                "retries, … (docs/sdk.md); options typed here override it, words after `--` its command.",
            ),
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Run CMD on the pool: `cpool run --gpus 0.5 -- python train.py`. Exits with CMD's exit code."""
        command = list(ctx.args)
        if task_file is not None:
            from computepool.cli.task_file import file_options, load_task, typed_options

            loaded = load_task(task_file)
            typed = typed_options(ctx)
            cur: dict[str, Any] = dict(
                gpus=gpus, gpu_mem=gpu_mem, cpus=cpus, mem=mem, model=model, image=image, exclusive=exclusive,
                isolation=isolation, time_limit=time_limit, restartable=restartable, array=array, after=after,
                retries=retries, retry_on_exit=retry_on_exit, name=name, workdir=workdir, no_code=no_code,
                secret=secret, priority=priority,
            )  # fmt: skip
            cur.update(file_options(loaded, typed))  # same keys, same order: the file's where not typed
            (gpus, gpu_mem, cpus, mem, model, image, exclusive, isolation, time_limit, restartable, array,
             after, retries, retry_on_exit, name, workdir, no_code, secret,
             priority) = cur.values()  # fmt: skip
            env = [*loaded.env_pairs(), *(env or [])]  # --env wins, one variable at a time
            command = command or loaded.command() or []
        if not command:
            raise InvalidInput(
                "CMD", "nothing to run: put the command after `--`, e.g. cpool run -- nvidia-smi"
            )
        on_terminal: list[str] = []
        if pty:
            from computepool.cli.exec_cmd import HOLDER

            if image or detach or array is not None:
                raise InvalidInput("--pty", "runs a process job and stays attached: not with --image, "
                                   "--detach or --array")  # fmt: skip
            on_terminal, command, no_stdin = command, list(HOLDER), True  # the terminal is its stdin
        req = request_from_options(
            gpus, gpu_mem, cpus, mem, exclusive, model, isolation,
            image=image, ports=port, mig=mig, node_selector=node_selector, time_limit=time_limit,
            tolerations=toleration, nodes=gang_nodes, name=name, command=command, restartable=restartable,
            colocate=colocate, secrets=secret_uses(secret), priority=priority, tenant=tenant,
            vendor=vendor, min_gpu_mem=min_gpu_mem, accelerator=accelerator, stack=stack,
            job_type=job_type,
        )  # fmt: skip
        from computepool.cli import array_run, ship  # ship archives code: loaded by the command that ships

        req = req.changed(
            array=array_run.array_option(array),
            after=array_run.after_option(after),
            retries=retries or None,
            retry_on_exit=array_run.codes_option(retry_on_exit),
        )

        job_env, outputs = ship.parse_env(env, env_file), ship.check_outputs(output)
        if outputs and detach:
            raise InvalidInput("--output", "fetches when the job ends: not with --detach (use `cpool cp`)")
        stdin = ship.read_stdin(enabled=not no_stdin)
        with open_client(server, token, timeout=60.0) as pool:
            if not no_code:
                pool.whoami()  # a wrong token or server fails here, before the code is packed and sent
            req = ship.ship(
                pool, req, workdir=workdir, no_code=no_code, env=job_env, stdin=stdin, env_file=env_file
            )
            # Signals wait while the job is created, so one arriving then still finds its id to cancel.
            held = signal.pthread_sigmask(signal.SIG_BLOCK, _CALLER_GONE)
            try:
                job = pool.create_allocation(req)
            except BaseException:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)  # nothing was created: nothing to cancel
                raise
            if detach:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
            job_id = str(job["id"])
            if array is not None and not detach:
                signal.pthread_sigmask(signal.SIG_SETMASK, held)
                raise typer.Exit(_run_array(pool, int(job_id)))
            if detach:
                err_console.print(
                    f"job {job_id} submitted ({job['state']}); `cpool logs -f {job_id}` follows it",
                    highlight=False,
                )
                return
            try:
                with _ends_with_caller(held):
                    job = wait_for_binding(pool, job, None, quiet=False)
                    if on_terminal and job["state"] not in ENDED_STATES:
                        from computepool.cli.exec_cmd import attach_terminal

                        raise typer.Exit(attach_terminal(pool, server, token, job_id, on_terminal))
                    if job["state"] not in ENDED_STATES:
                        nodes = list(dict.fromkeys(map(str, job.get("nodes") or [])))
                        what = request_text(job.get("request") or {})
                        err_console.print(
                            f"job {job_id} {job['state']} on {', '.join(nodes)}"
                            + (f": {what}" if what != "nothing" else "")
                            + (f" (all {len(nodes)} ranks, prefixed [rank N])" if len(nodes) > 1 else ""),
                            highlight=False,
                            markup=False,
                            style="dim",
                        )
                        job = copy_output(pool, job_id)
            except KeyboardInterrupt:
                raise _cancel(pool, job_id, 130) from None
            except _Hangup as e:
                raise _cancel(pool, job_id, 128 + e.signum) from None
            except BrokenPipeError:  # `cpool run … | head`: no one reads the output any more
                _quiet_stdout()
                raise _cancel(pool, job_id, 128 + signal.SIGPIPE) from None
            fetch_errors = ship.fetch_outputs(pool, job_id, outputs, Path.cwd()) if outputs else []
        code = exit_code(job)
        for line in fetch_errors:
            err_console.print(Text.assemble(("error:", "red"), " ", line), highlight=False)
        if fetch_errors and code == 0:
            code = 1
        if job["state"] != "released" or code != 0:
            err_console.print(
                ended_line(job_id, job),
                highlight=False,
                markup=False,
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
        """A live view of the pool: each device's allocated share and the work queued and running.

        Into a pipe or file (not a terminal) it prints one plain snapshot per refresh instead.
        """
        live_view = console.is_terminal
        with open_client(server, token) as pool:
            plain = Console(file=sys.stdout, width=PIPE_WIDTH, no_color=True)
            view = Live(console=console, auto_refresh=False) if live_view else contextlib.nullcontext()
            with view as live:
                n = 0
                while True:
                    snapshot = _top_view(pool)
                    if live is not None:
                        live.update(snapshot, refresh=True)
                    else:
                        plain.print(snapshot)
                        sys.stdout.flush()
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
