"""Client and CLI test fixtures: a pool server per module, and the CLI in-process.

The CLI is invoked through Typer's runner with the server and token in the environment and
`CPOOL_CONFIG` in a temporary folder, so no test touches ~/.config.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from poolkit import Cli, PoolServer, start_server
from typer.testing import CliRunner, Result

from computepool.cli import main as cli_main


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    # nodes joined by tests send no heartbeat: they stay ready however slow a busy machine is
    with start_server(tmp_path_factory.mktemp("pool"), "--suspect-s", "86400", "--lost-s", "172800") as s:
        yield s


@pytest.fixture(scope="session")
def app() -> typer.Typer:
    if "tenants" not in {g.name for g in cli_main.app.registered_groups}:
        cli_main._register()  # main() registers on every call; the runner needs it once
    return cli_main.app


@pytest.fixture
def cli(app: typer.Typer, server: PoolServer, tmp_path: Path) -> Cli:
    """Run `cpool ARGS` as the admin (override with env=...); the result has stdout and stderr."""
    runner = CliRunner()
    config = str(tmp_path / "config.json")

    def run(*args: str, env: dict[str, str | None] | None = None, input: str | None = None) -> Result:
        base: dict[str, str | None] = {"CPOOL_SERVER": server.url, "CPOOL_TOKEN": server.token}
        base["CPOOL_CONFIG"] = config
        # commands run in this process: one that narrows the umask (`cpool agent`, `cpool up`) must
        # not leave every later test making directories that no tenant's user may pass
        umask = os.umask(0o022)
        os.umask(umask)
        try:
            return runner.invoke(app, list(args), env={**base, **(env or {})}, input=input)
        finally:
            os.umask(umask)

    return run
