"""`cpool alerts`: firing and resolved alerts, the rules behind them, and the webhooks they go to."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from computepool.cli.common import fail, print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    open_client,
    parse_duration_s,
    pool_command,
    say,
    short_time,
    show,
    table,
)
from computepool.core.quantities import format_duration


def _duration(seconds: object) -> str:
    return format_duration(int(seconds)) if isinstance(seconds, int) and seconds > 0 else "0s"


def register(app: typer.Typer) -> None:
    alerts = typer.Typer(help="Alerts: what fires and resolved, the rules, and webhooks.")
    app.add_typer(alerts, name="alerts")

    @alerts.callback(invoke_without_command=True)
    @pool_command
    def list_(
        ctx: typer.Context,
        firing: Annotated[bool, typer.Option("--firing", help="Only the alerts firing now.")] = False,
        all_: Annotated[bool, typer.Option("--all", help="Firing and resolved (the default).")] = False,
        since: Annotated[
            str | None, typer.Option("--since", help="Only alerts active since: 30m, 12h, 7d or an ISO time.")
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Firing and resolved alerts, newest first (a tenant's users see their tenant's only)."""
        if ctx.invoked_subcommand is not None:
            return
        if firing and all_:
            raise fail("--firing and --all: give one of them")
        with open_client(server, token) as pool:
            items = pool.alerts("firing" if firing else "all", since)
        if json_out:
            print_json(items)
            return
        if not items:
            say("no alerts" if not firing else "no alerts firing")
            return
        t = table(None, "rule", "state", "severity", "since", "subject", "summary")
        for a in items:
            state = (
                "[red]firing[/red]" if a["state"] == "firing" else f"resolved {short_time(a['resolved_at'])}"
            )
            t.add_row(a["rule"], state, a["severity"], short_time(a["since"]), a["subject"], a["summary"])
        show(t)

    @alerts.command("rules")
    @pool_command
    def rules(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """The rules with their thresholds and durations."""
        with open_client(server, token) as pool:
            items = pool.alert_rules()
        if json_out:
            print_json(items)
            return
        t = table(None, "rule", "enabled", "threshold", "for", "description")
        for r in items:
            unit = f" {r['unit']}" if r["unit"] else ""
            threshold = f"{r['threshold']:g}{unit}" if r["unit"] else "-"
            t.add_row(r["name"], "yes" if r["enabled"] else "no", threshold, _duration(r["duration_s"]),
                      r["description"])  # fmt: skip
        show(t)

    @alerts.command("rule")
    @pool_command
    def rule(
        name: Annotated[str, typer.Argument(help="The rule, e.g. idle-devices (see `cpool alerts rules`).")],
        threshold: Annotated[
            float | None, typer.Option("--threshold", help="The rule's threshold, in its unit.")
        ] = None,
        for_: Annotated[
            str | None, typer.Option("--for", help="How long the condition must hold first: 0, 90s, 10m, 1h.")
        ] = None,
        enable: Annotated[
            bool | None,
            typer.Option("--enable/--disable", help="Turn the rule on or off.", show_default=False),
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Retune, enable or disable a rule (admin)."""
        if threshold is None and for_ is None and enable is None:
            raise fail("nothing to change: give --threshold, --for, --enable or --disable")
        if threshold is not None and not math.isfinite(threshold):
            raise fail(f"--threshold: must be a finite number, got {threshold:g}")
        if threshold is not None and threshold < 0:
            raise fail(f"--threshold: must not be negative, got {threshold:g}")
        duration = None
        if for_ is not None:
            duration = 0 if for_.strip() in ("0", "0s") else parse_duration_s(for_, "--for")
        with open_client(server, token) as pool:
            out = pool.set_alert_rule(name, enabled=enable, threshold=threshold, duration_s=duration)
        if json_out:
            print_json(out)
            return
        state = "enabled" if out["enabled"] else "disabled"
        unit = f" {out['unit']}" if out["unit"] else ""
        hold = _duration(out["duration_s"])
        say(f"rule {out['name']}: {state}, threshold {out['threshold']:g}{unit}, for {hold}")

    webhook = typer.Typer(no_args_is_help=True, help="Where alert notifications are POSTed (admin).")
    alerts.add_typer(webhook, name="webhook")

    @webhook.command("add")
    @pool_command
    def add(
        url: Annotated[str, typer.Argument(help="http(s) URL to POST firing and resolved alerts to.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Add a webhook and print its signing secret (shown only this once)."""
        with open_client(server, token) as pool:
            out = pool.add_webhook(url)
        if json_out:
            print_json(out)
            return
        say(f"webhook {out['id']}: {out['url']}")
        say(f"secret (shown once; verifies X-ComputePool-Signature): {out['secret']}")

    @webhook.command("list")
    @pool_command
    def list_hooks(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """The webhooks."""
        with open_client(server, token) as pool:
            items = pool.webhooks()
        if json_out:
            print_json(items)
            return
        t = table(None, "id", "url", "created by", "created")
        for h in items:
            t.add_row(str(h["id"]), h["url"], h["created_by"], short_time(h["created_at"]))
        show(t)

    @webhook.command("delete")
    @pool_command
    def delete(
        hook_id: Annotated[int, typer.Argument(help="The webhook's id (see `cpool alerts webhook list`).")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Remove a webhook; notifications not yet sent to it are dropped."""
        with open_client(server, token) as pool:
            out = pool.delete_webhook(hook_id)
        if json_out:
            print_json(out)
            return
        say(f"webhook {out['id']} deleted ({out['url']})")
