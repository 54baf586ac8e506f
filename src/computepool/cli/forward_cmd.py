"""`cpool forward ID [LOCAL:]PORT`: reach a port a running job listens on (its own loopback) from
this machine's 127.0.0.1:LOCAL, through the control plane and the job's node (docs/exec.md)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from computepool.cli.common import err_console, fail, print_json
from computepool.cli.exec_cmd import RankOpt
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, pool_command
from computepool.core.errors import InvalidInput


def split_ports(text: str) -> tuple[int, int]:
    """`[LOCAL:]PORT` → (local, port); LOCAL defaults to PORT, 0 picks a free one."""
    local, sep, port = text.rpartition(":")
    try:
        p = int(port)
        loc = int(local) if sep else p
    except ValueError:
        raise InvalidInput("PORT", f"expected [LOCAL:]PORT, e.g. 8888 or 9000:8888, got {text!r}") from None
    if not 1 <= p <= 65535:
        raise InvalidInput("PORT", f"{p} is not a TCP port (1-65535)")
    if not 0 <= loc <= 65535:
        raise InvalidInput("LOCAL", f"{loc} is not a TCP port (0-65535; 0 picks a free one)")
    return loc, p


def register(app: typer.Typer) -> None:
    @app.command("forward")
    @pool_command
    def forward(
        alloc: Annotated[str, typer.Argument(help="The running job's allocation id.", show_default=False)],
        ports: Annotated[str, typer.Argument(help="[LOCAL:]PORT: the job's PORT on 127.0.0.1:LOCAL here.")],
        rank: RankOpt = 0,
        as_json: Annotated[
            bool, typer.Option("--json", help="Say where it listens as JSON {local, port, allocation}.")
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Forward 127.0.0.1:LOCAL here to PORT in a running job: `cpool forward 42 8888`. Ctrl-C ends it."""
        from computepool.client import PoolClient, resolve_config  # noqa: PLC0415 - start-up time
        from computepool.client.relay import Forwarder  # noqa: PLC0415

        if not alloc.strip().isdigit():
            raise fail(f"ID: expected an allocation id (a number), got {alloc!r}", code=2)
        local, port = split_ports(ports)
        cfg = resolve_config(server, token)

        def say(line: str) -> None:
            err_console.print(line, style="dim", highlight=False, markup=False)

        with PoolClient.from_config(cfg) as pool:
            try:
                fwd = Forwarder(pool, cfg.ca, alloc.strip(), port, rank, local, say)
            except OSError as e:
                raise fail(f"cannot listen on 127.0.0.1:{local}: {e.strerror or e}", code=1) from None
            if as_json:
                print_json({"local": fwd.local, "port": port, "allocation": int(alloc)})
                sys.stdout.flush()
            else:
                print(f"Forwarding 127.0.0.1:{fwd.local} -> port {port} of allocation {alloc.strip()} "
                      "(Ctrl-C to stop)", flush=True)  # fmt: skip
            try:
                fwd.serve()
            except KeyboardInterrupt:
                raise typer.Exit(0) from None
