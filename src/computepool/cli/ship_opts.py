"""The options of `cpool run` that ship code, stdin and environment, and fetch results (cli/ship.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

WorkdirOpt = Annotated[
    Path | None,
    typer.Option(
        "--workdir",
        help="Ship this directory as the job's work dir (default: the current one), honouring "
        ".gitignore and .cpoolignore and leaving out likely secrets (.env*, *.pem, *.key, ssh keys; "
        "`!NAME` in .cpoolignore ships one); unchanged code is not uploaded again.",
    ),
]
NoCodeOpt = Annotated[
    bool, typer.Option("--no-code", help="Ship no directory: the job starts in an empty one.")
]
NoStdinOpt = Annotated[
    bool,
    typer.Option(
        "--no-stdin",
        "-n",
        help="Send no stdin (as `ssh -n`): by default a piped stdin or file is read to its end and "
        "given to the job, which a script looping over its own input does not want.",
    ),
]
EnvOpt = Annotated[
    list[str] | None,
    typer.Option("--env", help="KEY=VALUE in the job's environment (repeat it).", show_default=False),
]
EnvFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--env-file",
        help="KEY=VALUE lines (# comments) for the job's environment; --env wins. The file itself is "
        "not shipped with the code.",
    ),
]
OutputOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--output",
        help="A file or directory (relative to the job's work dir) to fetch here when the job ends "
        "(repeat it); `cpool cp ID:PATH .` fetches later.",
        show_default=False,
    ),
]
