"""Helpers of the server tests: a throw-away PostgreSQL server and the app behind a TestClient."""

from __future__ import annotations

import contextlib
import os
import pwd
import socket
import subprocess
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from fastapi import FastAPI
from sqlalchemy import update

warnings.filterwarnings("ignore", message=".*install `httpx2` instead")

from fastapi.testclient import TestClient  # noqa: E402

from computepool.server import ServerSettings  # noqa: E402
from computepool.store.db import db_now  # noqa: E402
from computepool.store.models import Node  # noqa: E402

PG_USER = "cpool"
H = dict[str, str]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def os_user() -> str | None:
    """PostgreSQL refuses to run as root: pick (or create) an unprivileged account."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "cpool-pg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "cpool-pg"], check=True)
    return "cpool-pg"


@dataclass
class PgServer:
    bindir: Path
    root: Path
    port: int
    os_user: str | None
    schemas: list[str] = field(default_factory=list)

    @property
    def datadir(self) -> Path:
        return self.root / "data"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.os_user:
            cmd = ["runuser", "-u", self.os_user, "--", *cmd]
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)

    def init(self) -> None:
        self._run("initdb", "-D", str(self.datadir), "-U", PG_USER, "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200"
        )
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.root / "log"), "-w", "-o", opts, "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "stop")

    def admin_conn(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host="127.0.0.1", port=self.port, user=PG_USER, dbname="postgres", autocommit=True
        )

    def new_database(self) -> str:
        """A fresh, empty schema as the URL's search path: far cheaper than a database per test."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with self.admin_conn() as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')
        self.schemas.append(name)
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/postgres?options=-csearch_path%3D{name}"

    def url(self, dbname: str) -> str:
        return f"postgresql+psycopg://{PG_USER}@127.0.0.1:{self.port}/{dbname}"

    def make_template(self, migrate: Callable[[str], None]) -> str:
        """One database migrated once per session, that `copy_template` clones for each test."""
        name = f"tmpl_{uuid.uuid4().hex[:12]}"
        with self.admin_conn() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        migrate(self.url(name))
        return name

    def copy_template(self, template: str) -> str:
        """A migrated database of the test's own: PostgreSQL copies the template's files."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with self.admin_conn() as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}" STRATEGY FILE_COPY')
        return name

    def drop(self, dbname: str) -> None:
        with self.admin_conn() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


class Api:
    """The real app behind a TestClient, with the bootstrap admin's headers and a few shortcuts."""

    def __init__(self, app: FastAPI, client: TestClient, settings: ServerSettings) -> None:
        self.client = client
        self.settings = settings
        self.app = app
        token = settings.admin_token_path.read_text().strip()
        self.admin: H = {"Authorization": f"Bearer {token}"}

    def __getattr__(self, name: str) -> Any:  # get/post/put/delete/request of the client
        return getattr(self.client, name)

    def ok(self, method: str, path: str, headers: H | None = None, **kw: Any) -> Any:
        r = self.client.request(method, path, headers=headers or self.admin, **kw)
        assert r.status_code < 300, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()

    def tenant(self, name: str, weight: float = 1.0) -> None:
        self.ok("POST", "/api/v1/tenants", json={"name": name, "weight": weight})

    def user(self, name: str, tenant: str, role: str) -> H:
        """Create a user and a token for it; return its headers."""
        self.ok("POST", "/api/v1/users", json={"name": name, "tenant": tenant, "role": role})
        tok = self.ok("POST", "/api/v1/tokens", json={"user": name})
        return {"Authorization": f"Bearer {tok['token']}"}

    def join_node(self, name: str, devices: int = 2, **jt: Any) -> H:
        token = self.ok("POST", "/api/v1/join-tokens", json=jt)["token"]
        body = {
            "join_token": token,
            "name": name,
            "cpu_milli": 16000,
            "memory_mib": 65536,
            "labels": {"zone": "a"},
            "devices": [
                {"index": i, "vendor": "nvidia", "model": "A100", "memory_mib": 40960, "uuid": f"G-{name}{i}"}
                for i in range(devices)
            ],
        }
        cred = self.ok("POST", "/api/v1/nodes/join", json=body, headers={})["credential"]
        return {"Authorization": f"Bearer {cred}"}


def heartbeat_ago(api: Api, node: str, seconds: float) -> None:
    """As if `node`'s last heartbeat came `seconds` ago by the database's clock: tests move time
    this way instead of sleeping through it (a busy machine stretches any sleep)."""
    with api.app.state.db.write() as s:
        at = db_now(s) - timedelta(seconds=seconds)
        s.execute(update(Node).where(Node.name == node).values(last_heartbeat_at=at))
    api.app.state.leadership.observed_since(at)  # the leader has watched the node as long


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """A real tmpfs of `size` (e.g. "1m") mounted at `path` (made), unmounted after: a disk to fill
    (with `inodes`, one that runs out of inodes first)."""
    path.mkdir()
    opts = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
