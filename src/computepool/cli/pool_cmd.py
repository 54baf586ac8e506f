"""`cpool login`, tenants, users, tokens, quotas, join tokens and the audit log — over HTTP.

Also the plumbing the other pool commands share (nodes_cmd, alloc_cmd, bench_api_cmd): the
`--server`/`--token` options, one-line errors for server answers, and human units on output.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import wraps
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from computepool.cli.common import console, err_console, fail, friendly_errors, print_json
from computepool.client import (
    ClientConfig,
    PoolClient,
    PoolError,
    ServerUnreachable,
    resolve_config,
    save_config,
)
from computepool.client.config import load_config, normalise_server
from computepool.core.errors import InvalidInput
from computepool.core.quantities import format_duration, format_mib, parse_cpu_milli, parse_memory_mib

F = TypeVar("F", bound=Callable[..., Any])

ServerOpt = Annotated[
    str | None,
    typer.Option(
        "--server",
        help="Pool server URL (else $CPOOL_SERVER, the `cpool login` config, http://127.0.0.1:8470).",
        show_default=False,
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token", help="API token (else $CPOOL_TOKEN, the `cpool login` config).", show_default=False
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON value instead of a table.")]

PIPE_WIDTH = 240
ROLES = ("admin", "tenant-admin", "member", "viewer")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|d|w)?\s*$", re.IGNORECASE)
_DURATION_S = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


# -- shared plumbing ----------------------------------------------------------------------


def pool_command(fn: F) -> F:
    """Server refusals and unreachable servers end as one line on stderr and exit 1, like bad input."""
    inner = friendly_errors(fn)

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return inner(*args, **kwargs)
        except PoolError as e:
            raise fail(str(e), code=1) from None
        except ServerUnreachable as e:
            raise fail(str(e), code=1) from None

    return wrapper  # type: ignore[return-value]


def open_client(server: str | None, token: str | None, timeout: float = 30.0) -> PoolClient:
    return PoolClient.from_config(resolve_config(server, token), timeout=timeout)


def parse_duration_s(text: str, field: str) -> int:
    """`90s`, `15m`, `1h`, `30d`, `2w` or plain seconds → whole seconds (at least one)."""
    m = _DURATION.match(text)
    if not m:
        raise InvalidInput(field, f"cannot read duration {text!r} (use e.g. 45s, 15m, 1h, 30d, 2w)")
    seconds = float(m.group(1)) * _DURATION_S[(m.group(2) or "s").lower()]
    if seconds < 1:
        raise InvalidInput(field, f"{text!r} is shorter than one second")
    return round(seconds)


def parse_time(text: str, field: str) -> str:
    """An ISO 8601 time, or a duration meaning that long ago (`1h` = an hour ago), as ISO 8601."""
    if _DURATION.match(text):
        return (datetime.now(UTC) - timedelta(seconds=parse_duration_s(text, field))).isoformat()
    try:
        return datetime.fromisoformat(text).isoformat()
    except ValueError:
        raise InvalidInput(field, f"cannot read time {text!r} (use ISO 8601 or an age like 2h)") from None


def gpus_text(milli: int) -> str:
    """Milli-GPUs as people say them: 250 → 0.25, 2000 → 2."""
    return f"{milli / 1000:g}"


def cpus_text(milli: int) -> str:
    return f"{milli / 1000:g}" if milli % 100 == 0 else f"{milli}m"


def short_time(value: object) -> str:
    """ISO timestamps trimmed to the second, in UTC as the server sends them."""
    if not isinstance(value, str) or not value:
        return "-"
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        return value
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def table(title: str | None, *columns: str) -> Table:
    t = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def show(renderable: Table) -> None:
    """Print a table; into a pipe or file at a generous width, so rows are not folded at 80 columns."""
    if console.is_terminal:
        console.print(renderable)
    else:
        Console(file=sys.stdout, width=PIPE_WIDTH, no_color=True).print(renderable)


def say(message: str) -> None:
    """One message line on stdout, never broken at the terminal width (scripts grep these)."""
    console.print(message, soft_wrap=True, highlight=False)


def _read_token_file(path: Path) -> str:
    text = sys.stdin.read() if str(path) == "-" else path.expanduser().read_text()
    token = text.strip()
    if not token:
        raise InvalidInput(str(path), "is empty; expected an API token")
    return token


# -- quotas -------------------------------------------------------------------------------


def _gpu_total_milli(text: str, field: str) -> int:
    """Quota GPUs are a total, so 1.5 GPUs is fine here (unlike a request, where a slice is on one device)."""
    try:
        return parse_cpu_milli(text, field)
    except InvalidInput:
        raise InvalidInput(field, f"cannot read GPUs {text!r} (use e.g. 2, 0.5 or 1500m)") from None


def _pair(quota: dict[str, Any], key: str, guaranteed: int | None, limit: int | None, flag: str) -> None:
    if guaranteed is None and limit is None:
        return
    g = guaranteed if guaranteed is not None else 0
    lim = limit if limit is not None else max(g, 0)
    if lim < g:
        raise InvalidInput(f"{flag}-limit", f"limit is below the guaranteed amount given with {flag}")
    quota[key] = {"guaranteed": g, "limit": lim}


def _quota_rows(quota: dict[str, Any]) -> list[tuple[str, str, str]]:
    fmt: dict[str, Callable[[int], str]] = {
        "gpu_milli": gpus_text,
        "gpu_memory_mib": format_mib,
        "cpu_milli": cpus_text,
        "memory_mib": format_mib,
    }
    names = {"gpu_milli": "GPUs", "gpu_memory_mib": "GPU memory", "cpu_milli": "CPUs", "memory_mib": "memory"}
    rows = []
    for key, f in fmt.items():
        pair = quota.get(key)
        if pair:
            rows.append((names[key], f(pair["guaranteed"]), f(pair["limit"])))
    for model, mq in sorted((quota.get("models") or {}).items()):
        for key in ("gpu_milli", "gpu_memory_mib"):
            pair = mq.get(key)
            if pair:
                rows.append(
                    (f"{names[key]} ({model})", fmt[key](pair["guaranteed"]), fmt[key](pair["limit"]))
                )
    return rows


# -- commands -----------------------------------------------------------------------------


def register(app: typer.Typer) -> None:
    _register_login(app)
    _register_tenants(app)
    _register_users(app)
    _register_tokens(app)
    _register_quota(app)
    _register_join_token(app)
    _register_audit(app)


def _register_login(app: typer.Typer) -> None:
    @app.command("login")
    @pool_command
    def login(
        server: ServerOpt = None,
        token: TokenOpt = None,
        token_file: Annotated[
            Path | None, typer.Option("--token-file", help="Read the token from this file ('-': stdin).")
        ] = None,
        ca: Annotated[
            Path | None,
            typer.Option(
                "--ca",
                help="PEM file an https server's certificate must chain to (e.g. DATA_DIR/tls/cert.pem "
                "of `cpool up`); saved with the server.",
            ),
        ] = None,
    ) -> None:
        """Check a token with the server and save server + token (+ CA) (mode 0600) for later commands."""
        if token and token_file:
            raise InvalidInput("--token-file", "give either --token or --token-file, not both")
        if token_file is not None:
            token = _read_token_file(token_file)
        if ca is not None and not ca.expanduser().is_file():
            raise InvalidInput("--ca", f"no such file {ca}")
        cfg = resolve_config(server, token, ca=str(ca) if ca else None)
        if not cfg.token:
            if not sys.stdin.isatty():
                raise InvalidInput("--token", "no token given (use --token, --token-file or $CPOOL_TOKEN)")
            cfg = ClientConfig(cfg.server, typer.prompt("API token", hide_input=True).strip(), cfg.ca)
        with PoolClient.from_config(cfg) as pool:
            me = pool.whoami()
        path = save_config(cfg)
        where = f"tenant {me['tenant']}" if me.get("tenant") else "the whole pool"
        say(f"logged in to {cfg.server} as {me['name']} ({me['role']}, {where}); saved {path}")

    @app.command("logout", help="Forget the token saved by `cpool login` (keeps the server address).")
    @pool_command
    def logout() -> None:
        from computepool.client.config import config_path

        path = config_path()
        saved = load_config(path)
        if not saved:
            say("not logged in")
            return
        server = normalise_server(saved.get("server", "http://127.0.0.1:8470"))
        save_config(ClientConfig(server, None, saved.get("ca")))
        say(f"token removed from {path}")


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
            str, typer.Option("--role", help="admin, tenant-admin, member or viewer.")
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


def _register_tokens(app: typer.Typer) -> None:
    tokens = typer.Typer(no_args_is_help=True, help="API tokens (the secret is shown once, at creation).")
    app.add_typer(tokens, name="tokens")

    @tokens.command("list")
    @pool_command
    def list_(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """Tokens you may see, never their secrets."""
        with open_client(server, token) as pool:
            items = pool.list_tokens()
        if json_out:
            print_json(items)
            return
        t = table(None, "id", "user", "name", "created by", "created", "expires", "revoked")
        for x in items:
            t.add_row(
                x["id"],
                x["user"],
                x.get("name") or "",
                x.get("created_by", ""),
                short_time(x.get("created_at")),
                short_time(x.get("expires_at")) if x.get("expires_at") else "never",
                short_time(x.get("revoked_at")) if x.get("revoked_at") else "",
            )
        show(t)

    @tokens.command("create")
    @pool_command
    def create(
        user: Annotated[str | None, typer.Option("--user", help="Whose token (default: yours).")] = None,
        name: Annotated[str, typer.Option("--name", help="A label for people.")] = "",
        expires: Annotated[
            str | None, typer.Option("--expires", help="Lifetime, e.g. 12h, 30d (default: never).")
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Create a token; only the token goes to stdout, so `T=$(cpool tokens create)` works."""
        expires_s = parse_duration_s(expires, "--expires") if expires else None
        with open_client(server, token) as pool:
            out = pool.create_token(user=user, name=name, expires_in_s=expires_s)
        if json_out:
            print_json(out)
            return
        until = f"expires {short_time(out['expires_at'])}" if out.get("expires_at") else "never expires"
        err_console.print(
            f"token {out['id']} for {out['user']}, {until}; shown only now:", highlight=False, soft_wrap=True
        )
        sys.stdout.write(out["token"] + "\n")

    @tokens.command("revoke")
    @pool_command
    def revoke(
        token_id: Annotated[str, typer.Argument(metavar="ID", help="The token's public id.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Revoke a token: it stops working at once."""
        with open_client(server, token) as pool:
            out = pool.revoke_token(token_id)
        if json_out:
            print_json(out)
        else:
            say(f"token {out['id']} of {out['user']} revoked")


def _register_quota(app: typer.Typer) -> None:
    quota = typer.Typer(no_args_is_help=True, help="Tenant quotas: guaranteed and limit per resource.")
    app.add_typer(quota, name="quota")

    def show_quota(tenant: str, q: dict[str, Any]) -> None:
        rows = _quota_rows(q)
        if not rows:
            say(f"tenant {tenant} has no quota: nothing guaranteed, no limit but the pool")
            return
        t = table(f"quota of {tenant}", "resource", "guaranteed", "limit")
        for r in rows:
            t.add_row(*r)
        show(t)

    @quota.command("get")
    @pool_command
    def get(
        tenant: Annotated[str, typer.Argument(help="Tenant name.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Show a tenant's quota."""
        with open_client(server, token) as pool:
            q = pool.get_quota(tenant)
        if json_out:
            print_json(q)
        else:
            show_quota(tenant, q)

    @quota.command("set")
    @pool_command
    def set_(
        tenant: Annotated[str, typer.Argument(help="Tenant name.")],
        gpus: Annotated[str | None, typer.Option("--gpus", help="Guaranteed GPUs, e.g. 2 or 0.5.")] = None,
        gpus_limit: Annotated[str | None, typer.Option("--gpus-limit", help="Most GPUs it may hold.")] = None,
        gpu_mem: Annotated[
            str | None, typer.Option("--gpu-mem", help="Guaranteed GPU memory, e.g. 80GiB.")
        ] = None,
        gpu_mem_limit: Annotated[str | None, typer.Option("--gpu-mem-limit")] = None,
        cpus: Annotated[str | None, typer.Option("--cpus", help="Guaranteed CPUs, e.g. 16 or 500m.")] = None,
        cpus_limit: Annotated[str | None, typer.Option("--cpus-limit")] = None,
        mem: Annotated[str | None, typer.Option("--mem", help="Guaranteed host memory, e.g. 64GiB.")] = None,
        mem_limit: Annotated[str | None, typer.Option("--mem-limit")] = None,
        replace: Annotated[
            bool, typer.Option("--replace", help="Drop the resources not given (default: keep them).")
        ] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Set quota resources (admin). A limit left out equals the guaranteed amount."""
        updates: dict[str, Any] = {}
        specs: list[tuple[str, str, str | None, str | None, Callable[[str, str], int]]] = [
            ("gpu_milli", "--gpus", gpus, gpus_limit, _gpu_total_milli),
            ("gpu_memory_mib", "--gpu-mem", gpu_mem, gpu_mem_limit, parse_memory_mib),
            ("cpu_milli", "--cpus", cpus, cpus_limit, parse_cpu_milli),
            ("memory_mib", "--mem", mem, mem_limit, parse_memory_mib),
        ]
        for key, flag, g, lim, parse in specs:
            g_val = None if g is None else parse(g, flag)
            lim_val = None if lim is None else parse(lim, f"{flag}-limit")
            _pair(updates, key, g_val, lim_val, flag)
        if not updates and not replace:
            raise InvalidInput("quota set", "nothing to set (give --gpus, --gpu-mem, --cpus or --mem)")
        with open_client(server, token) as pool:
            current = {} if replace else pool.get_quota(tenant)
            q = pool.set_quota(tenant, {**current, **updates})
        if json_out:
            print_json(q)
        else:
            show_quota(tenant, q)


def _register_join_token(app: typer.Typer) -> None:
    @app.command("join-token")
    @pool_command
    def join_token(
        expires: Annotated[str, typer.Option("--expires", help="Lifetime, e.g. 1h, 7d.")] = "1h",
        reusable: Annotated[bool, typer.Option("--reusable", help="Let several nodes join with it.")] = False,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Create a join token for new nodes (admin); only the token goes to stdout."""
        expires_s = parse_duration_s(expires, "--expires")
        with open_client(server, token) as pool:
            out = pool.create_join_token(expires_in_s=expires_s, single_use=not reusable)
        if json_out:
            print_json(out)
            return
        use = "single use" if out.get("single_use") else "reusable"
        err_console.print(
            f"join token {out['id']} ({use}, expires {short_time(out['expires_at'])}); shown only now:",
            highlight=False,
            soft_wrap=True,
        )
        sys.stdout.write(out["token"] + "\n")


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
