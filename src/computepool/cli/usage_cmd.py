"""`cpool usage` (GPU-hours, energy and cost per tenant, user, job or model; the static equivalent)
and `cpool prices` (the price table that turns them into cost), over HTTP."""

from __future__ import annotations

import csv
import sys
from typing import Annotated, Any

import typer

from computepool.cli.common import print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    open_client,
    pool_command,
    say,
    short_time,
    show,
    table,
)
from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerArg
from computepool.core.usage import ENERGY_ITEM, USAGE_BY

KEYS = {"tenant": ("tenant",), "user": ("tenant", "user"), "job": ("tenant", "user", "job", "allocation_id")}
FIGURES = ("gpu_hours", "cpu_hours", "memory_gib_hours", "energy_kwh", "idle_waste_kwh", "cost")
HEADINGS = ("GPU-h", "CPU-h", "mem GiB-h", "energy kWh", "idle waste kWh", "cost")


def key_columns(by: str) -> tuple[str, ...]:
    return KEYS.get(by, ("model",))


def write_csv(by: str, rows: list[dict[str, Any]]) -> None:
    """One header row, then one row per group, in the API's field names."""
    cols = [*key_columns(by), *FIGURES]
    out = csv.writer(sys.stdout, lineterminator="\n")
    out.writerow(cols)
    for r in rows:
        out.writerow([r.get(c, "") for c in cols])


def _num(value: object, digits: int = 2) -> str:
    return f"{float(value or 0):,.{digits}f}" if isinstance(value, int | float) else "-"


def show_usage(by: str, since: str, report: dict[str, Any]) -> None:
    rows = report["items"]
    if not rows:
        say(f"no usage booked since {since}")
        return
    keys = key_columns(by)
    t = table(f"usage by {by} since {since}", *keys, *HEADINGS)
    totals = dict.fromkeys(FIGURES, 0.0)
    for r in rows:
        cells = [
            str(r[k]) if r.get(k) not in (None, "") else ("(host)" if k == "model" else "-") for k in keys
        ]
        for f in FIGURES:
            totals[f] += float(r[f])
        t.add_row(*cells, *(_num(r[f], 3 if f != "cost" else 2) for f in FIGURES))
    if len(rows) > 1:
        t.add_row(
            "total", *([""] * (len(keys) - 1)), *(_num(totals[f], 3 if f != "cost" else 2) for f in FIGURES)
        )
    show(t)
    if report.get("unpriced"):
        missing = ", ".join(report["unpriced"])
        say(f"* no price for {missing}: counted as 0 (set one with `cpool prices set ITEM AMOUNT`)")


def show_static(out: dict[str, Any]) -> None:
    born = " (the pool's start: nothing before it is counted)" if out.get("clipped") else ""
    say(
        f"since {short_time(out['since'])}{born} until {short_time(out['until'])}: at most "
        f"{out['pool_devices']} devices held work at once (the pool has {out['pool_size_devices']}); "
        f"static per-tenant partitions would have needed {out['static_devices']}"
    )
    say(
        f"saved: {out['devices_saved']} device{'' if abs(out['devices_saved']) == 1 else 's'} "
        f"({out['devices_saved_pct']:g}%), "
        f"cost {_num(out['cost_saved'])} "
        f"({_num(out['cost_static'])} static vs {_num(out['cost_pool'])} pooled), "
        f"energy {_num(out['energy_saved_kwh'], 3)} kWh"
    )
    if out["tenants"]:
        t = table("static partitions", "tenant", "model", "devices", "peak GPUs", "peak at")
        for p in out["tenants"]:
            t.add_row(
                p["tenant"],
                p["model"],
                str(p["static_devices"]),
                f"{p['peak_gpus']:g}",
                short_time(p["peak_at"]),
            )
        show(t)
    if not out["energy_pool_includes_empty"]:
        say("energy counts your tenant's share only, not devices that held nothing")
    say(f"method: {out['method']}")


def register(app: typer.Typer) -> None:
    """Add `cpool usage` and `cpool prices` to the CLI."""

    @app.command("usage")
    @pool_command
    def usage(
        by: Annotated[str, typer.Option("--by", help="Group by tenant, user, job or model.")] = "tenant",
        since: Annotated[
            str, typer.Option("--since", help="How long ago (30m, 12h, 7d) or an ISO time.")
        ] = "",
        until: Annotated[
            str | None, typer.Option("--until", help="An ISO time or an age (default: now).")
        ] = None,
        static_equivalent: Annotated[
            bool,
            typer.Option(
                "--static-equivalent",
                help="Instead: the devices static per-tenant partitions would have needed "
                "(default --since 30d).",
            ),
        ] = False,
        csv_out: Annotated[bool, typer.Option("--csv", help="Print CSV with a header row.")] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """GPU-hours, CPU-hours, memory, energy, idle waste and cost, from the pool's usage ledger."""
        if by not in USAGE_BY:
            raise InvalidInput("--by", f"expected one of {', '.join(USAGE_BY)}, got {by!r}")
        if json_out and csv_out:
            raise InvalidInput("--csv", "give --json or --csv, not both")
        if static_equivalent:
            if csv_out:
                raise InvalidInput("--csv", "--static-equivalent prints a table or --json")
            with open_client(server, token) as pool:
                out = pool.static_equivalent(since or "30d", until)
            print_json(out) if json_out else show_static(out)
            return
        with open_client(server, token) as pool:
            report = pool.usage_report(by, since or "7d", until)
        if json_out:
            print_json(report["items"])
        elif csv_out:
            write_csv(by, report["items"])
        else:
            show_usage(by, since or "7d", report)
        if report.get("truncated"):  # on stderr, so --json and --csv stay machine-readable
            typer.echo(
                f"only the newest {len(report['items'])} jobs are listed: "
                "narrow --since/--until for the rest",
                err=True,
            )

    prices = typer.Typer(help=f"Prices: per GPU-hour of a device model, and per kWh ({ENERGY_ITEM}).")
    app.add_typer(prices, name="prices")

    def list_prices(server: ServerArg, token: str | None, json_out: bool) -> None:
        with open_client(server, token) as pool:
            items = pool.prices()
        if json_out:
            print_json(items)
            return
        if not items:
            say(
                "no prices: everything costs 0 "
                f"(set one with `cpool prices set A100 2.5` or `cpool prices set {ENERGY_ITEM} 0.2`)"
            )
            return
        t = table("prices", "item", "amount", "per", "updated")
        for p in items:
            per = "kWh" if p["item"] == ENERGY_ITEM else "GPU-hour"
            t.add_row(p["item"], f"{p['amount']:g}", per, short_time(p["updated_at"]))
        show(t)

    @prices.callback(invoke_without_command=True)
    @pool_command
    def default(
        ctx: typer.Context, server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False
    ) -> None:
        """Without a subcommand: list the prices."""
        if ctx.invoked_subcommand is None:
            list_prices(server, token, json_out)

    @prices.command("set")
    @pool_command
    def set_(
        item: Annotated[
            str, typer.Argument(help=f"A device model (per GPU-hour) or {ENERGY_ITEM} (per kWh).")
        ],
        amount: Annotated[str, typer.Argument(help="The price, e.g. 2.5.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Set a price (admin)."""
        try:
            value = float(amount)
        except ValueError:
            raise InvalidInput("AMOUNT", f"cannot read price {amount!r} (use e.g. 2.5)") from None
        with open_client(server, token) as pool:
            out = pool.set_price(item, value)
        if json_out:
            print_json(out)
        else:
            say(f"price of {out['item']}: {out['amount']:g}")
        if out.get("warning"):
            print(f"warning: {out['warning']}", file=sys.stderr)

    @prices.command("delete")
    @pool_command
    def delete(
        item: Annotated[str, typer.Argument(help="The price item to remove.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Remove a price (admin): its item then costs nothing."""
        with open_client(server, token) as pool:
            out = pool.delete_price(item)
        if json_out:
            print_json(out)
        else:
            say(f"price of {out['item']} removed")
