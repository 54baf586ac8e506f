"""The README's claim about `--json` holds: every command takes it but the ones it names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from typer.main import get_command

from computepool.cli import main

# Commands that print something other than a report, by design; the README names each of them.
NO_JSON = {"server", "gateway", "agent", "up", "login", "logout", "run", "logs", "top", "sim report"}


def _commands(cmd: Any, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    if hasattr(cmd, "commands"):
        out: dict[str, Any] = {}
        for name, sub in cmd.commands.items():
            out.update(_commands(sub, (*prefix, name)))
        return out
    return {" ".join(prefix): cmd}


def test_every_reporting_command_takes_json() -> None:
    main._register()
    commands = _commands(get_command(main.app))
    assert len(commands) > 30
    without = {
        name for name, c in commands.items() if not any("--json" in getattr(p, "opts", ()) for p in c.params)
    }
    assert without == NO_JSON, "update the README's sentence about --json and this list together"
    readme = Path(__file__).parent.parent.joinpath("README.md").read_text()
    claim = " ".join(
        readme[readme.index("Every command that reports something takes `--json`") :][:700].split()
    )
    for name in NO_JSON:
        assert re.search(rf"`(cpool )?{re.escape(name)}`", claim), f"the README does not name `{name}`"
