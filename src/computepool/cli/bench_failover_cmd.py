"""`cpool bench failover`: kill -9 the scheduling leader K times and time kill → next bind
(computepool/chaos/failover.py says how)."""

from __future__ import annotations

from typing import Annotated

import typer

from computepool.cli.common import console, fail, friendly_errors, print_json


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("failover")
    @friendly_errors
    def failover(
        kills: Annotated[int, typer.Option("--kills", min=1, max=1000, help="Leader kills to time.")] = 5,
        json_out: Annotated[bool, typer.Option("--json")] = False,
    ) -> None:
        """kill -9 of the scheduling leader under light load: seconds from the kill to the next bind
        (its own PostgreSQL, two server replicas and a simulated node, all thrown away after)."""
        from computepool.chaos.failover import run_failover
        from computepool.chaos.postgres import PostgresUnavailable

        try:
            out = run_failover(kills, (lambda _: None) if json_out else console.print)
        except PostgresUnavailable as e:
            raise fail(str(e)) from None
        if json_out:
            print_json(out)
            return
        f = out["failover_s"]
        console.print(
            f"failover after kill -9 of the leader ({kills} kills): p50 {f['p50']} s, max {f['max']} s"
        )
