"""A throwaway PostgreSQL cluster for a chaos run: initdb, pg_ctl start/stop, nothing kept.

PostgreSQL refuses to run as root, so as root the cluster belongs to an unprivileged account
(`postgres` when Debian's package made it). The cluster listens on loopback only, on a port the
kernel picked, with its socket in the run's own directory: runs on one host never meet.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
from pathlib import Path


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries here, or the cluster would not start (the message says which)."""


def _bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not found:
        raise PostgresUnavailable(
            "PostgreSQL binaries not found under /usr/lib/postgresql/*/bin (install Debian's postgresql)"
        )
    return Path(found[-1]).parent


def _os_user() -> str | None:
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "cpool-pg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresUnavailable("as root PostgreSQL needs an unprivileged account: create 'postgres'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TempPostgres:
    """One cluster under `root` (made 0755 so the account can reach its directory)."""

    USER = "cpool"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bindir = _bindir()
        self.os_user = _os_user()
        self.port = _free_port()
        self.datadir = root / "data"

    def _run(self, *args: str, timeout: float = 120) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.os_user:
            cmd = ["runuser", "-u", self.os_user, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise PostgresUnavailable(f"{args[0]} failed: {(done.stderr or done.stdout).strip()[-500:]}")

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        if self.os_user:
            shutil.chown(self.root, self.os_user)
        self._run(
            "initdb", "-D", str(self.datadir), "-U", self.USER, "--auth=trust", "-E", "UTF8", "--no-sync"
        )

    def start(self) -> None:
        """Start (again): what was committed before a stop is there."""
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.root / "log"), "-w", "-o", opts, "start")

    def stop(self, mode: str = "immediate") -> None:
        """Stop at once (`immediate`: like a crash; what was committed survives)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop")

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.USER}@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user={self.USER} dbname=postgres"
