"""`cpool cp ALLOC:PATH LOCAL`: copy a file or directory a job wrote (in its work dir) to this machine.

The node that ran the job packs PATH as the job's own user and sends it through the control plane
(client/blobs.py); it works while the job runs and after it ended, as long as its node keeps the
run directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from computepool.cli.common import err_console, print_json
from computepool.cli.pool_cmd import ServerOpt, TokenOpt, open_client, pool_command
from computepool.core.errors import InvalidInput


def split_source(text: str) -> tuple[str, str]:
    """`ALLOC:PATH` → (allocation id, path relative to the job's work dir)."""
    alloc, sep, path = text.partition(":")
    if not sep or not alloc.strip().isdigit() or not path:
        raise InvalidInput("SOURCE", f"expected ALLOC:PATH, e.g. 42:out/model.pt, got {text!r}")
    return alloc.strip(), path


def register(app: typer.Typer) -> None:
    @app.command("cp")
    @pool_command
    def cp(
        source: Annotated[str, typer.Argument(help="ALLOC:PATH, PATH relative to the job's work dir.")],
        dest: Annotated[Path, typer.Argument(help="Where to put it (into it, if a directory).")],
        rank: Annotated[
            int | None, typer.Option("--rank", min=0, help="Which member of a gang (default rank 0).")
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print {source, path} as JSON.")] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
    ) -> None:
        """Copy a file or directory a job wrote back from its node: `cpool cp 42:out/ ./results`."""
        alloc, path = split_source(source)
        with open_client(server, token, timeout=60.0) as pool:
            left_out: list[str] = []
            landed = pool.download(alloc, path.rstrip("/") or path, dest, rank=rank, left_out=left_out)
        if as_json:
            print_json({"source": source, "path": str(landed), "left_out": left_out})
        else:
            err_console.print(f"{source} → {landed}", style="dim", highlight=False, markup=False)
            if left_out:
                from computepool.cli.ship import left_out_note  # noqa: PLC0415 - start-up time

                err_console.print(left_out_note(left_out), style="dim", highlight=False, markup=False)
