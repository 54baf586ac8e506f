"""`cpool secrets`: a tenant's secrets (API tokens, passwords) that its jobs get in their environment.

The value is read from stdin (or a prompt that does not echo), never from the command line, where
it would stay in shell history and in every process listing; the pool never shows it again.
Jobs name them: `cpool run --secret HF_TOKEN -- python train.py`.
"""

from __future__ import annotations

import getpass
import re
import sys
from typing import Annotated, Any

import typer

from computepool.cli.common import fail, print_json
from computepool.cli.pool_cmd import JsonOpt, ServerOpt, TokenOpt, open_client, pool_command, say, show, table
from computepool.core.errors import InvalidInput

SecretOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--secret",
        help="NAME or NAME=VARIABLE: the tenant's secret NAME (cpool secrets set) in the job's environment, "
        "as $NAME or $VARIABLE (repeat it). Only the name is stored with the job.",
        show_default=False,
    ),
]
TenantOpt = Annotated[
    str | None, typer.Option("--tenant", help="Admins: the tenant whose secrets (default your own).")
]


_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,62}$")  # as the server's


def _checked(name: str) -> str:
    if not _NAME.match(name):
        raise InvalidInput(
            "NAME", f"{name!r}: a letter or '_', then letters, digits, '_', '.' or '-' (63 at most)"
        )
    return name


def secret_uses(values: list[str] | None) -> list[dict[str, str]] | None:
    """`--secret` values as the request's `secrets` (the server checks names and variables)."""
    from computepool.client.options import parse_secrets  # noqa: PLC0415 (loaded by the commands using it)

    return parse_secrets(values)


def read_value(name: str) -> str:
    """The value from stdin (one trailing newline, as `echo` adds, dropped), or a silent prompt."""
    if sys.stdin is None or sys.stdin.isatty():
        return getpass.getpass(f"value of {name} (not echoed): ")
    raw = sys.stdin.buffer.read()
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        why = "the value must be UTF-8 text (a job gets it as an environment variable)"
        raise InvalidInput("stdin", why) from None
    return text.removesuffix("\n").removesuffix("\r")


def _when(x: dict[str, Any]) -> str:
    return str(x["updated_at"])[:19].replace("T", " ")


def register(app: typer.Typer) -> None:
    secrets = typer.Typer(
        no_args_is_help=True,
        help="Your tenant's secrets: set from stdin, given to jobs that name them (--secret), never shown.",
    )
    app.add_typer(secrets, name="secrets")

    @secrets.command("set")
    @pool_command
    def set_(
        name: Annotated[str, typer.Argument(help="The secret's name, e.g. HF_TOKEN.")],
        value: Annotated[str | None, typer.Argument(hidden=True)] = None,
        tenant: TenantOpt = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Set NAME from stdin: `printf %s "$TOKEN" | cpool secrets set HF_TOKEN` (tenant admins)."""
        if value is not None:
            raise fail(
                "the value is read from stdin, never from the command line (shell history and process "
                f'listings keep arguments): printf %s "$VALUE" | cpool secrets set {name}'
            )
        body: dict[str, Any] = {"value": read_value(_checked(name))}
        if not body["value"]:
            raise fail('the value is empty: pipe it in, e.g. printf %s "$VALUE" | cpool secrets set NAME')
        if tenant is not None:
            body["tenant"] = tenant
        with open_client(server, token) as pool:
            out = pool.request("PUT", f"/secrets/{_checked(name)}", json=body)
        if json_out:
            print_json(out)
        else:
            say(f"secret {out['name']} set for tenant {out['tenant']} (the value is never shown again)")

    @secrets.command("list")
    @pool_command
    def list_(
        tenant: TenantOpt = None, server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False
    ) -> None:
        """Your tenant's secrets: names, who set them and when (never the values)."""
        with open_client(server, token) as pool:
            items = pool.request("GET", "/secrets", params={"tenant": tenant})["items"]
        if json_out:
            print_json(items)
            return
        t = table(None, "name", "set by", "updated")
        for x in items:
            t.add_row(x["name"], x["set_by"], _when(x))
        show(t)

    @secrets.command("delete")
    @pool_command
    def delete(
        name: Annotated[str, typer.Argument(help="The secret's name.")],
        tenant: TenantOpt = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Delete NAME (tenant admins); refused while a live job or service names it."""
        with open_client(server, token) as pool:
            out = pool.request("DELETE", f"/secrets/{_checked(name)}", params={"tenant": tenant})
        if json_out:
            print_json(out)
        else:
            say(f"secret {out['name']} of tenant {out['tenant']} deleted")
