"""`cpool ps` and `cpool run` pay only for what they use: their own command module, typer, the HTTP
client and rich's console — never the server, the agent, the simulator, another command's module or an
optional library no command uses (trio, httpx's own command-line tool).

Each command runs for real, in a child python, against a loopback port nothing listens on: it parses
its options, builds its request, opens a client and fails to connect (exit 1, one line), so every
import on its path happens.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import atexit, json, sys
out = sys.argv[1]
def _report() -> None:
    with open(out, "w") as f:
        json.dump(sorted(name for name, mod in sys.modules.items() if mod is not None), f)
atexit.register(_report)
sys.argv = ["cpool", *sys.argv[2:]]
from computepool.cli.main import main
main()
"""

# Loaded by no client command: the server side, the node side, numbers and plots, other async and
# terminal libraries (typer carries its own click; rich's markdown, syntax and progress are for help
# pages and uploads).
HEAVY = {
    "sqlalchemy", "alembic", "psycopg", "fastapi", "starlette", "uvicorn", "aiohttp", "asyncio",
    "numpy", "matplotlib", "torch", "cryptography", "jinja2", "yaml", "zeroconf", "psutil",
    "trio", "click", "pygments", "markdown_it",
    "rich.progress", "rich.markdown", "rich.syntax", "rich.traceback", "typer.rich_utils",
    "computepool.server", "computepool.agent", "computepool.sim", "computepool.scheduler",
    "computepool.store", "computepool.sdk", "computepool.serving", "computepool.chaos",
}  # fmt: skip

PS = ("ps",)
RUN = ("run", "-d", "--no-code", "--cpus", "0.1", "--", "true")


@pytest.fixture(scope="module")
def refused(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """An environment whose server is a loopback port the kernel gave and nothing listens on, with a
    config file of its own; and a folder for the probes' module lists."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tmp_path_factory.mktemp("cli-budget")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPOOL_")}
    env.update(CPOOL_SERVER=f"http://127.0.0.1:{port}", CPOOL_CONFIG=str(home / "config.json"))
    return env, home


def _probe(env: dict[str, str], out: Path, args: tuple[str, ...]) -> set[str]:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *args], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1 and "cannot reach the pool server" in r.stderr, (r.returncode, r.stderr)
    return set(json.loads(out.read_text()))


def _heavy(loaded: set[str]) -> list[str]:
    return sorted(h for h in HEAVY if h in loaded or any(m.startswith(h + ".") for m in loaded))


@pytest.mark.parametrize(
    ("args", "own", "shared"),
    [
        (PS, "alloc_cmd", {"pool_cmd"}),
        (RUN, "run_cmd", {"alloc_cmd", "pool_cmd", "secrets_cmd"}),  # whose options `run` shares
    ],
    ids=["ps", "run"],
)
def test_a_command_loads_its_own_module_and_nothing_heavy(
    refused: tuple[dict[str, str], Path], args: tuple[str, ...], own: str, shared: set[str]
) -> None:
    env, home = refused
    loaded = _probe(env, home / f"{args[0]}.json", args)
    assert _heavy(loaded) == []
    commands = {
        m.rsplit(".", 1)[1] for m in loaded if m.startswith("computepool.cli.") and m.endswith("_cmd")
    }
    assert own in commands
    assert commands - shared - {own} == set(), "another command's module"
    if args == PS:
        assert not any(m.startswith("computepool.wire.") for m in loaded), "ps needs no wire model"


def _cpu_s(env: dict[str, str], *args: str) -> float:
    """CPU seconds (user + system) of one child python: steadier than wall time on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, *args], env=env, capture_output=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


# How many times `python -c pass` one run of `cpool ps` or `cpool run -d` may cost: twice what they
# cost when this was written (8 and 10 times on the 2-core CI machine, no .pyc files for the package;
# 12 and 14 when they still loaded trio, click and pygments; the server's libraries make it 25 and more).
MAX_RATIO = 20.0


def test_ps_and_run_cost_a_bounded_multiple_of_an_empty_python(refused: tuple[dict[str, str], Path]) -> None:
    """Minimums of interleaved runs, as a ratio, so a busy or slow machine slows both sides alike: at
    least three rounds, and up to five while the bound is not met."""
    env, home = refused
    runs: dict[str, list[float]] = {"pass": [], "ps": [], "run": []}
    ratios: dict[str, float] = {}
    for round_ in range(5):
        runs["pass"].append(_cpu_s(env, "-c", "pass"))
        runs["ps"].append(_cpu_s(env, "-c", PROBE, str(home / "ps-cpu.json"), *PS))
        runs["run"].append(_cpu_s(env, "-c", PROBE, str(home / "run-cpu.json"), *RUN))
        base = max(min(runs["pass"]), 1e-3)
        ratios = {name: min(times) / base for name, times in runs.items() if name != "pass"}
        if round_ >= 2 and max(ratios.values()) < MAX_RATIO:
            break
    assert max(ratios.values()) < MAX_RATIO, f"{ratios} times `python -c pass` ({base * 1000:.0f} ms of CPU)"
