"""`cpool exec ID [--rank R] [-t] -- CMD...`: run a command inside a running job's sandbox.

The command runs on the job's node as the job does: the tenant's user, the job's namespaces (its
processes, files, /tmp and network), its cgroup and syscall filter (docs/exec.md). Its output
streams here, this terminal's input goes to it, and `cpool exec` exits with its exit status.
"""

from __future__ import annotations

from typing import Annotated

import typer

from computepool.cli.common import fail
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, pool_command
from computepool.cli.strict_opts import TrailingCommand

RankOpt = Annotated[
    int, typer.Option("--rank", min=0, max=10_000, help="Which member of a gang (default 0).")
]


def exec_in_job(server: list[str] | None, token: str | None, alloc: str, command: list[str], rank: int,
                pty: bool) -> int:  # fmt: skip
    """The command's exit status (the session's errors raise PoolError or ServerUnreachable)."""
    from computepool.client import PoolClient, resolve_config  # noqa: PLC0415 - start-up time
    from computepool.client.relay import run_exec  # noqa: PLC0415

    cfg = resolve_config(server, token)
    with PoolClient.from_config(cfg) as pool:
        return run_exec(pool, cfg.ca, alloc, command, rank, pty)


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
        raise typer.Exit(exec_in_job(server, token, alloc.strip(), command, rank, pty))
