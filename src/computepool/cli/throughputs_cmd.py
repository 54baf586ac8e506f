"""`cpool throughputs`: the speeds the pool measured of your job types on each device model.

Jobs started with `--job-type` that call `computepool.progress(step)` (or write the progress file
themselves) report steps/s with their node's heartbeats; the pool keeps an exponentially weighted
mean per job type, device model and device count, and places a job type on the model it ran
fastest on that is free. A tenant sees its own rows, an admin every tenant's.
"""

from __future__ import annotations

from typing import Annotated

import typer

from computepool.cli.common import print_json
from computepool.cli.pool_cmd import JsonOpt, ServerOpt, TokenOpt, open_client, pool_command, show, table

JobTypeArg = Annotated[str | None, typer.Option("--job-type", help="Only this job type.")]


def register(app: typer.Typer) -> None:
    @app.command("throughputs")
    @pool_command
    def throughputs(
        job_type: JobTypeArg = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Measured steps/s of your job types per device model and device count (cpool run --job-type)."""
        with open_client(server, token) as pool:
            items = pool.request("GET", "/throughputs", params={"job_type": job_type})["items"]
        if json_out:
            print_json(items)
            return
        t = table(None, "tenant", "job type", "model", "devices", "steps/s", "samples", "updated")
        for x in items:
            when = str(x["updated_at"])[:19].replace("T", " ")
            t.add_row(
                x["tenant"], x["job_type"], x["model"], str(x["devices"]), f"{x['steps_per_s']:.4g}",
                str(x["samples"]), when,
            )  # fmt: skip
        show(t)
