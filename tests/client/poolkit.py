"""Helpers of the client tests: a real `cpool server` process on loopback, and error-line checks.

The server runs the same code as the tests (PYTHONPATH points at this checkout), on SQLite in a
temporary folder, on a free port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import Result

import computepool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
from harness import free_port  # noqa: E402

SRC = str(Path(computepool.__file__).resolve().parent.parent)
ALLOCATIONS_API = Path(SRC) / "computepool" / "server" / "routers" / "allocations.py"
needs_allocations = pytest.mark.skipif(
    not ALLOCATIONS_API.exists(),
    reason="no allocations API in the server yet (routers/allocations.py)",
)


@dataclass(frozen=True)
class PoolServer:
    url: str
    token: str
    data_dir: Path
    log: Path


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


@contextmanager
def start_server(root: Path, *options: str) -> Iterator[PoolServer]:
    """`cpool server [OPTIONS]` on a free loopback port; stopped with SIGTERM at the end."""
    data_dir, log = root / "data", root / "server.log"
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "computepool.cli.main", "server", "--data-dir", str(data_dir)]
    cmd += ["--port", url.rsplit(":", 1)[1], "--log-level", "warning", *options]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"server did not become ready:\n{log.read_text()}"
            time.sleep(0.1)
        yield PoolServer(url, (data_dir / "admin-token").read_text().strip(), data_dir, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


def one_error_line(r: Result) -> str:
    """The command failed with exactly one line on stderr and no traceback anywhere."""
    assert r.exit_code != 0, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


Cli = Callable[..., Result]
