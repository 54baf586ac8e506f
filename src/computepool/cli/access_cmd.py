"""`cpool login`/`logout`, API tokens and node join tokens: who may talk to the pool, and how."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from computepool.cli.common import err_console, print_json
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
from computepool.client import ClientConfig, PoolClient, resolve_config, save_config
from computepool.client.config import load_config
from computepool.core.errors import InvalidInput
from computepool.core.servers import join_servers, split_servers


def _read_token_file(path: Path) -> str:
    text = sys.stdin.read() if str(path) == "-" else path.expanduser().read_text()
    token = text.strip()
    if not token:
        raise InvalidInput(str(path), "is empty; expected an API token")
    return token


def register_login(app: typer.Typer) -> None:
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
        server = join_servers(split_servers(saved.get("server", "http://127.0.0.1:8470")))
        save_config(ClientConfig(server, None, saved.get("ca")))
        say(f"token removed from {path}")


def register_tokens(app: typer.Typer) -> None:
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


def register_join_token(app: typer.Typer) -> None:
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
