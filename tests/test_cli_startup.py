"""Every `cpool` command pays the CLI's start-up: it must not load the server, databases or numpy."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from importlib.metadata import version

HEAVY = ("fastapi", "sqlalchemy", "uvicorn", "numpy", "matplotlib", "aiohttp", "alembic", "pydantic")

PROBE = """
import json, sys
from computepool.cli import main
main._register()  # every command module, as `cpool --help` loads them
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_registering_every_command_imports_no_heavy_module() -> None:
    r = _run("-c", PROBE.format(heavy=HEAVY))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def _cpu_s(*args: str) -> float:
    """CPU seconds (user + system) one run of python with `args` took: steadier than wall time on a
    machine shared with other work."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = _run(*args)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert r.returncode == 0, r.stderr
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


HELP_WITH_HEAVY = """
import sys
import fastapi, sqlalchemy, numpy, pydantic  # what the server side loads
from computepool.cli.main import main
sys.argv = ["cpool", "--help"]
main()
"""


def test_help_costs_far_less_than_with_the_server_loaded() -> None:
    """`cpool --help` against the same with the server's libraries loaded as well (as it once did),
    in one run: a ratio, so a slow or busy machine slows both sides alike."""
    helped = min(_cpu_s("-m", "computepool.cli.main", "--help") for _ in range(3))
    heavy = min(_cpu_s("-c", HELP_WITH_HEAVY) for _ in range(3))
    assert helped < 0.75 * heavy, (
        f"cpool --help {helped:.2f} s of CPU vs {heavy:.2f} s with the server's libraries"
    )


def test_version() -> None:
    r = _run("-m", "computepool.cli.main", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"cpool {version('computepool')}"


def test_every_command_word_comes_from_the_module_named_for_it() -> None:
    """`cpool WORD` loads only WORD's module: each word of the table must be a command its function
    registers, and every top-level command of the full app must be in the table."""
    import importlib

    import typer
    from typer.main import get_command

    from computepool.cli import main

    for word, (module, register) in main._QUICK.items():
        one = typer.Typer()
        one.callback()(lambda: None)
        getattr(importlib.import_module(f"computepool.cli.{module}"), register)(one)
        assert word in get_command(one).commands, f"{word} is not a command of {module}.{register}"
    if "fill" not in {c.name for c in main.sim_app.registered_commands}:  # once per test process
        main._register()
    every = set(get_command(main.app).commands) - {"sim", "bench"}  # groups: the full app
    assert every - set(main._QUICK) == set(), "commands missing from main._QUICK"
    assert main._command_word(["--ca", "ca.pem", "ps", "--all"]) == "ps"
    assert main._command_word(["--help"]) is None
