"""cli/: a mistyped option is refused with the nearest name, pipes get whole lines, `cpool up` logs in."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from computepool.cli import main as cli_main
from computepool.cli.up_cmd import _save_login
from computepool.client.config import resolve_config


@pytest.fixture(scope="module")
def app():
    if "run" not in {c.name for c in cli_main.app.registered_commands}:
        cli_main._register()
    return cli_main.app


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["run", "--gpu", "0.5", "--", "true"], "error: no such option --gpu; did you mean --gpus?"),
        (
            ["run", "--gpus", "0.5", "--tenat", "t", "--", "true"],
            "no such option --tenat; did you mean --tenant?",
        ),
        (["run", "--name", "x", "--zzzz", "true"], "no such option --zzzz; put the command after `--`"),
    ],
)
def test_run_refuses_a_mistyped_option_in_one_line(app, args: list[str], line: str) -> None:
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and line in lines[0], r.output


def test_run_passes_words_after_the_command_untouched(app) -> None:
    """`--gpu` after `--` (or after the command's first word) is the command's, not cpool's."""
    server = f"http://127.0.0.1:{_closed_port()}"
    for tail in (["--", "--gpu"], ["echo", "--gpu", "--name", "x"]):
        r = CliRunner().invoke(
            app, ["run", "--server", server, "--no-code", "--no-stdin", "--priority", "3", *tail]
        )
        assert r.exit_code == 1, r.output
        assert "cannot reach the pool server" in r.output and "no such option" not in r.output, r.output


@pytest.mark.parametrize(("columns", "width"), [(None, 1000), ("100", 100)])
def test_output_into_a_pipe_is_not_wrapped_at_80(columns: str | None, width: int) -> None:
    env = {"PATH": "/usr/bin:/bin", **({"COLUMNS": columns} if columns else {})}
    code = "from computepool.cli.common import console; console.print('w' * 300)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert [len(ln) for ln in out.stdout.splitlines()] == [width] * (300 // width) + (
        [300 % width] if 300 % width else []
    )


def test_up_saves_its_login_unless_another_pool_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "cfg" / "config.json"
    monkeypatch.setenv("CPOOL_CONFIG", str(config))
    for k in ("CPOOL_SERVER", "CPOOL_TOKEN", "CPOOL_CA"):
        monkeypatch.delenv(k, raising=False)
    token, cert = tmp_path / "admin-token", tmp_path / "cert.pem"
    token.write_text("tok-1\n")
    cert.write_text("pem")
    assert "logged the CLI in" in _save_login("https://127.0.0.1:9443", token, cert)
    cfg = resolve_config()
    assert (cfg.server, cfg.token, cfg.ca) == ("https://127.0.0.1:9443", "tok-1", str(cert))
    assert config.stat().st_mode & 0o777 == 0o600
    token.write_text("tok-2\n")  # the same pool again (a new admin token): saved again
    _save_login("https://127.0.0.1:9443", token, cert)
    assert resolve_config().token == "tok-2"
    said = _save_login("https://127.0.0.1:9555", token, cert)  # another pool: the saved login stays
    assert (
        "kept the saved login to https://127.0.0.1:9443" in said
        and "export CPOOL_SERVER=https://127.0.0.1:9555" in said
    )
    assert json.loads(config.read_text())["server"] == "https://127.0.0.1:9443"
