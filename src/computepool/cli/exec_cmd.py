"""`cpool exec ID [--rank R] [-t] -- CMD...`: run a command inside a running job's sandbox.

The command runs on the job's node as the job does: the tenant's user, the job's namespaces (its
processes, files, /tmp and network), its cgroup and syscall filter (docs/exec.md). Its output
streams here, this terminal's input goes to it, and `cpool exec` exits with its exit status.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Annotated, Any

import typer

from computepool.cli.common import fail, print_json
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, pool_command
from computepool.cli.strict_opts import TrailingCommand
from computepool.client.errors import PoolError, ServerUnreachable

RankOpt = Annotated[
    int, typer.Option("--rank", min=0, max=10_000, help="Which member of a gang (default 0).")
]


def exec_in_job(server: list[str] | None, token: str | None, alloc: str, command: list[str], rank: int,
                pty: bool, write: Callable[[int, bytes], None] | None = None) -> int:  # fmt: skip
    """The command's exit status (the session's errors raise PoolError or ServerUnreachable)."""
    from computepool.client import PoolClient, resolve_config  # noqa: PLC0415 - start-up time
    from computepool.client.relay import run_exec  # noqa: PLC0415

    cfg = resolve_config(server, token)
    with PoolClient.from_config(cfg) as pool:
        return run_exec(pool, cfg.ca, alloc, command, rank, pty, write)


HOLDER = ["sleep", "infinity"]  # what a `cpool run --pty` job runs while the terminal is attached


def attach_terminal(pool: Any, server: list[str] | None, token: str | None, job_id: str,
                    command: list[str]) -> int:  # fmt: skip
    """`cpool run --pty`: once the holder job runs, `command` on a terminal in it; the job is
    cancelled when the command ends. The command's exit status."""
    from computepool.client.http import ENDED_STATES  # noqa: PLC0415 - start-up time

    job = pool.get_allocation(job_id)
    while job["state"] not in ENDED_STATES and job["state"] != "active":
        job = pool.get_allocation(job_id, wait=10.0, state=job["state"])
    if job["state"] != "active":
        raise fail(f"job {job_id} ended before its terminal opened: {job.get('reason') or job['state']}", 1)
    try:
        return exec_in_job(server, token, job_id, command, 0, True)
    finally:
        with contextlib.suppress(PoolError, ServerUnreachable):
            pool.cancel_allocation(job_id)


def register(app: typer.Typer) -> None:
    @app.command(
        "exec",
        cls=TrailingCommand,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                          "allow_interspersed_args": False},
    )  # fmt: skip
    @pool_command
    def exec_(
        ctx: typer.Context,
        alloc: Annotated[str, typer.Argument(help="The running job's allocation id.", show_default=False)],
        rank: RankOpt = 0,
        pty: Annotated[
            bool, typer.Option("--pty", "-t", help="Run it on a terminal (a shell, an editor, top).")
        ] = False,
        as_json: Annotated[
            bool,
            typer.Option(
                "--json", help="Print {exit_code, stdout, stderr} as JSON once CMD ends (not with -t)."
            ),
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Run CMD in a running job: `cpool exec 42 -- nvidia-smi`, `cpool exec 42 -t -- bash`."""
        command = list(ctx.args)
        if command[:1] == ["--"]:
            command = command[1:]
        if not alloc.strip().isdigit():
            raise fail(f"ID: expected an allocation id (a number), got {alloc!r}", code=2)
        if not command:
            raise fail("give the command to run after `--`, e.g. `cpool exec 42 -- bash`", code=2)
        if as_json and pty:
            raise fail("--json collects the output of a command without a terminal: not with -t", code=2)
        if not as_json:
            raise typer.Exit(exec_in_job(server, token, alloc.strip(), command, rank, pty))
        got: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        code = exec_in_job(
            server, token, alloc.strip(), command, rank, False, lambda fd, b: got[fd].extend(b)
        )
        out = {"exit_code": code, "stdout": got[1].decode(errors="replace"),
               "stderr": got[2].decode(errors="replace")}  # fmt: skip
        print_json(out)
        raise typer.Exit(code)
