"""`cpool tenants` and `cpool users`: who shares the pool, their weight, reclaim policy and roles."""

from __future__ import annotations

from typing import Annotated

import typer

from computepool.cli.common import fail, print_json
from computepool.cli.pool_cmd import (
    JsonOpt,
    ServerOpt,
    TokenOpt,
    cpus_text,
    open_client,
    pool_command,
    say,
    short_time,
    show,
    table,
)
from computepool.client import PoolError
from computepool.core.errors import InvalidInput
from computepool.core.quantities import (
    format_duration,
    format_mib,
    parse_cpu_milli,
    parse_duration_s,
    parse_memory_mib,
)

ROLES = ("admin", "tenant-admin", "member", "viewer", "scraper")


def register(app: typer.Typer) -> None:
    _register_tenants(app)
    _register_users(app)


def _register_tenants(app: typer.Typer) -> None:
    tenants = typer.Typer(
        no_args_is_help=True, help="Tenants: who shares the pool, and their fair-share weight."
    )
    app.add_typer(tenants, name="tenants")

    @tenants.command("list")
    @pool_command
    def list_(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """Tenants you may see (admins: all)."""
        with open_client(server, token) as pool:
            items = pool.list_tenants()
        if json_out:
            print_json(items)
            return
        t = table(None, "tenant", "weight", "created")
        for x in items:
            t.add_row(x["name"], f"{x['weight']:g}", short_time(x.get("created_at")))
        show(t)

    @tenants.command("create")
    @pool_command
    def create(
        name: Annotated[str, typer.Argument(help="Lower-case letters, digits, '.', '_' or '-'.")],
        weight: Annotated[float, typer.Option("--weight", help="Fair-share weight (relative).")] = 1.0,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Create a tenant (admin)."""
        with open_client(server, token) as pool:
            out = pool.create_tenant(name, weight)
        if json_out:
            print_json(out)
        else:
            say(f"tenant {out['name']} created (weight {out['weight']:g})")

    @tenants.command("reclaim")
    @pool_command
    def reclaim(
        name: Annotated[str, typer.Argument(help="The tenant.")],
        idle: Annotated[
            str | None,
            typer.Option("--idle", help="Release allocations whose devices show no use this long, e.g. 30m."),
        ] = None,
        warn: Annotated[
            str, typer.Option("--warn", help="Warn this long before (event, cpool ps, metric), e.g. 10m.")
        ] = "0",
        off: Annotated[
            bool, typer.Option("--off", help="Never reclaim this tenant's idle allocations.")
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """A tenant's idle reclaim (admin to change): show it, set it with --idle, or turn it --off."""
        if off and idle is not None:
            raise fail("--off and --idle: give one of them")
        if warn != "0" and idle is None:
            raise fail("--warn needs --idle")
        with open_client(server, token) as pool:
            if off:
                out = pool.delete_reclaim(name)
            elif idle is not None:
                out = pool.set_reclaim(name, idle, warn)
            else:
                out = pool.get_reclaim(name)
        if json_out:
            print_json(out)
        elif not out.get("enabled"):
            say(f"tenant {name}: idle reclaim off")
        else:
            say(
                f"tenant {name}: allocations idle for {format_duration(out['idle_s'])} are released, "
                f"warned {format_duration(out['warn_s'])} before"
            )

    @tenants.command("defaults")
    @pool_command
    def defaults(
        name: Annotated[str, typer.Argument(help="The tenant.")],
        cpus: Annotated[
            str | None,
            typer.Option(
                "--cpus", help="CPUs a request that names none gets, e.g. 1 or 500m; 'pool': the pool's."
            ),
        ] = None,
        mem: Annotated[
            str | None,
            typer.Option(
                "--mem", help="Memory a request that names none gets, e.g. 2GiB; 'pool': the pool's."
            ),
        ] = None,
        pids: Annotated[
            str | None,
            typer.Option(
                "--pids", help="Processes (and threads) one job may run at once; 'pool': the pool's."
            ),
        ] = None,
        time_limit: Annotated[
            str | None,
            typer.Option("--time-limit", help="Time limit of a job that names none, e.g. 4h; 'none'."),
        ] = None,
        max_time_limit: Annotated[
            str | None,
            typer.Option("--max-time-limit", help="The longest time limit a job may ask, e.g. 2d; 'none'."),
        ] = None,
        max_array: Annotated[
            str | None, typer.Option("--max-array", help="The most jobs one array may hold; 'none'.")
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """What a tenant's requests get when they name no CPU, memory or time limit, how many processes
        one job may run, and the ceilings its requests stay under (admin to change): show them, or set
        them with --cpus, --mem, --pids, --time-limit, --max-time-limit, --max-array."""
        changes = _default_changes(cpus, mem, pids) | _ceiling_changes(time_limit, max_time_limit, max_array)
        with open_client(server, token) as pool:
            out = pool.set_tenant_defaults(name, changes) if changes else pool.tenant_defaults(name)
        if json_out:
            print_json(out)
            return
        mark = {
            f: " (the pool's)" if f in out["from_pool"] else ""
            for f in ("cpu_milli", "memory_mib", "pids_max")
        }
        say(
            f"tenant {out['tenant']}: a request that names no CPU gets {cpus_text(out['cpu_milli'])} CPU"
            f"{mark['cpu_milli']}, no memory {format_mib(out['memory_mib'])}{mark['memory_mib']}; "
            f"a job runs at most {out['pids_max']} processes{mark['pids_max']}"
        )
        tl, top, arr = out.get("time_limit_s"), out.get("max_time_limit_s"), out.get("max_array")
        given = tl or top
        say(
            f"a job without a time limit gets {format_duration(given) if given else 'none'}; "
            f"the longest it may ask for: {format_duration(top) if top else 'no ceiling'}; "
            f"the largest array: {arr if arr else 'no ceiling'}"
        )

    @tenants.command("gateway-limit")
    @pool_command
    def gateway_limit(
        name: Annotated[str, typer.Argument(help="The tenant.")],
        rpm: Annotated[
            int | None,
            typer.Option("--rpm", min=1, help="Gateway requests a minute, over all its tokens and services."),
        ] = None,
        burst: Annotated[
            int | None,
            typer.Option("--burst", min=1, help="Requests at once above the rate (default rpm/6)."),
        ] = None,
        off: Annotated[bool, typer.Option("--off", help="No gateway rate limit for this tenant.")] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """A tenant's gateway rate limit (admin to change): show it, set it with --rpm, or turn it --off.

        Beyond it the gateway answers 429 with Retry-After."""
        if off and (rpm is not None or burst is not None):
            raise fail("--off and --rpm/--burst: give one of them")
        if burst is not None and rpm is None:
            raise fail("--burst needs --rpm")
        with open_client(server, token) as pool:
            if off:
                pool.delete_gateway_limit(name)
                out = None
            elif rpm is not None:
                out = pool.set_gateway_limit(name, rpm, burst)
            else:
                try:
                    out = pool.gateway_limit(name)
                except PoolError as e:
                    if e.status != 404:
                        raise
                    pool.get_tenant(name)  # a missing tenant says so; an existing one has no limit
                    out = None
        if json_out:
            print_json(out)
        elif out is None:
            say(f"tenant {name}: no gateway rate limit of its own (the gateway's --gateway-rpm applies)")
        else:
            say(
                f"tenant {out['tenant']}: at most {out['requests_per_minute']} gateway requests a minute, "
                f"{out['burst']} at once"
            )


def _default_changes(cpus: str | None, mem: str | None, pids: str | None) -> dict[str, int | None]:
    """The fields to change ('pool': back to the pool's default), in the API's units."""
    changes: dict[str, int | None] = {}
    for field, opt, text, parse in (
        ("cpu_milli", "--cpus", cpus, parse_cpu_milli),
        ("memory_mib", "--mem", mem, parse_memory_mib),
        ("pids_max", "--pids", pids, _whole),
    ):
        if text is None:
            continue
        if text.strip().lower() == "pool":
            changes[field] = None
            continue
        value = parse(text, opt)
        if value <= 0:
            raise InvalidInput(opt, f"must be above 0, got {text!r} (or 'pool' for the pool's default)")
        changes[field] = value
    return changes


def _ceiling_changes(time_limit: str | None, top: str | None, array: str | None) -> dict[str, int | None]:
    """The ceilings to change ('none': no default or ceiling), in the API's units."""
    changes: dict[str, int | None] = {}
    for field, opt, text in (
        ("time_limit_s", "--time-limit", time_limit),
        ("max_time_limit_s", "--max-time-limit", top),
        ("max_array", "--max-array", array),
    ):
        if text is None:
            continue
        if text.strip().lower() in ("none", "pool"):
            changes[field] = None
            continue
        value = _whole(text, opt) if field == "max_array" else parse_duration_s(text, opt)
        if value <= 0:
            raise InvalidInput(opt, f"must be above 0, got {text!r} (or 'none')")
        changes[field] = int(value)
    return changes


def _whole(text: str, field: str) -> int:
    if not text.strip().isdigit():
        raise InvalidInput(field, f"expected a whole number, got {text!r}")
    return int(text)


def _register_users(app: typer.Typer) -> None:
    users = typer.Typer(no_args_is_help=True, help="Users and their roles.")
    app.add_typer(users, name="users")

    @users.command("list")
    @pool_command
    def list_(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """Users you may see (admins: all; others: their tenant)."""
        with open_client(server, token) as pool:
            items = pool.list_users()
        if json_out:
            print_json(items)
            return
        t = table(None, "user", "tenant", "role", "created")
        for x in items:
            t.add_row(x["name"], x["tenant"], x["role"], short_time(x.get("created_at")))
        show(t)

    @users.command("create")
    @pool_command
    def create(
        name: Annotated[str, typer.Argument(help="Unique in the whole pool.")],
        tenant: Annotated[str, typer.Option("--tenant", help="The user's tenant.")],
        role: Annotated[
            str, typer.Option("--role", help="admin, tenant-admin, member, viewer or scraper.")
        ] = "member",
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Create a user (admin; tenant-admin in their own tenant)."""
        if role not in ROLES:
            raise InvalidInput("--role", f"unknown role {role!r} (choose from {', '.join(ROLES)})")
        with open_client(server, token) as pool:
            out = pool.create_user(name, tenant, role)
        if json_out:
            print_json(out)
        else:
            say(f"user {out['name']} created in tenant {out['tenant']} as {out['role']}")
