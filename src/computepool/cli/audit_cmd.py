"""`cpool audit`: list the audit log and verify its hash chain."""

from __future__ import annotations

from typing import Annotated

import typer

from computepool.cli.common import fail, print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    open_client,
    parse_time,
    pool_command,
    say,
    short_time,
    show,
    table,
)


def register(app: typer.Typer) -> None:
    _register_audit(app)


def _register_audit(app: typer.Typer) -> None:
    audit = typer.Typer(no_args_is_help=True, help="The tamper-evident audit log.")
    app.add_typer(audit, name="audit")

    @audit.command("list")
    @pool_command
    def list_(
        tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's records.")] = None,
        actor: Annotated[str | None, typer.Option("--actor", help="e.g. user:alice or node:n1.")] = None,
        action: Annotated[str | None, typer.Option("--action", help="e.g. tenant.create.")] = None,
        since: Annotated[str | None, typer.Option("--since", help="ISO time or an age, e.g. 2h.")] = None,
        until: Annotated[str | None, typer.Option("--until", help="ISO time or an age.")] = None,
        limit: Annotated[int, typer.Option("--limit", min=1, max=10_000)] = 1000,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Audit records in chain order (admin; tenant-admin: own tenant)."""
        since_t = parse_time(since, "--since") if since else None
        until_t = parse_time(until, "--until") if until else None
        with open_client(server, token) as pool:
            items = pool.list_audit(tenant, actor, action, since_t, until_t, limit=limit)
        if json_out:
            print_json(items)
            return
        t = table(None, "seq", "time", "actor", "tenant", "action", "target", "outcome")
        for x in items:
            outcome = x["outcome"]
            t.add_row(
                str(x["seq"]),
                short_time(x["time"]),
                x["actor"],
                x.get("tenant") or "",
                x["action"],
                x["target"],
                outcome if outcome == "ok" else f"[red]{outcome}[/red]",
            )
        show(t)

    @audit.command("verify")
    @pool_command
    def verify(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """Recompute the hash chain and hold its end against the server's sealed head and anchor;
        exit 1 naming the cause (a record edited, records cut from the end, a rewritten tail)."""
        with open_client(server, token) as pool:
            rep = pool.verify_audit()
        if json_out:
            print_json(rep)
        elif rep["ok"]:
            say(f"audit chain intact: {rep['records']} records")
        if not rep["ok"]:
            cause = rep.get("cause") or f"broken at record {rep['first_broken']}"
            raise fail(f"audit chain not intact: {cause} ({rep['records']} records checked)", code=1)
