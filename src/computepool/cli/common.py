"""Shared CLI plumbing: JSON output, one-line errors, progress bars."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from computepool.core.errors import InvalidInput

F = TypeVar("F", bound=Callable[..., Any])
PIPE_COLUMNS = 1000  # into a pipe or file with no $COLUMNS: whole lines for scripts, not 80 columns


def _console(stderr: bool) -> Console:
    """A terminal gets its own width; a pipe or file $COLUMNS or a very wide line, never Rich's 80."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream is not None and stream.isatty()
    columns = os.environ.get("COLUMNS", "")
    width = None if tty or columns.isdigit() else PIPE_COLUMNS
    return Console(stderr=stderr, width=width)


err_console = _console(stderr=True)
console = _console(stderr=False)


def print_json(obj: object) -> None:
    sys.stdout.write(json.dumps(obj, default=_default) + "\n")


def _default(o: object) -> object:
    if hasattr(o, "item"):
        return o.item()  # numpy scalars
    if isinstance(o, set | frozenset):
        return sorted(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print `error: MESSAGE` as is — never read as markup, so `[a-z]` in a server's rule survives."""
    err_console.print(Text.assemble(("error:", "red"), " ", message), highlight=False, soft_wrap=True)
    return typer.Exit(code)


def friendly_errors(fn: F) -> F:
    """Turn bad input into one readable line and a non-zero exit, never a traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except InvalidInput as e:
            raise fail(str(e)) from None
        except (OSError, ValueError) as e:
            raise fail(str(e)) from None

    return wrapper  # type: ignore[return-value]


@contextmanager
def progress_bar(label: str, enabled: bool) -> Iterator[Callable[[int, int], None]]:
    """A Rich progress bar on the terminal; a no-op callback when disabled (e.g. with --json)."""
    if not enabled or not err_console.is_terminal:
        yield lambda done, total: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
    ) as prog:
        task = prog.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            prog.update(task, completed=done, total=total)

        yield update
