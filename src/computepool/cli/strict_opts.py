"""A command that takes a trailing command (`cpool run [OPTIONS] -- CMD …`) yet refuses mistyped options.

Click, told to keep unknown options for the trailing command, would run `--gpu` as the command
itself; this class checks the words before `--` (or before the first word that is not an option)
against the command's own options and suggests the nearest one.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand

from computepool.cli.common import fail


def _options(command: TyperCommand) -> list[Any]:
    return [p for p in command.params if p.param_type_name == "option"]


def _unknown_option(command: TyperCommand, args: list[str]) -> str | None:
    """The first option word before the trailing command that `command` does not define."""
    takes_value: dict[str, bool] = {}
    for p in _options(command):
        for name in (*p.opts, *p.secondary_opts):
            takes_value[name] = not (p.is_flag or p.count)
    takes_value["--help"] = False
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--" or not word.startswith("-") or word == "-":
            return None  # the trailing command starts here: passed on untouched
        name = word.split("=", 1)[0] if word.startswith("--") else word
        if name not in takes_value:
            return name
        i += 2 if takes_value[name] and "=" not in word else 1
    return None


class TrailingCommand(TyperCommand):
    """Options first, then the command to run; an unknown option is one line and exit 2."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        bad = _unknown_option(self, args)
        if bad is not None:
            names = [n for p in _options(self) for n in (*p.opts, *p.secondary_opts)]
            import difflib  # only on the error path: `cpool run` starts without it

            near = difflib.get_close_matches(bad, names, n=1)
            hint = f"; did you mean {near[0]}?" if near else "; put the command after `--`"
            raise fail(f"no such option {bad}{hint}", code=2)
        out: Any = super().parse_args(ctx, args)
        return list(out)
