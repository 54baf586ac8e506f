"""The plumbing every pool command shares: `--server`/`--token`/`--json` options, one-line errors.

Server refusals and unreachable servers end as one readable line; durations, times and units are read
and printed the same way by tenants_cmd, access_cmd, quota_cmd, audit_cmd, nodes_cmd, alloc_cmd,
run_cmd and the bench commands.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import wraps
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from computepool.cli.common import console, fail, friendly_errors
from computepool.client import (
    PoolClient,
    PoolError,
    ServerUnreachable,
    resolve_config,
)
from computepool.core.errors import InvalidInput
from computepool.core.servers import ServerArg

F = TypeVar("F", bound=Callable[..., Any])

ServerOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--server",
        help="Pool server URL; repeat it (or separate URLs by commas) for several replicas "
        "(else $CPOOL_SERVER, the `cpool login` config, http://127.0.0.1:8470).",
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


def open_client(server: ServerArg, token: str | None, timeout: float = 30.0) -> PoolClient:
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
